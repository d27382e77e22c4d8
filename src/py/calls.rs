//! Typed calls into `chunkforge_py`: each request is a Rust type serialized
//! to JSON, each reply is read back into a Rust type (the Python side's
//! `contract.py` mirrors these).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Result};
use indicatif::ProgressBar;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyTuple};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::env::render_error;
use super::error::PythonError;
use crate::checkpoint::Checkpoint;
use crate::plan::{ChunkPlan, Dims};
use crate::progress::BuildProgress;
use crate::records::{ChunkStats, ConversionSettings, PassStat, Seconds, Versions};

/// `chunkforge_py.<module>.<func>(request)` (no argument when `request` is
/// `()`), its reply read as `T`.
pub fn call<R: Serialize, T: DeserializeOwned>(
    module: &str,
    func: &str,
    request: &R,
    verbose: bool,
) -> Result<T> {
    let args = serde_json::to_value(request)?;
    let reply = Python::attach(|py| {
        let m = py.import(format!("chunkforge_py.{module}"))?;
        let result = if args.is_null() {
            m.call_method0(func)?
        } else {
            m.call_method1(func, (to_py(py, &args)?,))?
        };
        dumps(&result)
    })
    .map_err(|e| PythonError {
        message: render_error(e, verbose),
    })?;
    serde_json::from_str(&reply).map_err(|e| anyhow!("bad reply from {module}.{func}: {e}"))
}

/// Versions of the Python-side tools, by package, `python` first.
pub fn versions(verbose: bool) -> Result<Versions> {
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
    pub projection_ops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub int4_g32_projection_ops: Option<u64>,
}

/// One palettized weight.
#[derive(Debug, Serialize, Deserialize)]
pub struct Lut {
    pub name: String,
    pub weight_shape: Vec<i64>,
    pub lut_shape: Vec<i64>,
    pub indices_dtype: String,
}

/// One projection op (1x1 `conv`, or `linear` in older builds) and where its weight comes from.
#[derive(Debug, Serialize, Deserialize)]
pub struct ProjectionOp {
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
    pub projections: Vec<ProjectionOp>,
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

/// `mil_interp.exec_function`'s request: one function of a package on the
/// arrays of an .npz.
#[derive(Serialize)]
pub struct ExecRequest<'a> {
    pub package: &'a str,
    pub function: Option<&'a str>,
    pub inputs: &'a str,
    pub output: &'a str,
    pub fp16: bool,
}

/// A tensor `exec` read or wrote.
#[derive(Debug, Serialize, Deserialize)]
pub struct ExecTensor {
    pub name: String,
    pub shape: Vec<i64>,
    pub dtype: String,
}

/// `mil_interp.exec_function`'s reply.
#[derive(Debug, Serialize, Deserialize)]
pub struct ExecResult {
    pub package: String,
    pub function: String,
    pub fp16: bool,
    pub ops: u64,
    pub inputs: Vec<ExecTensor>,
    pub outputs: Vec<ExecTensor>,
    pub output: String,
    pub load_seconds: f64,
    pub run_seconds: f64,
}

pub fn exec_function(request: &ExecRequest, verbose: bool) -> Result<ExecResult> {
    call("mil_interp", "exec_function", request, verbose)
}

/// The checkpoint as Python opens it: the tensor-name prefix and each
/// (prefixed) tensor name's safetensors file.
#[derive(Serialize)]
pub struct CheckpointFiles {
    pub prefix: String,
    pub files: BTreeMap<String, String>,
}

impl CheckpointFiles {
    pub fn of(ckpt: &Checkpoint) -> Self {
        CheckpointFiles {
            prefix: ckpt.prefix.clone(),
            files: ckpt
                .files
                .iter()
                .map(|(k, v)| (k.clone(), v.to_string_lossy().into_owned()))
                .collect(),
        }
    }
}

/// One package to convert: its plan (every function), the model's dims, the
/// checkpoint, the settings, and where each function's package goes.
#[derive(Serialize)]
pub struct ChunkJob<'a> {
    pub dims: &'a Dims,
    pub chunk: &'a ChunkPlan,
    pub checkpoint: &'a CheckpointFiles,
    pub settings: &'a ConversionSettings,
    /// In the chunk's function order.
    pub paths: Vec<String>,
    /// Time (and probe) every coremltools graph pass.
    pub profile: bool,
}

