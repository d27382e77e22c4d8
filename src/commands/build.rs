//! `chunkforge build`: convert a checkpoint into Core ML packages, or with
//! `--check` rebuild an earlier build and compare it byte for byte.

use std::path::Path;

use anyhow::Result;

use super::{plan_for, require_utf8, resolve_checkpoint, verdict, ExitStatus};
use crate::build;
use crate::checkpoint::{self, Checkpoint};
use crate::cli::BuildCmd;
use crate::py::env as pyenv;
use crate::records::{BuildRecord, GROUP_SIZE};
use crate::settings::{BuildCommand, BuildSettings, Env};

/// Builds `settings` into `out`.
pub(super) fn build(settings: &BuildSettings, out: &Path, verbose: bool) -> Result<BuildRecord> {
    require_utf8(out, "output")?;
    let dir = resolve_checkpoint(settings.hf_dir.as_deref(), verbose)?;
    require_utf8(&dir, "checkpoint")?;
    let (cfg, plan) = plan_for(&dir, &settings.layout)?;
    let ckpt = Checkpoint::open(&dir, &cfg)?;
    if settings.conversion.quantize {
        checkpoint::check_groupable(&ckpt, &cfg, GROUP_SIZE)?;
    }
    pyenv::activate(verbose)?;
    build::run(&dir, &cfg, &ckpt, &plan, out, settings, verbose)
}

pub fn run(args: BuildCmd, verbose: bool) -> Result<ExitStatus> {
    let env = Env::process();
    if let Some(dir) = &args.check {
        super::plain_folder(dir)?;
        let settings = BuildSettings::resolve(BuildCommand::Check(&args, dir), &env)?;
        return check(dir, &settings, verbose);
    }
    let output = args
        .output
        .as_ref()
        .expect("clap: --output is required without --check");
    let settings = BuildSettings::resolve(BuildCommand::Build(&args), &env)?;
    let record = build(&settings, output, verbose)?;
    eprintln!("{}", summary(&record, output));
    Ok(ExitStatus::Success)
}

/// `--check DIR`: the recorded build (`settings`) again into a temporary
/// folder; exit 1 when any package differs.
fn check(dir: &Path, settings: &BuildSettings, verbose: bool) -> Result<ExitStatus> {
    let tmp = std::env::temp_dir().join(format!("chunkforge-check-{}", std::process::id()));
    let result = build(settings, &tmp, verbose);
    let same = result.and_then(|fresh| build::compare(dir, &tmp, &fresh));
    let _ = std::fs::remove_dir_all(&tmp);
    let same = same?;
    if same {
        println!(
            "REPRODUCIBLE: every package in {} is byte-identical to a fresh build",
            dir.display()
        );
    } else {
        eprintln!(
            "error: {}: a fresh build differs (see above)",
            dir.display()
        );
    }
    Ok(verdict(same))
}

/// The line `build` ends with: packages, time per phase, peak memory.
pub(super) fn summary(record: &BuildRecord, out: &Path) -> String {
    let phases: Vec<String> = record
        .seconds
        .phases
        .iter()
        .map(|(k, v)| format!("{k} {v:.1}s"))
        .collect();
    // Phase seconds add up over processes.
    let on = match record.processes {
        1 => String::new(),
        n => format!(" on {n} processes"),
    };
    format!(
        "wrote {} packages to {} in {:.1}s{on} ({}); peak RSS {:.0} MiB",
        record.chunks.len(),
        out.display(),
        record.seconds.total,
        phases.join(", "),
        record.peak_rss_bytes as f64 / (1024.0 * 1024.0)
    )
}
