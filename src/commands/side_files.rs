//! `chunkforge side-files`: the files the runtime reads beside the packages,
//! written from the checkpoint into the output folder in one publish.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::{resolve_checkpoint, ExitStatus};
use crate::checkpoint::Checkpoint;
use crate::cli::{SideFilesArgs, SideFilesCmd};
use crate::config::TextConfig;
use crate::progress::peak_rss_bytes;
use crate::sidefiles::{write_side_files, SideFilesReport, SideFilesRequest};
use crate::staging::Staging;
use crate::staging::{OnLocked, OutputLock};

/// What a run did, as `--json` prints it (and `bench side-files` reads it).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Outcome {
    pub checkpoint: PathBuf,
    pub output: PathBuf,
    pub files: Vec<FileLine>,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Writing the files (reading, converting, writing).
    pub write_seconds: f64,
    /// The whole run: checkpoint headers, writing, and the publish with its fsyncs.
    pub total_seconds: f64,
    pub peak_rss_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct FileLine {
    pub path: PathBuf,
    pub bytes: u64,
    pub role: String,
    pub seconds: f64,
}

pub fn run(args: SideFilesCmd, verbose: bool) -> Result<ExitStatus> {
    let started = Instant::now();
    let rope_positions = rope_positions(&args.options)?;
    let dir = resolve_checkpoint(args.model.hf_dir.as_deref(), verbose)?;
    let cfg = TextConfig::load(&dir)?;
    let ckpt = Checkpoint::open(&dir, &cfg)?;
    let out = &args.output;
    if out.exists() && !out.is_dir() {
        bail!("{}: output path exists and is not a folder", out.display());
    }
    // The lock first: it notes whether this run creates the folder, and
    // removes it with the lock file if the run ends without a result.
    let _lock = OutputLock::take(out, OnLocked::from_no_wait(args.no_wait))?;
    let staging = Staging::new(out)?;
    let model_name = match &args.options.model_name {
        Some(n) => n.clone(),
        None => folder_name(&dir),
    };
    let report = write_side_files(&SideFilesRequest {
        hf_dir: &dir,
        cfg: &cfg,
        checkpoint: &ckpt,
        context_length: args.options.ctx,
        rope_positions,
        model_name: &model_name,
        dest: &staging.dir,
        repository: false,
    })?;
    let names: Vec<&str> = report
        .files
        .iter()
        .map(|f| f.path.to_str().expect("side file names are ASCII"))
        .collect();
    staging
        .publish_names(&names)
        .with_context(|| format!("publishing the side files into {}", out.display()))?;
    staging.finish()?;
    let outcome = outcome(&dir, out, &report, started.elapsed().as_secs_f64());
    if args.json {
        println!("{}", serde_json::to_string_pretty(&outcome)?);
    } else {
        eprint!("{}", render(&outcome));
    }
    Ok(ExitStatus::Success)
}

/// `--rope-positions`, defaulting to `--ctx` and never below it.
pub(super) fn rope_positions(a: &SideFilesArgs) -> Result<usize> {
    let n = a.rope_positions.unwrap_or(a.ctx);
    if n < a.ctx {
        bail!(
            "--rope-positions {n} is less than --ctx {}: the runtime would feed rows of zeros (no rotation) \
             for positions {n} and up; give at least {}",
            a.ctx,
            a.ctx
        );
    }
    Ok(n)
}

fn folder_name(dir: &Path) -> String {
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    dir.file_name()
        .map_or("model".to_string(), |n| n.to_string_lossy().into_owned())
}

fn outcome(checkpoint: &Path, out: &Path, r: &SideFilesReport, total_seconds: f64) -> Outcome {
    Outcome {
        checkpoint: checkpoint.to_path_buf(),
        output: out.to_path_buf(),
        files: r
            .files
            .iter()
            .map(|f| FileLine {
                path: f.path.clone(),
                bytes: f.bytes,
                role: f.role.as_str().to_string(),
                seconds: f.seconds,
            })
            .collect(),
        bytes_read: r.bytes_read,
        bytes_written: r.bytes_written(),
        write_seconds: r.seconds,
        total_seconds,
        peak_rss_bytes: peak_rss_bytes(),
    }
}

pub(super) const MIB: f64 = 1024.0 * 1024.0;

/// MiB per second of `bytes` in `seconds`.
pub(super) fn rate(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / MIB / seconds.max(1e-9)
}

/// `bytes` in KiB below 1 MiB, else in MiB.
fn size(bytes: u64) -> String {
    if (bytes as f64) < MIB {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB)
    }
}

/// One line per file, then the totals.
fn render(o: &Outcome) -> String {
    let mut s = String::new();
    for f in &o.files {
        s.push_str(&format!(
            "  {:<36} {:>12}  {:>6.2}s\n",
            f.path.display(),
            size(f.bytes),
            f.seconds
        ));
    }
    s.push_str(&format!(
        "wrote {} side files ({}, from {} of tensors) to {} in {:.2}s: writing {:.2}s \
         ({:.0} MiB/s written), the rest checkpoint headers and the publish with its fsyncs; peak RSS {:.0} MiB\n",
        o.files.len(),
        size(o.bytes_written),
        size(o.bytes_read),
        o.output.display(),
        o.total_seconds,
        o.write_seconds,
        rate(o.bytes_written, o.write_seconds),
        o.peak_rss_bytes as f64 / MIB
    ));
    s
}
