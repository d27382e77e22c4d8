//! `chunkforge build`: convert a checkpoint into Core ML packages, or with
//! `--check` rebuild an earlier build and compare it byte for byte.

use std::path::Path;

use anyhow::Result;

use super::{plan_for, require_utf8, resolve_checkpoint, verdict, ExitStatus};
use crate::build::{self, Settings};
use crate::checkpoint::{self, Checkpoint};
use crate::cli::{BuildCmd, FunctionArgs, LayoutArgs, ModelArgs};
use crate::publish::{self, OnLocked};
use crate::py::env as pyenv;
use crate::records::{BuildRecord, BuildRequest, ConversionSettings, Palettizer, GROUP_SIZE};

/// One build of `model` with `layout` into `out`. `lock`: what to do when
/// another run holds `out`'s lock (None: `out` is a fresh temporary folder of
/// this run, not locked).
pub(super) struct BuildJob<'a> {
    pub model: &'a ModelArgs,
    pub layout: &'a LayoutArgs,
    pub quantize: bool,
    pub kmeans_workers: usize,
    pub palettizer: Palettizer,
    pub lock: Option<OnLocked>,
}

impl BuildJob<'_> {
    pub(super) fn run(&self, out: &Path, verbose: bool) -> Result<BuildRecord> {
        require_utf8(out, "output")?;
        let dir = resolve_checkpoint(self.model, verbose)?;
        require_utf8(&dir, "checkpoint")?;
        let (cfg, plan) = plan_for(&dir, self.layout)?;
        let ckpt = Checkpoint::open(&dir, &cfg)?;
        if self.quantize {
            checkpoint::check_groupable(&ckpt, &cfg, GROUP_SIZE)?;
        }
        pyenv::activate(verbose)?;
        let settings = Settings {
            conversion: ConversionSettings::shipped(
                self.layout.ctx,
                self.quantize,
                self.palettizer,
                self.kmeans_workers,
            ),
            verbose,
            lock: self.lock,
        };
        let request = BuildRequest {
            mode: Some(self.layout.mode),
            split: self.layout.split.clone(),
            ctx: Some(self.layout.ctx as u64),
            verify_k: self.layout.functions.verify_k,
            prefill_len: self.layout.functions.prefill_len.clone(),
        };
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
        model: &args.model,
        layout: &args.layout,
        quantize: !args.no_quantize,
        kmeans_workers: args.kmeans_workers,
        palettizer: args.palettizer,
        lock: Some(publish::OnLocked::from_no_wait(args.no_wait)),
    }
    .run(output, verbose)?;
    eprintln!("{}", build::summary(&record, output));
    Ok(ExitStatus::Success)
}

/// `--check DIR`: the same build again into a temporary folder; exit 1 when
/// any package differs.
fn check(dir: &Path, args: &BuildCmd, verbose: bool) -> Result<ExitStatus> {
    let old = build::request_of(&dir.join("build.json"), &args.model.hf_dir)?;
    let model = ModelArgs { hf_dir: old.hf_dir };
    let layout = LayoutArgs {
        mode: old.request.mode.expect("checked by request_of"),
        split: old.request.split,
        ctx: old.ctx,
        functions: FunctionArgs {
            verify_k: old.request.verify_k,
            prefill_len: old.request.prefill_len,
        },
    };
    let tmp = std::env::temp_dir().join(format!("chunkforge-check-{}", std::process::id()));
    let result = BuildJob {
        model: &model,
        layout: &layout,
        quantize: old.quantize,
        kmeans_workers: args.kmeans_workers,
        palettizer: old.palettizer,
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
