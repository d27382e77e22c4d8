//! chunkforge: Gemma 4 checkpoint → Core ML packages for the Apple Neural
//! Engine. Parses the command line and hands it to `commands`.

use std::process::ExitCode;

use clap::Parser;

use chunkforge::cli::Cli;
use chunkforge::commands::{self, ExitStatus};
use chunkforge::py::native::chunkforge_native;
use chunkforge::staging;

fn main() -> ExitCode {
    // Before any thread or the interpreter starts: whether freed memory
    // stays with the process (CHUNKFORGE_HEAP, heap.rs).
    chunkforge::heap::configure();
    // Fixed string hashing in the embedded interpreter (set before it starts):
    // set iteration order must not vary between runs of a reproducible build.
    std::env::set_var("PYTHONHASHSEED", "0");
    // The Rust kernels must be importable before the interpreter starts.
    pyo3::append_to_inittab!(chunkforge_native);
    let cli = Cli::parse();
    staging::install_interrupt_handler(ExitStatus::Interrupted.code().into());
    match commands::run(cli) {
        Ok(status) => status.into(),
        Err(e) => {
            // An error of a run being interrupted (a copy whose folder the
            // handler removed) is the handler's to report, with its status.
            staging::stop_if_interrupted();
            eprintln!("error: {}", render(&e));
            ExitStatus::Error.into()
        }
    }
}

/// The error and its causes, each said once. Several error types end their
/// own message with their source's (so a `verify` report line stands alone);
/// printing the whole chain after it would repeat the OS error.
fn render(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !out.contains(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
    }
    out
}
