//! `chunkforge inspect`: describe a built .mlpackage without loading it.

use std::path::Path;

use anyhow::Result;

use super::ExitStatus;
use crate::py::calls;
use crate::py::contract::PackageDescription;
use crate::py::env as pyenv;

pub fn run(package: &Path, json: bool, verbose: bool) -> Result<ExitStatus> {
    super::require_package(package, "inspect")?;
    pyenv::activate(verbose)?;
    let d = calls::describe(package, verbose)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print_inspect(&d);
    }
    Ok(ExitStatus::Success)
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
