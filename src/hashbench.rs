//! `chunkforge bench hash`: how fast a release is hashed and signed, next to
//! `openssl dgst -sha256` and `model_signing sign key` on the same data, in
//! the same run: one big file (default 2 GiB) and eight smaller ones
//! (default 256 MiB each). Every tool gets the same warm page cache; each
//! timing is the best of `--repeat` runs.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::cli::HashBenchArgs;
use crate::hashing;
use crate::package;
use crate::publish;
use crate::sign::{self, SIG_FILE};

/// Fills `path` with `mib` MiB of pseudo-random bytes (xorshift; content does
/// not change SHA-256 speed, but keeps compressing file systems honest).
fn make_file(path: &Path, mib: u64, seed: u64) -> Result<()> {
    let mut f =
        fs::File::create(path).with_context(|| format!("{}: cannot create", path.display()))?;
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..mib {
        for w in buf.chunks_exact_mut(8) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            w.copy_from_slice(&s.to_le_bytes());
        }
        f.write_all(&buf)
            .with_context(|| format!("{}: write failed (disk full?)", path.display()))?;
    }
    Ok(())
}

fn best_of(repeat: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn run_quiet(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("cannot start {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn default_model_signing() -> Result<PathBuf> {
    Ok(crate::cache_dir::cache_dir()?
        .join("signing-venv")
        .join("bin")
        .join("model_signing"))
}

fn sha_ni() -> &'static str {
    let info = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    if info.split_whitespace().any(|w| w == "sha_ni") {
        "yes"
    } else if cfg!(target_arch = "x86_64") {
        "no (portable SHA-256)"
    } else {
        "n/a"
    }
}

/// One row of the table.
struct Row {
    data: String,
    tool: &'static str,
    seconds: Option<f64>,
    bytes: u64,
    note: String,
}

pub fn run(a: &HashBenchArgs) -> Result<()> {
    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let work = base.join(format!("chunkforge-bench-hash-{}", std::process::id()));
    fs::create_dir_all(&work).with_context(|| format!("{}: cannot create", work.display()))?;
    let result = run_in(a, &work);
    if !a.keep {
        let _ = fs::remove_dir_all(&work);
    } else {
        eprintln!("kept the data in {}", work.display());
    }
    result
}

fn run_in(a: &HashBenchArgs, work: &Path) -> Result<()> {
    let (key_path, pub_path) = sign::keygen(&work.join("bench-key"))?;
    let _ = pub_path;
    let key = sign::load_private_key(&key_path)?;
    let ms = a
        .model_signing
        .clone()
        .map_or_else(default_model_signing, Ok)?;
    let have_ms = ms.is_file();
    let have_openssl = Command::new("openssl")
        .arg("version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());

    let sets: Vec<(String, Vec<u64>)> = vec![
        (format!("1 x {} MiB", a.big_mib), vec![a.big_mib]),
        (
            format!("{} x {} MiB", a.small_count, a.small_mib),
            vec![a.small_mib; a.small_count],
        ),
    ];
    let mut rows = Vec::new();
    for (si, (label, sizes)) in sets.iter().enumerate() {
        let data = work.join(format!("data{si}"));
        fs::create_dir_all(&data)?;
        eprintln!("writing {label} into {} ...", data.display());
        for (i, mib) in sizes.iter().enumerate() {
            make_file(
                &data.join(format!("weights-{i:02}.bin")),
                *mib,
                (si * 100 + i) as u64 + 1,
            )?;
        }
        let files: Vec<String> = (0..sizes.len())
            .map(|i| format!("weights-{i:02}.bin"))
            .collect();
        let bytes: u64 = sizes.iter().sum::<u64>() << 20;
        // Warm the page cache so every tool reads from memory.
        for r in hashing::hash_all(&data, &files) {
            r?;
        }
        let row = |tool, seconds, note: String| Row {
            data: label.clone(),
            tool,
            seconds,
            bytes,
            note,
        };

        let out = work.join(format!("release{si}"));
        // With and without the fsyncs that make a publish survive a power
        // cut: the difference is their cost.
        for (durable, tool, note) in [
            (true, "chunkforge package", "copy+hash, sign, fsync, rename"),
            (
                false,
                "chunkforge package, no fsync",
                "the same without fsync",
            ),
        ] {
            publish::set_durable(durable);
            let t = best_of(a.repeat, || {
                let _ = fs::remove_dir_all(&out);
                package::copy_sign_publish(&data, &out, &key).map(|_| ())
            });
            publish::set_durable(true);
            rows.push(row(tool, Some(t?), note.into()));
            let _ = fs::remove_dir_all(&out);
        }

        let sig = work.join(format!("cf{si}.sig"));
        let t = best_of(a.repeat, || {
            let tree = hashing::walk(&data, &|r| r == SIG_FILE)?;
            let digests: Vec<(String, hashing::FileDigest)> = tree
                .files
                .iter()
                .cloned()
                .zip(hashing::hash_all(&data, &tree.files))
                .map(|(n, d)| d.map(|d| (n, d)))
                .collect::<Result<_, _>>()?;
            let st = sign::statement("data", &digests, &[SIG_FILE], None);
            fs::write(&sig, sign::sign_bundle(&key, &st))?;
            Ok(())
        })?;
        rows.push(row(
            "chunkforge hash+sign in place",
            Some(t),
            "same work as model_signing".into(),
        ));

        if have_openssl {
            let t = best_of(a.repeat, || {
                run_quiet(
                    Command::new("openssl")
                        .args(["dgst", "-sha256"])
                        .args(files.iter().map(|f| data.join(f))),
                    "openssl dgst -sha256",
                )
            })?;
            rows.push(row(
                "openssl dgst -sha256",
                Some(t),
                "one process, files in turn".into(),
            ));
        } else {
            rows.push(row(
                "openssl dgst -sha256",
                None,
                "openssl not found".into(),
            ));
        }

        if have_ms {
            let ms_sig = work.join(format!("ms{si}.sig"));
            let t = best_of(a.repeat, || {
                run_quiet(
                    Command::new(&ms)
                        .args(["sign", "key"])
                        .arg(&data)
                        .arg("--private_key")
                        .arg(&key_path)
                        .arg("--signature")
                        .arg(&ms_sig),
                    "model_signing sign key",
                )
            })?;
            rows.push(row(
                "model_signing sign key",
                Some(t),
                "incl. Python start-up".into(),
            ));
        } else {
            rows.push(row(
                "model_signing sign key",
                None,
                format!("{} not found: run scripts/setup-signing.sh", ms.display()),
            ));
        }
        fs::remove_dir_all(&data)?;
    }

    println!(
        "SHA-NI: {}   threads: {}   best of {}",
        sha_ni(),
        rayon::current_num_threads(),
        a.repeat.max(1)
    );
    println!(
        "{:<16} {:<32} {:>9} {:>9}  note",
        "data", "tool", "seconds", "GiB/s"
    );
    for r in &rows {
        match r.seconds {
            Some(s) => println!(
                "{:<16} {:<32} {:>8.2}s {:>9.2}  {}",
                r.data,
                r.tool,
                s,
                r.bytes as f64 / (1u64 << 30) as f64 / s,
                r.note
            ),
            None => println!(
                "{:<16} {:<32} {:>9} {:>9}  {}",
                r.data, r.tool, "-", "-", r.note
            ),
        }
    }
    Ok(())
}