/// One converted function: its counts and seconds per phase.
#[derive(Deserialize)]
pub struct ConvertedFunction {
    pub name: String,
    pub stats: ChunkStats,
    pub seconds: Seconds,
    pub passes: Option<BTreeMap<String, PassStat>>,
}

/// `convert.convert_chunk`'s reply.
#[derive(Deserialize)]
pub struct ConvertedChunk {
    pub functions: Vec<ConvertedFunction>,
}

/// The build's palettization cache, a `palettize.WeightCache`: made once per
/// build and handed to every conversion, dropped (with its LUTs) when the
/// build ends.
pub struct WeightCache(Py<PyAny>);

impl WeightCache {
    /// `uses`: conversions that hold each weight (an entry is dropped after its last).
    pub fn new(uses: usize) -> PyResult<Self> {
        Python::attach(|py| {
            let cache = py
                .import("chunkforge_py.palettize")?
                .getattr("WeightCache")?
                .call1((uses,))?;
            Ok(WeightCache(cache.unbind()))
        })
    }
}

/// A JSON-serializable value as a Python object.
fn to_py<'py, T: Serialize>(py: Python<'py>, v: &T) -> PyResult<Bound<'py, PyAny>> {
    let json = serde_json::to_string(v).map_err(|e| PyValueError::new_err(e.to_string()))?;
    py.import("json")?.call_method1("loads", (json,))
}

/// A Python object as JSON text.
fn dumps(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    obj.py()
        .import("json")?
        .call_method1("dumps", (obj,))?
        .extract()
}

/// A Python reply read as `T` (through JSON).
fn from_py<T: DeserializeOwned>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<T> {
    serde_json::from_str(&dumps(obj)?)
        .map_err(|e| PyValueError::new_err(format!("bad reply from {what}: {e}")))
}

/// A failed `convert_chunk`: the function it was converting (`chunk` or
/// `chunk/function`, None before the first phase) and Python's error.
pub struct ChunkError {
    pub function: Option<String>,
    pub error: PyErr,
}

/// Shows each phase of a conversion as it starts: `(function, phase)`.
pub type OnPhase = Arc<dyn Fn(&str, &str) + Send + Sync>;

/// `joint.convert_jobs(jobs, joint, threads, cache, progress)`: every job of
/// a task, converted together with `joint` (the jobs are of the same layers),
/// loading and tracing on `threads` torch threads; one `convert_chunk` reply
/// per job, as JSON.
pub fn convert_jobs_value(
    jobs: &[serde_json::Value],
    joint: bool,
    threads: usize,
    cache: &WeightCache,
    on_phase: OnPhase,
) -> Result<Vec<serde_json::Value>, ChunkError> {
    let reply = call_with_progress("joint", "convert_jobs", on_phase, |py, report| {
        (
            to_py(py, &jobs)?,
            joint,
            threads,
            cache.0.bind(py).clone(),
            report,
        )
            .into_pyobject(py)
    })?;
    serde_json::from_value(reply).map_err(|e| ChunkError {
        function: None,
        error: PyValueError::new_err(format!("bad reply from joint.convert_jobs: {e}")),
    })
}

/// `chunkforge_py.{module}.{method}(*args)`, the last argument a
/// `progress(function, phase)` callback telling `on_phase` each phase as it
/// starts; the reply as JSON, or the error with the function it was in.
fn call_with_progress<F>(
    module: &str,
    method: &str,
    on_phase: OnPhase,
    args: F,
) -> Result<serde_json::Value, ChunkError>
where
    F: for<'py> FnOnce(Python<'py>, Bound<'py, PyCFunction>) -> PyResult<Bound<'py, PyTuple>>,
{
    let current: Arc<Mutex<Option<String>>> = Arc::default();
    let result = Python::attach(|py| {
        let slot = Arc::clone(&current);
        let report = PyCFunction::new_closure(
            py,
            Some(c"progress"),
            Some(c"Tells a build phase as it starts: progress(function, phase)."),
            move |args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>| -> PyResult<()> {
                let function: String = args.get_item(0)?.extract()?;
                let what: String = args.get_item(1)?.extract()?;
                on_phase(&function, &what);
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(function);
                Ok(())
            },
        )?;
        let reply = py
            .import(format!("chunkforge_py.{module}"))?
            .call_method1(method, args(py, report)?)?;
        from_py::<serde_json::Value>(&reply, &format!("{module}.{method}"))
    });
    let function = current.lock().unwrap_or_else(|e| e.into_inner()).take();
    result.map_err(|error| ChunkError { function, error })
}

