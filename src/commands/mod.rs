//! One module per command: each turns its options into a request, does the
//! work through the library, renders its own output and says how it ended.

mod audit;
pub(crate) mod bench;
mod build;
mod client_check;
pub(crate) mod device_report;
mod doctor;
mod eval;
mod exec;
mod fixture;
mod inspect;
mod keygen;
mod package;
mod parity;
mod plan;
mod release;
mod run;
mod selftest;
mod setup;
mod side_files;
mod verify;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;

use crate::cli::{Cli, Cmd};
use crate::config::TextConfig;
use crate::plan as planner;
pub(crate) use crate::settings::Layout;

/// How a command ended; the process exit code (README: Exit codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitStatus {
    /// Did what was asked; every check held.
    Success,
    /// Ran to the end, and a check it exists for failed: parity below the
    /// tolerances, a release that does not verify, a rebuild that differs.
    CheckFailed,
    /// Could not do what was asked: bad input or options, a failed build,
    /// an I/O error. Nothing was published.
    Error,
    /// Ran to the end and parity could not decide: the reference disagrees
    /// with transformers only at steps where transformers disagrees with
    /// itself (an ill-conditioned checkpoint); every other check held.
    Inconclusive,
    /// Ctrl-C or SIGTERM: unfinished work removed (the interrupt handler
    /// exits with it, from whatever the command was doing).
    Interrupted,
}

impl ExitStatus {
    pub fn code(self) -> u8 {
        match self {
            ExitStatus::Success => 0,
            ExitStatus::CheckFailed => 1,
            ExitStatus::Error => 2,
            ExitStatus::Inconclusive => 3,
            ExitStatus::Interrupted => 130,
        }
    }
}

impl From<ExitStatus> for ExitCode {
    fn from(s: ExitStatus) -> ExitCode {
        ExitCode::from(s.code())
    }
}

