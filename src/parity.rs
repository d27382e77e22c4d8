//! `chunkforge parity`: merged layouts vs the four-chunk reference, the
//! reference vs transformers, prefill hand-off and INT4 artifacts. The numbers
//! come from Python (torch, fp32 CPU); printing, verdict and report are here.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::checkpoint::Checkpoint;
use crate::config::TextConfig;
use crate::hashing;
use crate::plan::{self, LayoutKind, Mode, Plan};
use crate::progress;
use crate::py::env as pyenv;
use crate::staging;

/// Options of one parity run.
pub struct ParityOptions {
    pub mode: Mode,
    /// verify_qK and prefill functions to check (`--mode all` asks for both).
    pub functions: plan::Functions,
    pub split: Option<String>,
    pub steps: usize,
    pub tol_cos: f64,
    pub ctx: usize,
    pub prompt_ids: Option<Vec<i64>>,
    pub prefill: usize,
    pub skip_prefill_copy: bool,
    pub artifacts: Option<PathBuf>,
    pub tol_cos_int4: f64,
    pub min_top1_int4: f64,
    pub max_weight_rel_mse: f64,
    pub report: Option<PathBuf>,
    pub oracle: bool,
    pub corrupt_layer: Option<usize>,
    pub corrupt_function: Option<CorruptFunction>,
    pub verbose: bool,
}

chunkforge_model::named! {
    /// `--corrupt-function` (testing aid): which modules `--corrupt-layer` corrupts.
    pub enum CorruptFunction {
        Verify = "verify",
        Prefill = "prefill",
    }
}

/// The default prompt shipped in `parity/default_prompt.json`.
pub const DEFAULT_PROMPT: &str = include_str!("../parity/default_prompt.json");

fn default_prompt() -> Result<Vec<i64>> {
    let v: Value = serde_json::from_str(DEFAULT_PROMPT)?;
    Ok(v["prompt_ids"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_i64)
        .collect())
}

/// Parses `--prompt-ids 2,105,23` (commas or spaces).
pub fn parse_prompt(text: &str) -> Result<Vec<i64>> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<i64>()
                .with_context(|| format!("--prompt-ids: `{s}` is not a token id"))
        })
        .collect()
}

fn layout_json(l: &plan::Layout) -> Value {
    json!({"name": l.kind, "chunks": l.chunks, "kv_slot_map": l.kv_slot_map})
}

