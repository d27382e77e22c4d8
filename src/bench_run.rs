//! `chunkforge bench run`: `run`'s speed side by side with the alternatives,
//! in one invocation, on the same prompt and machine: `run` as it is
//! (weights in their stored form, the native kernels), `run` on today's
//! path before them (`CHUNKFORGE_MATMUL=dense`: every weight made dense in
//! float32, torch's products), and transformers' own `generate` on the
//! source checkpoint (bf16 weights in memory, sdpa attention, all cores).
//! Each runs in a child process of its own: its wall time, peak RSS, the
//! prompt's prefill and the decode rate after it.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::py::env as pyenv;

/// What `bench run` compares.
pub struct BenchRunOptions<'a> {
    pub release: &'a Path,
    /// The checkpoint the release was built from (transformers' side).
    pub checkpoint: Option<PathBuf>,
    pub prompt: &'a str,
    /// The prompt's tokens, cycled to this many (the prefill measured).
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    pub baseline: bool,
    pub json: bool,
}

/// One side of the comparison.
#[derive(Serialize, Deserialize, JsonSchema, Debug, Clone)]
pub struct Arm {
    pub name: String,
    pub wall_seconds: f64,
    pub peak_rss_bytes: u64,
    pub load_seconds: f64,
    pub prefill_seconds: f64,
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
    pub generated_ids: Vec<i64>,
}

/// `bench run --json`.
#[derive(Serialize, Deserialize, JsonSchema, Debug, Clone)]
pub struct BenchRunReport {
    pub prompt_ids: Vec<i64>,
    pub max_tokens: usize,
    pub arms: Vec<Arm>,
}

/// Runs `cmd`, its stdout captured, and gives (stdout, wall seconds, peak
/// RSS in bytes: the child's own, from wait4).
fn child(mut cmd: Command, what: &str) -> Result<(String, f64, u64)> {
    let started = Instant::now();
    let mut c = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot start {what}"))?;
    let mut out = String::new();
    c.stdout
        .take()
        .expect("piped")
        .read_to_string(&mut out)
        .with_context(|| format!("{what}: reading its output"))?;
    let mut status = 0;
    // SAFETY: rusage is plain data; the pid is our own child, not reaped yet.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = c.id() as libc::pid_t;
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if r != pid {
        bail!("{what}: wait4 failed: {}", std::io::Error::last_os_error());
    }
    let wall = started.elapsed().as_secs_f64();
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        bail!("{what} failed (status {status})");
    }
    Ok((out, wall, usage.ru_maxrss as u64 * 1024))
}

/// The last JSON object a child printed.
fn last_json(out: &str, what: &str) -> Result<serde_json::Value> {
    let start = out
        .rfind("\n{")
        .map(|i| i + 1)
        .or_else(|| out.starts_with('{').then_some(0))
        .with_context(|| format!("{what}: no JSON in its output"))?;
    serde_json::from_str(&out[start..]).with_context(|| format!("{what}: unreadable JSON"))
}

fn ids_of(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .map(|a| a.iter().filter_map(|x| x.as_i64()).collect())
        .unwrap_or_default()
}

/// The prompt's ids by the release's tokenizer, cycled to `n` tokens.
fn prompt_ids(release: &Path, text: &str, n: usize) -> Result<Vec<i64>> {
    let python = pyenv::venv_dir()?.join("bin").join("python");
    let tokenizer = release.join("hf_model").join("tokenizer.json");
    let mut cmd = Command::new(&python);
    cmd.args([
        "-c",
        "import json, sys\nfrom tokenizers import Tokenizer\n\
         print(json.dumps(Tokenizer.from_file(sys.argv[1]).encode(sys.argv[2]).ids))",
    ])
    .arg(&tokenizer)
    .arg(text);
    let (out, _, _) = child(cmd, "the tokenizer")?;
    let ids: Vec<i64> = serde_json::from_str(out.trim())
        .with_context(|| format!("{}: no ids", tokenizer.display()))?;
    if ids.is_empty() {
        bail!("the prompt {text:?} has no tokens");
    }
    Ok(ids.iter().cycle().take(n.max(1)).copied().collect())
}