/// What a check command found, as an exit status.
fn verdict(ok: bool) -> ExitStatus {
    if ok {
        ExitStatus::Success
    } else {
        ExitStatus::CheckFailed
    }
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> Result<ExitStatus> {
    let verbose = cli.verbose;
    match cli.command {
        Cmd::Doctor { venv_python } => doctor::run(venv_python, verbose),
        Cmd::Setup => setup::run(verbose),
        Cmd::Plan {
            model,
            layout,
            json,
        } => plan::run(&model, &layout, json, verbose),
        Cmd::Build(args) => build::run(args, verbose),
        Cmd::Parity(args) => parity::run(args, verbose),
        Cmd::Exec(args) => exec::run(args, verbose),
        Cmd::Inspect { package, json } => inspect::run(&package, json, verbose),
        Cmd::Audit {
            path,
            json,
            print_op_types,
        } => audit::run(&path, json, print_op_types, verbose),
        Cmd::Fixture(args) => fixture::run(args, verbose),
        Cmd::Keygen { out } => keygen::run(&out),
        Cmd::SideFiles(args) => side_files::run(args, verbose),
        Cmd::Package(args) => package::run(args, verbose),
        Cmd::Release(args) => release::run(args, verbose),
        Cmd::Run(args) => run::run(args, verbose),
        Cmd::Eval(args) => eval::run(args, verbose),
        Cmd::Verify(args) => verify::run(args),
        Cmd::ClientCheck(args) => client_check::run(args),
        Cmd::Compile(args) => {
            // --check (both compilers) needs macOS: said before anything is read or written.
            if let Some(why) = crate::compile::check_unsupported().filter(|_| args.check) {
                anyhow::bail!("{}: {why}", args.release_dir.display());
            }
            let writer = crate::compile::Writer::for_platform(args.check);
            let n = crate::compile::compile_release(&args.release_dir, &args.key, writer, verbose)?;
            println!(
                "compiled {n} packages in {} with {}, re-signed{}",
                args.release_dir.display(),
                writer.name(),
                if writer == crate::compile::Writer::Chunkforge {
                    " (no device has loaded them yet: DEVICE_RUNBOOK.md's first step)"
                } else {
                    ""
                }
            );
            Ok(ExitStatus::Success)
        }
        Cmd::DeviceReport(args) => device_report::run(args),
        Cmd::SelftestPython { args } => selftest::run(&args, verbose),
        Cmd::ConvertWorker => {
            crate::py::worker::serve(verbose)?;
            Ok(ExitStatus::Success)
        }
        Cmd::Bench { what } => bench::run(what, verbose),
    }
}

/// The checkpoint folder: `--hf-dir` / GEMMA4_HF_DIR, else the built-in
/// trained checkpoint (checked against its manifest, [`crate::builtin`]).
fn resolve_checkpoint(hf_dir: Option<&Path>, _verbose: bool) -> Result<PathBuf> {
    match hf_dir {
        Some(d) => {
            crate::checkpoint::check_folder(d)?;
            Ok(d.to_path_buf())
        }
        None => crate::builtin::checkpoint(),
    }
}

/// Refuses, before Python starts, a path given to `command` (`inspect`,
/// `exec`) that is not one `.mlpackage` folder; a build or release folder is
/// answered with the packages inside it.
fn require_package(path: &Path, command: &str) -> Result<()> {
    // An .mlpackage, or a compiled model with text MIL (read back as the same program).
    if path.join("Manifest.json").is_file()
        || (path.join("model.mil").is_file() && path.join("coremldata.bin").is_file())
    {
        return plain_folder(path);
    }
    if !path.exists() {
        anyhow::bail!(
            "{}: not an .mlpackage folder: it does not exist",
            path.display()
        );
    }
    if !path.is_dir() {
        anyhow::bail!(
            "{}: a file, not an .mlpackage folder (`chunkforge {command}` takes one package folder)",
            path.display()
        );
    }
    let packages = crate::folder::packages_in(path);
    let Some(first) = packages.first() else {
        anyhow::bail!(
            "{}: not an .mlpackage folder (no Manifest.json), and no .mlpackage folders inside",
            path.display()
        );
    };
    let what = if path.join("build.json").is_file() {
        "a build folder"
    } else if path.join(crate::manifest::MANIFEST_FILE).is_file() {
        "a release folder"
    } else {
        "a folder of packages"
    };
    anyhow::bail!(
        "{}: {what}, not a package: `chunkforge {command}` takes one .mlpackage folder, e.g. `chunkforge {command} {}`; the packages here: {}",
        path.display(),
        path.join(first).display(),
        packages.join(", ")
    )
}

/// Refuses an input folder (a package, a build) holding a symlink, a FIFO,
/// socket or device, or a name that is not one plain path component,
/// naming it: nothing is read through them (`hashing::Tree::refuse_odd`).
fn plain_folder(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        crate::hashing::walk(dir, &|_| false)?.refuse_odd(dir)?;
    }
    Ok(())
}

/// coremltools and safetensors take paths as Python strings: refuse a path that
/// is not valid UTF-8 instead of silently writing somewhere else.
fn require_utf8(path: &Path, what: &str) -> Result<()> {
    if path.to_str().is_none() {
        anyhow::bail!(
            "{}: the {what} path is not valid UTF-8; coremltools needs UTF-8 paths, choose another folder name",
            path.display()
        );
    }
    Ok(())
}

/// The config of the checkpoint in `dir` and its plan for `request`.
fn plan_for(dir: &Path, request: &Layout) -> Result<(TextConfig, planner::Plan)> {
    let cfg = TextConfig::load(dir)?;
    let functions = planner::Functions::resolve(
        request.mode,
        request.verify_k,
        request.prefill_len.as_deref(),
    );
    let plan = planner::plan(
        &cfg,
        request.ctx,
        request.mode,
        request.split.as_deref(),
        &functions,
    )?;
    Ok((cfg, plan))
}