/// Runs parity; returns whether everything passed.
pub fn run(
    hf_dir: &Path,
    cfg: &TextConfig,
    ckpt: &Checkpoint,
    opts: &ParityOptions,
) -> Result<bool> {
    if opts.steps == 0 {
        bail!("--steps must be at least 1");
    }
    // `--prefill N` without prefill functions in the request checks one of exactly N tokens.
    let mut functions = opts.functions.clone();
    if opts.prefill > 0 && functions.prefill_lens.is_empty() {
        functions.prefill_lens = vec![opts.prefill];
    }
    let requested: Plan = plan::plan(cfg, opts.ctx, opts.mode, opts.split.as_deref(), &functions)?;
    let four = match requested
        .layouts
        .iter()
        .find(|l| l.kind == LayoutKind::Four)
    {
        Some(l) => l.clone(),
        None => plan::plan_layout(
            cfg,
            opts.ctx,
            LayoutKind::Four,
            &plan::layout_spans(cfg, LayoutKind::Four),
        ),
    };
    let decode = |l: &&plan::Layout| l.kind != LayoutKind::Prefill;
    let compared: Vec<&plan::Layout> = requested
        .layouts
        .iter()
        .filter(decode)
        .filter(|l| l.kind != LayoutKind::Four)
        .collect();
    let prefill_layout = requested
        .layouts
        .iter()
        .find(|l| l.kind == LayoutKind::Prefill)
        .map(layout_json);
    let mut layouts = vec![layout_json(&four)];
    layouts.extend(compared.iter().map(|l| layout_json(l)));
    let artifact_layouts: serde_json::Map<String, Value> = requested
        .layouts
        .iter()
        .filter(decode)
        .map(|l| (l.kind.to_string(), layout_json(l)))
        .collect();
    let prompt = match &opts.prompt_ids {
        Some(p) => p.clone(),
        None => default_prompt()?,
    };
    let req = json!({
        "plan": {"dims": requested.dims},
        "reference": "four",
        "layouts": layouts,
        "checkpoint": {
            "prefix": ckpt.prefix,
            "files": ckpt.files.iter().map(|(k, v)| (k.clone(), Value::String(v.to_string_lossy().into()))).collect::<serde_json::Map<_, _>>(),
        },
        "config_path": hf_dir.join("config.json").to_string_lossy(),
        "prompt_ids": prompt,
        "steps": opts.steps,
        "tol_cos": opts.tol_cos,
        "prefill": opts.prefill,
        "prefill_layout": prefill_layout,
        "skip_prefill_copy": opts.skip_prefill_copy,
        "oracle": opts.oracle,
        "corrupt_layer": opts.corrupt_layer,
        "corrupt_function": opts.corrupt_function,
        "artifacts": opts.artifacts.as_ref().map(|p| p.to_string_lossy().to_string()),
        "artifact_layouts": artifact_layouts,
        "tol_cos_int4": opts.tol_cos_int4,
        "min_top1_int4": opts.min_top1_int4,
        "max_weight_rel_mse": opts.max_weight_rel_mse,
    });
    for w in &requested.warnings {
        eprintln!("note: {w}");
    }
    let sp = progress::spinner(format!(
        "parity: {} steps, layouts {} vs four-chunk reference{}",
        opts.steps,
        compared
            .iter()
            .map(|l| l.kind.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        if opts.oracle {
            " + transformers oracle"
        } else {
            ""
        }
    ));
    let result = pyenv::call_json("parity", "run", &req, opts.verbose);
    sp.finish_and_clear();
    let mut report = result?;

    for r in report["steps"].as_array().into_iter().flatten() {
        println!(
            "{:<6} step {:>3}  cos {:.6}  ref {:>6}  token {:>6}  margin {:>7.3}  {}",
            r["layout"].as_str().unwrap_or(""),
            r["step"].as_i64().unwrap_or(-1),
            r["cos"].as_f64().unwrap_or(f64::NAN),
            r["ref_token"].as_i64().unwrap_or(-1),
            r["token"].as_i64().unwrap_or(-1),
            r["margin"].as_f64().unwrap_or(f64::NAN),
            if r["ok"].as_bool() == Some(true) {
                "OK"
            } else {
                "FAIL"
            }
        );
    }
    for o in report["oracle"].as_array().into_iter().flatten() {
        println!(
            "reference vs transformers step {:>3}  cos {:.6}  hf {:>6}  ref {:>6}  margin {:>7.3}  {}",
            o["step"].as_i64().unwrap_or(-1),
            o["cos"].as_f64().unwrap_or(f64::NAN),
            o["hf_token"].as_i64().unwrap_or(-1),
            o["ref_token"].as_i64().unwrap_or(-1),
            o["margin"].as_f64().unwrap_or(f64::NAN),
            if o["ok"].as_bool() == Some(true) { "OK" } else { "FAIL" }
        );
    }
    let summary = report["summary"].clone();
    if let Some(arts) = summary["artifacts"].as_object() {
        for (name, s) in arts {
            let verdict = if s["ok"].as_bool() == Some(true) {
                "OK"
            } else {
                "FAIL"
            };
            if s["tokens_match"].is_boolean() {
                // verify_qK / prefill_bN with their packages' weights, against the
                // INT4 four-chunk decode of the same build.
                println!(
                    "INT4 artifacts {name:<6} vs the INT4 four-chunk decode: min cos {:.6} over {} steps, tokens match: {}  ({} weights read back)  {verdict}",
                    s["min_cos"].as_f64().unwrap_or(f64::NAN),
                    s["steps"],
                    s["tokens_match"],
                    s["weights_replaced"].as_object().map_or(0, |m| m.values().filter_map(Value::as_u64).sum::<u64>()),
                );
                continue;
            }
            println!(
                "INT4 artifacts {name:<6} min cos {:.6}  mean cos {:.6}  top-1 agreement {:.1}%  ({} weights read back, worst relative MSE {:.2e} in {})  {}",
                s["min_cos"].as_f64().unwrap_or(f64::NAN),
                s["mean_cos"].as_f64().unwrap_or(f64::NAN),
                100.0 * s["top1_agreement"].as_f64().unwrap_or(0.0),
                s["weights_replaced"].as_object().map_or(0, |m| m.values().filter_map(Value::as_u64).sum::<u64>()),
                s["worst_weight"]["rel_mse"].as_f64().unwrap_or(f64::NAN),
                s["worst_weight"]["weight"].as_str().unwrap_or("-"),
                verdict
            );
        }
    }

    let versions = pyenv::call_json("runtime", "versions", &Value::Null, opts.verbose)?;
    if let Some(obj) = report.as_object_mut() {
        obj.insert("format".into(), json!("chunkforge-parity/1"));
        obj.insert(
            "checkpoint".into(),
            json!({"dir": hf_dir.to_string_lossy(), "config_sha256": hashing::sha256_file(&hf_dir.join("config.json"))?}),
        );
        obj.insert(
            "prompt_ids".into(),
            json!(prompt.iter().take(opts.steps).collect::<Vec<_>>()),
        );
        obj.insert(
            "tool".into(),
            json!({"chunkforge": env!("CARGO_PKG_VERSION"), "python": versions}),
        );
    }
    if let Some(path) = &opts.report {
        staging::write_atomic(path, &serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing the parity report {}", path.display()))?;
    }

    let ok = summary["ok"].as_bool() == Some(true);
    let tol = opts.tol_cos;
    if ok {
        println!("PARITY OK across {} steps (cos >= {tol}).", opts.steps);
    } else {
        println!("PARITY FAIL");
        if let Some(f) = summary["first_failure"].as_object() {
            println!(
                "first failing step: layout {} step {} (cos {:.6}, token {} vs reference {})",
                f["layout"].as_str().unwrap_or(""),
                f["step"],
                f["cos"].as_f64().unwrap_or(f64::NAN),
                f["token"],
                f["ref_token"]
            );
        }
        for (name, loc) in summary["localisation"].as_object().into_iter().flatten() {
            match loc["layer"].as_u64() {
                Some(layer) => println!(
                    "{name}: first divergence at layer {layer} in {} (cos {:.6} vs the reference's hidden state after that layer, step {})",
                    loc["chunk"].as_str().unwrap_or("?"),
                    loc["cos"].as_f64().unwrap_or(f64::NAN),
                    loc["step"]
                ),
                None => println!(
                    "{name}: every layer's hidden state matches the reference at step {}; the divergence is in the final norm / head",
                    loc["step"]
                ),
            }
        }
        if summary["oracle_ok"].as_bool() == Some(false) {
            println!("the four-chunk reference disagrees with transformers (see the `reference vs transformers` lines)");
        }
        for (name, s) in summary["artifacts"].as_object().into_iter().flatten() {
            if s["ok"].as_bool() != Some(true) && s["tokens_match"].is_boolean() {
                println!(
                    "INT4 artifacts of {name} fail: its package's weights do not reproduce the INT4 \
                     four-chunk decode (cos >= {} and the same token at every step)",
                    opts.tol_cos
                );
            } else if s["ok"].as_bool() != Some(true) {
                println!(
                    "INT4 artifacts of {name} fail: thresholds --tol-cos-int4 {}, --min-top1-int4 {}, \
                     --max-weight-rel-mse {}; tokens match the other layouts' INT4 models: {}",
                    opts.tol_cos_int4,
                    opts.min_top1_int4,
                    opts.max_weight_rel_mse,
                    s["tokens_match_other_layouts"]
                );
            }
        }
    }
    Ok(ok)
}
