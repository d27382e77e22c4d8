//! `chunkforge build`: convert a checkpoint into Core ML packages, or with
//! `--check` rebuild an earlier build and compare it byte for byte.

use std::path::Path;

use anyhow::Result;

use super::{plan_for, require_utf8, resolve_checkpoint, verdict, ExitStatus, Layout};
use crate::build::{self, Settings};
use crate::checkpoint::{self, Checkpoint};
use crate::cli::BuildCmd;
use crate::publish::OnLocked;
use crate::py::env as pyenv;
use crate::records::{BuildRecord, ConversionSettings, Palettizer, PassPipeline, GROUP_SIZE};

/// One build of the checkpoint in `hf_dir` (None: the built-in one).
/// `lock`: what to do when another run holds the output's lock (None: the
/// output is a fresh temporary folder of this run, not locked).
pub(super) struct BuildJob<'a> {
    pub hf_dir: Option<&'a Path>,
    pub layout: Layout,
    pub quantize: bool,
    pub kmeans_workers: usize,
    pub palettizer: Palettizer,
    pub pass_pipeline: PassPipeline,
    pub compose: bool,
    /// A unit's functions converted together; None: as `CHUNKFORGE_JOINT`
    /// says (`build --check` replays the recorded choice).
    pub joint: Option<bool>,
    /// Time every coremltools graph pass (`bench build --profile`).
    pub profile: bool,
    pub jobs: build::Jobs,
    pub lock: Option<OnLocked>,
}

impl BuildJob<'_> {
    pub(super) fn run(&self, out: &Path, verbose: bool) -> Result<BuildRecord> {
        require_utf8(out, "output")?;
        let dir = resolve_checkpoint(self.hf_dir, verbose)?;
        require_utf8(&dir, "checkpoint")?;
        let (cfg, plan) = plan_for(&dir, &self.layout)?;
        let ckpt = Checkpoint::open(&dir, &cfg)?;
        if self.quantize {
            checkpoint::check_groupable(&ckpt, &cfg, GROUP_SIZE)?;
        }
        pyenv::activate(verbose)?;
        let mut conversion = ConversionSettings::shipped(
            self.layout.ctx,
            self.quantize,
            self.palettizer,
            self.kmeans_workers,
        );
        conversion.pass_pipeline = self.pass_pipeline;
        conversion.compose = self.compose;
        conversion.joint = match self.joint {
            Some(joint) => joint,
            None => build::joint_conversions()?,
        };
        let settings = Settings {
            conversion,
            profile: self.profile,
            jobs: self.jobs,
            verbose,
            lock: self.lock,
        };
        let request = self.layout.record();
        build::run(&dir, &cfg, &ckpt, &plan, request, out, &settings)
    }
}

pub fn run(args: BuildCmd, verbose: bool) -> Result<ExitStatus> {
    if let Some(dir) = &args.check {
        return check(dir, &args, verbose);
    }
    let output = args
        .output
        .as_ref()
        .expect("clap: --output is required without --check");
    let record = BuildJob {
        hf_dir: args.model.hf_dir.as_deref(),
        layout: Layout::of(&args.layout),
        quantize: !args.no_quantize,
        kmeans_workers: args.kmeans_workers,
        palettizer: args.palettizer,
        pass_pipeline: args.pass_pipeline,
        compose: !args.no_compose,
        joint: None,
        profile: false,
        jobs: args.jobs,
        lock: Some(OnLocked::from_no_wait(args.no_wait)),
    }
    .run(output, verbose)?;
    eprintln!("{}", summary(&record, output));
    Ok(ExitStatus::Success)
}

/// `--check DIR`: the recorded build again into a temporary folder; exit 1
/// when any package differs.
fn check(dir: &Path, args: &BuildCmd, verbose: bool) -> Result<ExitStatus> {
    let old = build::request_of(&dir.join("build.json"), &args.model.hf_dir)?;
    let tmp = std::env::temp_dir().join(format!("chunkforge-check-{}", std::process::id()));
    let result = BuildJob {
        hf_dir: old.hf_dir.as_deref(),
        layout: old.layout,
        quantize: old.quantize,
        kmeans_workers: args.kmeans_workers,
        palettizer: old.palettizer,
        pass_pipeline: old.pass_pipeline,
        compose: old.compose,
        joint: Some(old.joint),
        profile: false,
        jobs: args.jobs,
        lock: None,
    }
    .run(&tmp, verbose);
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