/// A `convert_chunk` reply (one per job of `convert_jobs_value`) for `chunk` read back, checking that
/// every function was converted, in order.
pub fn converted_chunk(
    chunk: &ChunkPlan,
    reply: serde_json::Value,
) -> std::result::Result<ConvertedChunk, String> {
    let converted: ConvertedChunk = serde_json::from_value(reply)
        .map_err(|e| format!("bad reply from the conversion of {}: {e}", chunk.name))?;
    let sent: Vec<&str> = chunk.functions.iter().map(|f| f.name.as_str()).collect();
    let got: Vec<&str> = converted
        .functions
        .iter()
        .map(|f| f.name.as_str())
        .collect();
    if sent != got {
        return Err(format!(
            "the conversion of {} converted functions {got:?} of {sent:?}",
            chunk.name
        ));
    }
    Ok(converted)
}

/// Each phase shown as a spinner under `progress`, the last one cleared when
/// the returned guard is dropped.
pub fn phase_spinners(progress: &BuildProgress) -> (OnPhase, PhaseGuard) {
    let slot: Arc<Mutex<Option<ProgressBar>>> = Arc::default();
    let shown = progress.clone();
    let bars = Arc::clone(&slot);
    let on_phase: OnPhase = Arc::new(move |function: &str, what: &str| {
        let mut bar = bars.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(previous) = bar.take() {
            previous.finish_and_clear();
        }
        *bar = Some(shown.phase(format!("{function}: {what}")));
    });
    (on_phase, PhaseGuard(slot))
}

/// Clears the last phase spinner of `phase_spinners` when dropped.
pub struct PhaseGuard(Arc<Mutex<Option<ProgressBar>>>);

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        if let Some(last) = self.0.lock().unwrap_or_else(|e| e.into_inner()).take() {
            last.finish_and_clear();
        }
    }
}

/// `convert.combine`'s reply: the bundle's weight blob size.
#[derive(Serialize, Deserialize)]
pub struct Bundle {
    pub weight_bytes: u64,
}

/// `convert.combine(parts, targets)`: single-function packages bundled into
/// multifunction ones sharing one weight blob.
pub fn combine(parts: &[(String, String)], targets: &[(String, Vec<String>)]) -> PyResult<Bundle> {
    Python::attach(|py| {
        let reply = py
            .import("chunkforge_py.convert")?
            .call_method1("combine", (parts.to_vec(), targets.to_vec()))?;
        from_py(&reply, "convert.combine")
    })
}

/// One source of a composed package: a single-function four-chunk decode
/// package and its chunk plan (that one function).
#[derive(Serialize)]
pub struct ComposeSource<'a> {
    pub path: String,
    pub chunk: &'a ChunkPlan,
}

/// `compose.compose_job`'s job: the target chunk (one decode function) from
/// its sources, in layer order, written to `path`.
#[derive(Serialize)]
pub struct ComposeJob<'a> {
    pub target: &'a ChunkPlan,
    pub sources: Vec<ComposeSource<'a>>,
    pub path: String,
    /// The build's: deployment target and compute units of the package.
    pub settings: &'a ConversionSettings,
}

/// `compose.compose_job`'s reply.
#[derive(Deserialize)]
pub struct Composed {
    pub stats: ChunkStats,
    pub seconds: Seconds,
}

/// `compose.compose_job(job)` with `job` and the reply as JSON.
pub fn compose_value(job: &serde_json::Value) -> PyResult<serde_json::Value> {
    Python::attach(|py| {
        let reply = py
            .import("chunkforge_py.compose")?
            .call_method1("compose_job", (to_py(py, job)?,))?;
        from_py(&reply, "compose.compose_job")
    })
}
