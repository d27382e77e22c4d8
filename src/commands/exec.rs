//! `chunkforge exec`: one function of a package run by the MIL interpreter.

use anyhow::Result;

use super::{require_utf8, ExitStatus};
use crate::cli::ExecCmd;
use crate::py::calls;
use crate::py::contract::{ExecRequest, ExecResult};
use crate::py::env as pyenv;

pub fn run(args: ExecCmd, verbose: bool) -> Result<ExitStatus> {
    for (path, what) in [
        (&args.package, "package"),
        (&args.inputs, "--inputs"),
        (&args.output, "--output"),
    ] {
        require_utf8(path, what)?;
    }
    super::require_package(&args.package, "exec")?;
    if !args.inputs.is_file() {
        anyhow::bail!("{}: --inputs file does not exist", args.inputs.display());
    }
    pyenv::activate(verbose)?;
    let path = |p: &std::path::Path| p.to_str().expect("checked above").to_string();
    let (package, inputs, output) = (path(&args.package), path(&args.inputs), path(&args.output));
    let result = calls::exec_function(
        &ExecRequest {
            package: &package,
            function: args.function.as_deref(),
            inputs: &inputs,
            output: &output,
            fp16: args.fp16,
        },
        verbose,
    )?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        render(&result);
    }
    Ok(ExitStatus::Success)
}

fn render(r: &ExecResult) {
    let shape = |s: &[i64]| serde_json::to_string(s).unwrap_or_default();
    eprintln!(
        "{} function {}: {} ops, {} arithmetic, prepared in {:.2}s, ran in {:.3}s",
        r.package,
        r.function,
        r.ops,
        if r.fp16 { "fp16" } else { "fp32" },
        r.load_seconds,
        r.run_seconds
    );
    for t in &r.outputs {
        eprintln!("  out {:<24} {:<20} {}", t.name, shape(&t.shape), t.dtype);
    }
    println!("{}", r.output);
}
