//! `chunkforge release`: build, the parity gate, then package and sign. A
//! failed parity stops it before anything is signed.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::package::{release_request, summary as package_summary, ParityAcceptance};
use super::{resolve_checkpoint, ExitStatus};
use crate::checkpoint::Checkpoint;
use crate::cli::ReleaseCmd;
use crate::config::TextConfig;
use crate::hashing;
use crate::package::{check_inputs, package, Compiled};
use crate::records::{BuildRecord, Verdict};
use crate::settings::{BuildCommand, BuildSettings, Env, ParityCommand, ParitySettings};

pub fn run(args: ReleaseCmd, verbose: bool) -> Result<ExitStatus> {
    let output = &args.release.output;
    let build_dir = args.build_dir.clone().unwrap_or_else(|| {
        let mut p = output.clone().into_os_string();
        p.push(".build");
        PathBuf::from(p)
    });
    let hf_dir = resolve_checkpoint(args.model.hf_dir.as_deref(), verbose)?;
    let settings = BuildSettings::resolve(BuildCommand::Release(&args, &hf_dir), &Env::process())?;
    // Every input the build does not decide (key, options, tokenizer, output
    // and zip paths) is checked before the build starts.
    let request = release_request(
        build_dir.clone(),
        args.release.clone(),
        Some(hf_dir.clone()),
        None,
        ParityAcceptance {
            failed: false,
            inconclusive: args.inconclusive.accept_inconclusive_parity,
        },
        Compiled::not(""),
    );
    let recorded_dir = std::path::absolute(&hf_dir)
        .with_context(|| format!("{}: cannot make the path absolute", hf_dir.display()))?;
    check_inputs(&request, settings.layout.ctx, &recorded_dir, &hf_dir)?;

    let record = if args.reuse_build && build_dir.join("build.json").is_file() {
        let record = reusable(&build_dir, &hf_dir, &settings)?;
        eprintln!(
            "release 1/3: reusing the build in {} (same checkpoint and settings; packages are checked against build.json when packaged)",
            build_dir.display()
        );
        record
    } else {
        eprintln!("release 1/3: build --mode all into {}", build_dir.display());
        let record = super::build::build(&settings, &build_dir, verbose)?;
        eprintln!("{}", super::build::summary(&record, &build_dir));
        record
    };

    eprintln!("release 2/3: parity gate");
    let gate = ParitySettings::resolve(ParityCommand::Release(&args, &build_dir), Some(&record))?;
    let report_path = gate
        .report
        .clone()
        .expect("the release gate writes a report");
    match super::parity::check(Some(&hf_dir), &gate, verbose)? {
        Verdict::Ok => {}
        Verdict::Inconclusive if gate.accept_inconclusive => eprintln!(
            "warning: parity INCONCLUSIVE; signing as asked (--accept-inconclusive-parity), recorded as inconclusive"
        ),
        Verdict::Inconclusive => {
            eprintln!(
                "error: parity INCONCLUSIVE (the checkpoint decides some checks: see its report); nothing was signed (report: {}, build kept in {}); \
                 --accept-inconclusive-parity signs it, recorded as inconclusive",
                report_path.display(),
                build_dir.display()
            );
            return Ok(ExitStatus::Inconclusive);
        }
        Verdict::Fail => {
            eprintln!(
                "error: parity failed; nothing was signed (report: {}, build kept in {})",
                report_path.display(),
                build_dir.display()
            );
            return Ok(ExitStatus::CheckFailed);
        }
    }

    let eval_report = if args.eval {
        eprintln!("release: eval of the build against its source (fp16 arithmetic)");
        let report = crate::eval::eval(&crate::eval::EvalOptions {
            target: &build_dir,
            text: None,
            hf_dir: Some(&hf_dir),
            max_tokens: None,
            fp16: true,
            verbose,
        })?;
        eprint!("{}", crate::eval::render(&report));
        let path = build_dir.join("eval.json");
        crate::staging::write_atomic(&path, &serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing the eval report {}", path.display()))?;
        if report.result.fp16_range.as_ref().is_some_and(|r| !r.ok) {
            eprintln!(
                "error: the fp16 range check failed; nothing was signed (report: {}, build kept in {})",
                path.display(),
                build_dir.display()
            );
            return Ok(ExitStatus::CheckFailed);
        }
        Some(path)
    } else {
        None
    };

    let compiled = Compiled::not(super::package::NOT_COMPILED);
    eprintln!("release 3/3: package and sign into {}", output.display());
    let mut request = release_request(
        build_dir,
        args.release,
        Some(hf_dir),
        Some(report_path),
        ParityAcceptance {
            failed: false,
            inconclusive: gate.accept_inconclusive,
        },
        compiled,
    );
    request.eval_report = eval_report;
    super::package::audit_older_build(&mut request, verbose)?;
    let r = package(&request)?;
    eprintln!("{}", package_summary(&r, &request));
    if args.compile {
        let writer = crate::compile::Writer::for_platform(false);
        let n = crate::compile::compile_release(&request.output, &request.key, writer, verbose)?;
        eprintln!(
            "compiled {n} packages to .mlmodelc in {} with {}, re-signed",
            request.output.display(),
            writer.name()
        );
    }
    Ok(ExitStatus::Success)
}

/// The build in `dir` if it is what this release would build (`settings`):
/// the same checkpoint config, settings and functions; otherwise an error
/// saying what differs.
fn reusable(dir: &Path, hf_dir: &Path, settings: &BuildSettings) -> Result<BuildRecord> {
    let build_json = dir.join("build.json");
    let old = crate::settings::recorded(&build_json, &Some(hf_dir.to_path_buf()))?;
    let record: BuildRecord = serde_json::from_slice(&std::fs::read(&build_json)?)
        .with_context(|| format!("{}: not a chunkforge build record", build_json.display()))?;
    let (layout, quantize) = (&settings.layout, settings.conversion.quantize);
    let mut differs = Vec::new();
    if old.layout.mode != layout.mode || old.layout.split.is_some() {
        differs.push(format!("mode {} (release builds all)", old.layout.mode));
    }
    if old.layout.ctx != layout.ctx {
        differs.push(format!("ctx {} (asked {})", old.layout.ctx, layout.ctx));
    }
    if old.functions() != settings.functions() {
        differs.push("verify/prefill functions".into());
    }
    if old.conversion.quantize != quantize {
        differs.push(format!(
            "quantize {} (asked {quantize})",
            old.conversion.quantize
        ));
    }
    // The conversion options release takes too (ConversionArgs): a build
    // made with others made other packages.
    let (was, asked) = (&old.conversion, &settings.conversion);
    let palettizer =
        |c: &crate::records::ConversionSettings| c.palettization.as_ref().map(|p| p.palettizer);
    if palettizer(was) != palettizer(asked) {
        differs.push(format!(
            "palettizer {} (asked {})",
            palettizer(was).map_or("none".into(), |p| p.to_string()),
            palettizer(asked).map_or("none".into(), |p| p.to_string())
        ));
    }
    if was.pass_pipeline != asked.pass_pipeline {
        differs.push(format!(
            "pass pipeline {} (asked {})",
            was.pass_pipeline, asked.pass_pipeline
        ));
    }
    if was.compose != asked.compose {
        differs.push(format!(
            "{} (asked {})",
            if was.compose {
                "composed"
            } else {
                "--no-compose"
            },
            if asked.compose {
                "composed"
            } else {
                "--no-compose"
            }
        ));
    }
    let sha = hashing::sha256_file(&hf_dir.join("config.json"))?;
    if sha != record.checkpoint.config_sha256 {
        differs.push(format!(
            "checkpoint ({} has another config.json)",
            hf_dir.display()
        ));
    } else {
        // The parity report names the weights it ran on, and `package`
        // refuses one that are not the build's: say so before parity runs.
        let ckpt = Checkpoint::open(hf_dir, &TextConfig::load(hf_dir)?)?;
        let weights = hashing::weights_digest(&ckpt)?;
        match &record.checkpoint.weights {
            Some(w) if *w == weights => {}
            Some(_) => differs.push(format!(
                "checkpoint weights ({} holds other weights with the same config.json)",
                hf_dir.display()
            )),
            None => differs.push(
                "checkpoint weights (this build.json, from an older chunkforge, does not record them)"
                    .into(),
            ),
        }
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
