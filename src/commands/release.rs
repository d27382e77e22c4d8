//! `chunkforge release`: build, the parity gate, then package and sign. A
//! failed parity stops it before anything is signed.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::build::BuildJob;
use super::package::{release_request, summary as package_summary};
use super::parity::{defaults as parity_defaults, print_checks, print_verdict};
use super::{resolve_checkpoint, ExitStatus, Layout};
use crate::build;
use crate::checkpoint::Checkpoint;
use crate::cli::ReleaseCmd;
use crate::config::TextConfig;
use crate::hashing;
use crate::package::{package, Compiled};
use crate::parity::{self, ParityOptions};
use crate::plan::{Functions, Mode};
use crate::publish::OnLocked;
use crate::py::env as pyenv;
use crate::records::{BuildRecord, Palettizer, PassPipeline};

pub fn run(args: ReleaseCmd, verbose: bool) -> Result<ExitStatus> {
    let output = &args.release.output;
    let build_dir = args.build_dir.clone().unwrap_or_else(|| {
        let mut p = output.clone().into_os_string();
        p.push(".build");
        PathBuf::from(p)
    });
    let hf_dir = resolve_checkpoint(args.model.hf_dir.as_deref(), verbose)?;
    let layout = Layout {
        mode: Mode::All,
        split: None,
        ctx: args.ctx,
        verify_k: args.functions.verify_k,
        prefill_len: args.functions.prefill_len.clone(),
    };
    let quantize = !args.no_quantize;

    let record = if args.reuse_build && build_dir.join("build.json").is_file() {
        let record = reusable(&build_dir, &hf_dir, &layout, quantize)?;
        eprintln!(
            "release 1/3: reusing the build in {} (same checkpoint and settings; packages are checked against build.json when packaged)",
            build_dir.display()
        );
        record
    } else {
        eprintln!("release 1/3: build --mode all into {}", build_dir.display());
        let record = BuildJob {
            hf_dir: Some(&hf_dir),
            layout: layout.clone(),
            quantize,
            kmeans_workers: 1,
            palettizer: Palettizer::Chunkforge,
            pass_pipeline: PassPipeline::Chunkforge,
            compose: true,
            joint: None,
            profile: false,
            jobs: crate::build::Jobs::Auto,
            lock: Some(OnLocked::from_no_wait(args.release.no_wait)),
        }
        .run(&build_dir, verbose)?;
        eprintln!("{}", super::build::summary(&record, &build_dir));
        record
    };

    eprintln!("release 2/3: parity gate");
    let cfg = TextConfig::load(&hf_dir)?;
    let ckpt = Checkpoint::open(&hf_dir, &cfg)?;
    pyenv::activate(verbose)?;
    let report_path = build_dir.join("parity.json");
    let defaults = parity_defaults()?;
    let opts = ParityOptions {
        mode: Mode::All,
        functions: Functions::resolve(Mode::All, layout.verify_k, layout.prefill_len.as_deref()),
        split: None,
        steps: args.steps,
        tol_cos: defaults.tol_cos,
        ctx: args.ctx,
        prompt_ids: None,
        // The prefill hand-off, and the prefill programs through the interpreter.
        prefill: if args.steps > RELEASE_PREFILL {
            RELEASE_PREFILL
        } else {
            0
        },
        skip_prefill_copy: false,
        // The packages' weights read back (INT4, or FP16 with --no-quantize)
        // and their own programs run by the MIL interpreter.
        artifacts: Some(build_dir.clone()),
        tol_cos_int4: defaults.tol_cos_int4,
        min_top1_int4: defaults.min_top1_int4,
        max_weight_rel_mse: defaults.max_weight_rel_mse,
        report: Some(report_path.clone()),
        oracle: true,
        corrupt_layer: args.corrupt_layer,
        corrupt_function: None,
        verbose,
    };
    let report = parity::run(&hf_dir, &cfg, &ckpt, &opts)?;
    print_checks(&report);
    print_verdict(&report.summary, &opts);
    if !report.summary.ok {
        eprintln!(
            "error: parity failed; nothing was signed (report: {}, build kept in {})",
            report_path.display(),
            build_dir.display()
        );
        return Ok(ExitStatus::CheckFailed);
    }

    let compiled = if args.compile {
        compile(&build_dir, &record)?
    } else {
        Compiled::not("not compiled (`release --compile` on macOS writes .mlmodelc)")
    };
    eprintln!("release 3/3: package and sign into {}", output.display());
    let mut request = release_request(
        build_dir,
        args.release,
        Some(hf_dir),
        Some(report_path),
        false,
        compiled,
    );
    super::package::audit_older_build(&mut request, verbose)?;
    let r = package(&request)?;
    eprintln!("{}", package_summary(&r, &request));
    Ok(ExitStatus::Success)
}