fn run_arm(name: &str, exe: &Path, o: &BenchRunOptions, ids: &str, dense: bool) -> Result<Arm> {
    let mut cmd = Command::new(exe);
    cmd.arg("run")
        .arg(o.release)
        .args(["--prompt-ids", ids, "--max-tokens"])
        .arg(o.max_tokens.to_string())
        .arg("--json");
    if dense {
        cmd.env(crate::commands::bench::MATMUL_ENV, "dense");
    } else {
        cmd.env_remove(crate::commands::bench::MATMUL_ENV);
    }
    eprintln!("bench run: {name}");
    let (out, wall, rss) = child(cmd, name)?;
    let v = last_json(&out, name)?;
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    let prefilled = v["prefill_tokens"].as_f64().unwrap_or(0.0);
    Ok(Arm {
        name: name.to_string(),
        wall_seconds: wall,
        peak_rss_bytes: rss,
        load_seconds: f("load_seconds"),
        prefill_seconds: f("prefill_seconds"),
        prefill_tokens_per_second: prefilled / f("prefill_seconds").max(1e-9),
        decode_tokens_per_second: f("decode_tokens_per_second"),
        generated_ids: ids_of(&v["generated_ids"]),
    })
}

fn transformers_arm(checkpoint: &Path, o: &BenchRunOptions, ids: &str, n: usize) -> Result<Arm> {
    let name = "transformers generate (bf16, sdpa)";
    let python = pyenv::venv_dir()?.join("bin").join("python");
    let mut cmd = Command::new(python);
    cmd.args(["-m", "chunkforge_py.emulate.transformers_generate"])
        .arg(checkpoint)
        .arg(ids)
        .arg(o.max_tokens.to_string())
        .env("PYTHONPATH", pyenv::python_dir());
    eprintln!("bench run: {name}");
    let (out, wall, rss) = child(cmd, name)?;
    let v = last_json(&out, name)?;
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    Ok(Arm {
        name: name.to_string(),
        wall_seconds: wall,
        peak_rss_bytes: rss,
        load_seconds: f("load_seconds"),
        prefill_seconds: f("prefill_seconds"),
        prefill_tokens_per_second: n as f64 / f("prefill_seconds").max(1e-9),
        decode_tokens_per_second: f("decode_tokens_per_second"),
        generated_ids: ids_of(&v["generated_ids"]),
    })
}

pub fn run(o: &BenchRunOptions) -> Result<()> {
    let exe = std::env::current_exe().context("cannot find the chunkforge executable")?;
    let ids = prompt_ids(o.release, o.prompt, o.prompt_tokens)?;
    let csv = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let mut arms = vec![run_arm(
        "run (stored weights, native kernels)",
        &exe,
        o,
        &csv,
        false,
    )?];
    if o.baseline {
        arms.push(run_arm(
            "run, before (CHUNKFORGE_MATMUL=dense)",
            &exe,
            o,
            &csv,
            true,
        )?);
    }
    if let Some(ckpt) = &o.checkpoint {
        arms.push(transformers_arm(ckpt, o, &csv, ids.len())?);
    }
    let report = BenchRunReport {
        prompt_ids: ids,
        max_tokens: o.max_tokens,
        arms,
    };
    if o.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

fn render(r: &BenchRunReport) -> String {
    let mut s = format!(
        "a {}-token prompt, then up to {} tokens, greedy:\n\n{:<40} {:>8} {:>10} {:>9} {:>10} {:>11} {:>10}\n",
        r.prompt_ids.len(),
        r.max_tokens,
        "",
        "wall",
        "peak RSS",
        "load",
        "prefill",
        "prefill t/s",
        "decode t/s"
    );
    for a in &r.arms {
        s += &format!(
            "{:<40} {:>7.1}s {:>6.0} MiB {:>8.1}s {:>9.2}s {:>11.1} {:>10.2}\n",
            a.name,
            a.wall_seconds,
            a.peak_rss_bytes as f64 / (1u64 << 20) as f64,
            a.load_seconds,
            a.prefill_seconds,
            a.prefill_tokens_per_second,
            a.decode_tokens_per_second
        );
    }
    let ours = &r.arms[0];
    for other in &r.arms[1..] {
        let same = ours
            .generated_ids
            .iter()
            .zip(&other.generated_ids)
            .take_while(|(a, b)| a == b)
            .count();
        s += &format!(
            "\nagainst {}: {:.1}x per decoded token, {:.1}x the prefill rate; the first {same} of {} ids equal",
            other.name,
            ours.decode_tokens_per_second / other.decode_tokens_per_second.max(1e-9),
            ours.prefill_tokens_per_second / other.prefill_tokens_per_second.max(1e-9),
            ours.generated_ids.len().min(other.generated_ids.len())
        );
    }
    s + "\n"
}
