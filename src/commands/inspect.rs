//! `chunkforge inspect`: describe a built .mlpackage without loading it.

use std::path::{Path, PathBuf};

use anyhow::Result;

use super::ExitStatus;
use crate::py::calls;
use crate::py::contract::PackageDescription;
use crate::py::env as pyenv;

pub fn run(package: &Path, json: bool, verbose: bool) -> Result<ExitStatus> {
    super::require_package(package, "inspect")?;
    let weights = shared_weights(package);
    pyenv::activate(verbose)?;
    let d = calls::describe(package, weights.as_deref(), verbose)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print_inspect(&d);
        if let Some(w) = &weights {
            println!(
                "  weights: {} (the package holds none; the app's download shares this blob in)",
                w.display()
            );
        }
    }
    Ok(ExitStatus::Success)
}

/// A release's package stored without its weight blob (the app's download
/// links or copies another package's into it, e.g. `prefill/chunk1`) reads
/// that package's blob, as `run` does: the release is the folder above it
/// (`swa/`, `prefill/` or the root) that holds `manifest.json`.
fn shared_weights(package: &Path) -> Option<PathBuf> {
    package.ancestors().skip(1).take(2).find_map(|dir| {
        if !dir.join(crate::manifest::MANIFEST_FILE).is_file() {
            return None;
        }
        crate::folder::ReleaseFolder::open(dir)
            .ok()?
            .shared_weights(package)
    })
}

fn print_inspect(d: &PackageDescription) {
    println!("{}", d.path);
    println!(
        "  {}, specification version {} (iOS18 = 9), opset {}",
        d.model_type,
        d.specification_version,
        d.opset.as_deref().unwrap_or("?")
    );
    for f in &d.functions {
        if d.functions.len() > 1 {
            let default = Some(&f.name) == d.default_function.as_ref();
            println!(
                "  function {}{}: {} MIL ops",
                f.name,
                if default { " (default)" } else { "" },
                f.mil_ops.unwrap_or(0)
            );
        }
        for (label, tensors) in [("in ", &f.inputs), ("out", &f.outputs)] {
            for t in tensors {
                println!(
                    "  {label} {:<24} {:<20} {}",
                    t.name,
                    serde_json::to_string(&t.shape).unwrap_or_default(),
                    t.dtype
                );
            }
        }
    }
    println!(
        "  {} MIL ops; {} palettized weights for {} projection ops",
        d.mil_ops.unwrap_or(0),
        d.palettized.len(),
        d.projections.len()
    );
    if let Some(l) = d.palettized.first() {
        println!(
            "  e.g. {} {} with LUT {}",
            l.name,
            serde_json::to_string(&l.weight_shape).unwrap_or_default(),
            serde_json::to_string(&l.lut_shape).unwrap_or_default()
        );
    }
    if let (Some(a), Some(b)) = (d.layers.first(), d.layers.last()) {
        println!("  decoder layers {a}-{b} ({} layers)", d.layers.len());
    }
}
