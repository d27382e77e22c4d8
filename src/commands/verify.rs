//! `chunkforge verify`: a release folder's signature, files and manifest.

use anyhow::Result;

use super::{verdict, ExitStatus};
use crate::cli::VerifyCmd;
use crate::verify::{verify, VerifyArgs};

/// Exit 1 when verification finds problems, each printed naming its file.
pub fn run(args: VerifyCmd) -> Result<ExitStatus> {
    let a = VerifyArgs {
        release_dir: args.release_dir,
        public_key: args.public_key,
        archive: args.archive,
    };
    let r = verify(&a)?;
    if r.problems.is_empty() {
        let what = match &r.summary {
            Some(s) => format!(
                "release '{}' {} (layout {})",
                s.model_id, s.version, s.layout
            ),
            None => format!("model '{}'", r.model_name),
        };
        println!(
            "OK {}: {what}: signature valid, {} files match the signature{}{}",
            a.release_dir.display(),
            r.files,
            if r.has_manifest {
                ", manifest.json agrees"
            } else {
                " (no manifest.json: a model_signing directory, not a chunkforge release)"
            },
            if a.archive.is_some() {
                ", archive matches"
            } else {
                ""
            }
        );
        return Ok(ExitStatus::Success);
    }
    for p in &r.problems {
        eprintln!("FAIL {p}");
    }
    let n = r.problems.len();
    eprintln!(
        "error: {}: verification FAILED ({n} problem{})",
        a.release_dir.display(),
        if n == 1 { "" } else { "s" }
    );
    Ok(verdict(false))
}