/// The build in `dir` if it is what this release would build: the same
/// checkpoint config, settings and functions; otherwise an error saying what differs.
/// Prompt tokens the release gate prefills before decoding the rest.
const RELEASE_PREFILL: usize = 8;

fn reusable(dir: &Path, hf_dir: &Path, layout: &Layout, quantize: bool) -> Result<BuildRecord> {
    let build_json = dir.join("build.json");
    let old = build::request_of(&build_json, &Some(hf_dir.to_path_buf()))?;
    let record: BuildRecord = serde_json::from_slice(&std::fs::read(&build_json)?)
        .with_context(|| format!("{}: not a chunkforge build record", build_json.display()))?;
    let functions = |l: &Layout| Functions::resolve(l.mode, l.verify_k, l.prefill_len.as_deref());
    let mut differs = Vec::new();
    if old.layout.mode != layout.mode || old.layout.split.is_some() {
        differs.push(format!("mode {} (release builds all)", old.layout.mode));
    }
    if old.layout.ctx != layout.ctx {
        differs.push(format!("ctx {} (asked {})", old.layout.ctx, layout.ctx));
    }
    if functions(&old.layout) != functions(layout) {
        differs.push("verify/prefill functions".into());
    }
    if old.quantize != quantize {
        differs.push(format!("quantize {} (asked {quantize})", old.quantize));
    }
    let sha = hashing::sha256_file(&hf_dir.join("config.json"))?;
    if sha != record.checkpoint.config_sha256 {
        differs.push(format!(
            "checkpoint ({} has another config.json)",
            hf_dir.display()
        ));
    }
    if !differs.is_empty() {
        bail!(
            "{}: --reuse-build: this build differs from the release's: {}; remove the folder or drop --reuse-build",
            build_json.display(),
            differs.join(", ")
        );
    }
    Ok(record)
}

/// `xcrun coremlcompiler compile` of every package of the build into
/// `<name>.mlmodelc` beside it, on macOS; elsewhere says it was skipped.
fn compile(build_dir: &Path, record: &BuildRecord) -> Result<Compiled> {
    if !cfg!(target_os = "macos") {
        let why = format!(
            "skipped: compiling .mlmodelc needs macOS (xcrun coremlcompiler); this is {}",
            std::env::consts::OS
        );
        eprintln!("--compile {why}");
        return Ok(Compiled::not(&why));
    }
    for c in &record.chunks {
        let pkg = build_dir.join(&c.package);
        let status = Command::new("xcrun")
            .args(["coremlcompiler", "compile"])
            .arg(&pkg)
            .arg(build_dir)
            .status()
            .with_context(|| format!("{}: running xcrun coremlcompiler", pkg.display()))?;
        if !status.success() {
            bail!(
                "{}: xcrun coremlcompiler compile failed ({status})",
                pkg.display()
            );
        }
    }
    Ok(Compiled {
        mlmodelc: true,
        note: "compiled with xcrun coremlcompiler".into(),
    })
}
