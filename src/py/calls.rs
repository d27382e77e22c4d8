//! Typed calls into `chunkforge_py`: each request is a Rust type serialized
//! to JSON, each reply is read back into a Rust type (the Python side's
//! `contract.py` mirrors these).

use std::path::Path;

use anyhow::{anyhow, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::env::call_json;

/// `chunkforge_py.<module>.<func>(request)` (no argument when `request` is
/// `()`), its reply read as `T`.
pub fn call<R: Serialize, T: DeserializeOwned>(
    module: &str,
    func: &str,
    request: &R,
    verbose: bool,
) -> Result<T> {
    let reply = call_json(module, func, &serde_json::to_value(request)?, verbose)?;
    serde_json::from_value(reply).map_err(|e| anyhow!("bad reply from {module}.{func}: {e}"))
}

/// Versions of the Python-side tools, by package, `python` first.
pub fn versions(verbose: bool) -> Result<Map<String, Value>> {
    call("runtime", "versions", &(), verbose)
}

/// What coremltools can and cannot do on this platform.
#[derive(Debug, Deserialize)]
pub struct PlatformLimits {
    pub system: String,
    pub machine: String,
    pub can_predict: bool,
    pub can_compile_mlmodelc: bool,
    pub can_load_compute_plan: bool,
}

pub fn platform_limits(verbose: bool) -> Result<PlatformLimits> {
    call("runtime", "platform_limits", &(), verbose)
}

/// One input or output of a package's function.
#[derive(Debug, Serialize, Deserialize)]
pub struct Feature {
    pub name: String,
    pub shape: Vec<i64>,
    pub dtype: String,
}

/// One function of a package.
#[derive(Debug, Serialize, Deserialize)]
pub struct FunctionDescription {
    pub name: String,
    pub inputs: Vec<Feature>,
    pub outputs: Vec<Feature>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mil_ops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_ops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub int4_g32_linear_ops: Option<u64>,
}

/// One palettized weight.
#[derive(Debug, Serialize, Deserialize)]
pub struct Lut {
    pub name: String,
    pub weight_shape: Vec<i64>,
    pub lut_shape: Vec<i64>,
    pub indices_dtype: String,
}

/// One linear op and where its weight comes from.
#[derive(Debug, Serialize, Deserialize)]
pub struct LinearOp {
    pub op: String,
    pub weight: String,
    pub weight_op: String,
}

/// `inspect_pkg.describe`: a package as read from disk.
#[derive(Debug, Serialize, Deserialize)]
pub struct PackageDescription {
    pub path: String,
    pub specification_version: u64,
    pub model_type: String,
    pub default_function: Option<String>,
    pub inputs: Vec<Feature>,
    pub outputs: Vec<Feature>,
    pub functions: Vec<FunctionDescription>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opset: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mil_ops: Option<u64>,
    #[serde(default)]
    pub palettized: Vec<Lut>,
    #[serde(default)]
    pub linear: Vec<LinearOp>,
    #[serde(default)]
    pub layers: Vec<u64>,
}

#[derive(Serialize)]
struct PathArg<'a> {
    path: &'a str,
}

pub fn describe(package: &Path, verbose: bool) -> Result<PackageDescription> {
    let path = package.to_string_lossy();
    call("inspect_pkg", "describe", &PathArg { path: &path }, verbose)
}
