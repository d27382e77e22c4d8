//! The seam: every entry point of `chunkforge_py` that Rust calls is declared
//! once here (`entry_points!`), with the Rust types of its request and reply.
//! A request is serialized to JSON and handed over as plain Python values;
//! a reply is read back into its Rust type. `contract.py` mirrors these types
//! as TypedDicts; python/tests/test_seam.py imports every declared entry point
//! and holds contract.py to the types' JSON schemas (`python/tests/seam.json`,
//! kept current by this module's tests), so a renamed function or field fails
//! a test instead of a run.

use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Result};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyTuple};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::contract::*;
use super::error::{render_error, PythonError};
use crate::progress::OnPhase;
use crate::records::{ParityReport, Versions};

/// How an entry point takes its request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    /// No argument (the request is `()`).
    Nothing,
    /// One positional argument: the request as a dict.
    Dict,
    /// The request's fields as keyword arguments.
    Keywords,
}

/// One Python entry point: `chunkforge_py.<MODULE>.<FUNCTION>(request)`,
/// answering a `Reply`. Declared with [`entry_points!`] only.
pub trait EntryPoint {
    const MODULE: &'static str;
    const FUNCTION: &'static str;
    const PASS: Pass;
    /// Python objects the caller adds as keyword arguments besides the
    /// request (the build's palettization cache, a progress callback).
    const OBJECTS: &'static [&'static str];
    type Request<'a>: Serialize + JsonSchema;
    type Reply: DeserializeOwned + JsonSchema;
}

/// Declares each entry point: `Name = "module"."function"(Pass Request) -> Reply;`,
/// optionally `, with [objects]` (keyword arguments that are Python objects).
macro_rules! entry_points {
    ($($(#[doc = $doc:literal])* $name:ident = $module:literal . $function:literal
        ($pass:ident $req:ty) -> $rep:ty $(, with [$($object:literal),*])?;)+) => {
        $(
            $(#[doc = $doc])*
            pub struct $name;

            impl EntryPoint for $name {
                const MODULE: &'static str = $module;
                const FUNCTION: &'static str = $function;
                const PASS: Pass = Pass::$pass;
                const OBJECTS: &'static [&'static str] = &[$($($object),*)?];
                type Request<'a> = $req;
                type Reply = $rep;
            }
        )+

        /// Every declared entry point, with its request's and reply's JSON schemas.
        pub fn declared() -> Vec<Declared> {
            vec![$(Declared::of::<$name>()),+]
        }
    };
}

entry_points! {
    /// Quiets coremltools and torch unless `verbose` (`env::activate`).
    Configure = "runtime"."configure"(Keywords ConfigureArgs) -> ();
    /// Versions of the Python-side tools, by package, `python` first, then
    /// those of the packages asked for.
    VersionsOf = "runtime"."versions"(Keywords VersionsArgs) -> Versions;
    /// What coremltools can and cannot do on this platform.
    Platform = "runtime"."platform_limits"(Nothing ()) -> PlatformLimits;
    /// A package as read from disk (`chunkforge inspect`).
    Describe = "mil.inspect"."describe"(Dict PathArg<'a>) -> PackageDescription;
    /// One function of a package on the arrays of an .npz (`chunkforge exec`).
    ExecFunction = "mil.interp"."exec_function"(Dict ExecRequest<'a>) -> ExecResult;
    /// A random-weight checkpoint (`chunkforge fixture`).
    WriteFixture = "fixture"."write_fixture_json"(Dict FixtureRequest<'a>)
        -> FixtureInfo;
    /// The tensors of a published-size checkpoint (`fixture --full-size`).
    FullSizeLayoutOf = "fixture"."full_size_layout_json"(Dict FullSizeRequest<'a>)
        -> FullSizeLayout;
    /// The static ANE audit of packages (and the compute plan on macOS).
    Audit = "mil.audit"."audit"(Dict AuditArgs<'a>) -> AuditReport;
    /// The op types per layer kind of packages (`audit --print-op-types`).
    OpTypes = "mil.audit"."op_types"(Dict AuditArgs<'a>) -> super::contract::OpTypes;
    /// The INT4 kernel against coremltools (`bench palettize`).
    BenchPalettize = "convert.bench_palettize"."run"(Dict BenchArgs)
        -> BenchReport;
    /// One package compiled to the `.mlmodelc` files the app requests
    /// (`chunkforge compile`: chunkforge's writer anywhere, Core ML's on macOS).
    CompilePackage = "convert.compiled"."compile_package"(Dict CompileRequest<'a>)
        -> CompileReply;
    /// Text from a release folder alone (`chunkforge run`).
    Emulate = "emulate.release"."run"(Dict RunRequest<'a>) -> RunResult,
        with ["progress"];
    /// Each layout's programs against transformers over a text (`chunkforge eval`).
    Evaluate = "quality.text"."evaluate"(Dict crate::py::contract::EvalRequest<'a>)
        -> crate::quality::EvalResult, with ["progress"];
    /// transformers' greedy tokens and margins (`run --against-source`).
    SourceGreedyOf = "quality.gate"."source_greedy"(Dict crate::py::contract::SourceGreedyRequest<'a>)
        -> crate::py::contract::SourceGreedy;
    /// The parity checks (`chunkforge parity`).
    Parity = "parity.run"."run"(Dict ParityRequest<'a>) -> ParityReport,
        with ["progress"];
    /// The build's palettization cache (`WeightCache::new`).
    NewWeightCache = "convert.palettize"."WeightCache"(Keywords WeightCacheArgs) -> PyObjectReply;
    /// A task's conversions, together with `joint` (`convert_jobs`).
    ConvertJobs = "convert.joint"."convert_jobs"(Keywords ConvertJobsArgs<'a>) -> Vec<ConvertedChunk>,
        with ["cache", "progress"];
    /// Single-function packages bundled into multifunction ones (`combine`).
    Combine = "convert.chunks"."combine"(Keywords BundleArgs<'a>) -> Bundle;
    /// A decode package composed from four-chunk programs (`compose`).
    Compose = "convert.compose"."compose_job"(Dict ComposeJob) -> Composed;
}

/// One declared entry point as the seam test reads it (`python/tests/seam.json`).
#[derive(Serialize, JsonSchema)]
pub struct Declared {
    pub module: &'static str,
    pub function: &'static str,
    pub pass: Pass,
    pub objects: &'static [&'static str],
    /// What Rust sends (serialized).
    pub request: schemars::Schema,
    /// What Rust accepts back (deserialized).
    pub reply: schemars::Schema,
}

impl Declared {
    fn of<E: EntryPoint>() -> Declared {
        use schemars::generate::SchemaSettings;
        // The shapes only: doc comments are not the contract.
        let settings = |s: SchemaSettings| s.with_transform(WithoutDocs);
        Declared {
            module: E::MODULE,
            function: E::FUNCTION,
            pass: E::PASS,
            objects: E::OBJECTS,
            request: settings(SchemaSettings::draft2020_12().for_serialize())
                .into_generator()
                .into_root_schema_for::<E::Request<'static>>(),
            reply: settings(SchemaSettings::draft2020_12().for_deserialize())
                .into_generator()
                .into_root_schema_for::<E::Reply>(),
        }
    }
}

/// Drops every schema's `title` and `description`.
#[derive(Clone)]
struct WithoutDocs;

impl schemars::transform::Transform for WithoutDocs {
    fn transform(&mut self, schema: &mut schemars::Schema) {
        if let Some(object) = schema.as_object_mut() {
            object.remove("title");
            object.remove("description");
        }
        schemars::transform::transform_subschemas(self, schema);
    }
}

/// `E(request)` in the embedded interpreter, its reply read as `E::Reply`.
pub fn call<E: EntryPoint>(request: &E::Request<'_>, verbose: bool) -> Result<E::Reply> {
    let reply = Python::attach(|py| {
        let result = invoke::<E>(py, request, &[])?;
        dumps(&result)
    })
    .map_err(|e| PythonError {
        message: render_error(e, verbose),
    })?;
    serde_json::from_str(&reply).map_err(|e| bad_reply::<E>(&reply, &e))
}

/// `E(request)` with a `progress(what)` callback (its one object) telling
/// `on_phase` each phase of the call as it starts: `parity`, `run`.
pub fn with_progress<E: EntryPoint>(
    request: &E::Request<'_>,
    verbose: bool,
    on_phase: impl Fn(&str) + Send + Sync + 'static,
) -> Result<E::Reply> {
    debug_assert_eq!(E::OBJECTS, ["progress"]);
    let reply = Python::attach(|py| {
        let report = PyCFunction::new_closure(
            py,
            Some(c"progress"),
            Some(c"Tells a phase as it starts: progress(what)."),
            move |args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>| -> PyResult<()> {
                let what: String = args.get_item(0)?.extract()?;
                on_phase(&what);
                Ok(())
            },
        )?;
        let result = invoke::<E>(py, request, &[report.into_any()])?;
        dumps(&result)
    })
    .map_err(|e| PythonError {
        message: render_error(e, verbose),
    })?;
    serde_json::from_str(&reply).map_err(|e| bad_reply::<E>(&reply, &e))
}

/// A reply that is not `E::Reply`. Python writes a NaN or an infinity as
/// the bare word `NaN` or `Infinity`, which is not JSON: that is said by
/// name, with the field it stands in, since it means the computation
/// overflowed on its inputs (a weight, a config value).
fn bad_reply<E: EntryPoint>(reply: &str, e: &serde_json::Error) -> anyhow::Error {
    let at = (e.line() == 1)
        .then(|| e.column().saturating_sub(1))
        .and_then(|c| reply.get(c..));
    let word = ["NaN", "Infinity", "-Infinity"]
        .into_iter()
        .find(|w| at.is_some_and(|rest| rest.starts_with(w)));
    match word {
        Some(w) => {
            let before = &reply[..reply.len() - at.map_or(0, str::len)];
            let field = before
                .rfind("\":")
                .and_then(|end| {
                    before[..end]
                        .rfind('"')
                        .map(|start| &before[start + 1..end])
                })
                .unwrap_or("?");
            anyhow!(
                "{}.{} computed {w} for `{field}`: a weight or config value made the computation overflow (rerun with --verbose for the Python side)",
                E::MODULE,
                E::FUNCTION
            )
        }
        None => anyhow!("bad reply from {}.{}: {e}", E::MODULE, E::FUNCTION),
    }
}

/// `E(request)` with `objects` (its `OBJECTS`, in order) as keyword
/// arguments besides; the result as a Python object.
fn invoke<'py, E: EntryPoint>(
    py: Python<'py>,
    request: &E::Request<'_>,
    objects: &[Bound<'py, PyAny>],
) -> PyResult<Bound<'py, PyAny>> {
    let f = py
        .import(format!("chunkforge_py.{}", E::MODULE))?
        .getattr(E::FUNCTION)?;
    match E::PASS {
        Pass::Nothing => f.call0(),
        Pass::Dict if objects.is_empty() => f.call1((to_py(py, request)?,)),
        Pass::Dict => {
            let kwargs = PyDict::new(py);
            for (name, object) in E::OBJECTS.iter().zip(objects) {
                kwargs.set_item(name, object)?;
            }
            f.call((to_py(py, request)?,), Some(&kwargs))
        }
        Pass::Keywords => {
            let kwargs = to_py(py, request)?.cast_into::<PyDict>()?;
            for (name, object) in E::OBJECTS.iter().zip(objects) {
                kwargs.set_item(name, object)?;
            }
            f.call((), Some(&kwargs))
        }
    }
}

/// One package compiled to the `.mlmodelc` files the app requests.
pub fn compile_package(request: &CompileRequest, verbose: bool) -> Result<CompileReply> {
    call::<CompilePackage>(request, verbose)
}

pub fn platform_limits(verbose: bool) -> Result<PlatformLimits> {
    call::<Platform>(&(), verbose)
}

pub fn describe(
    package: &std::path::Path,
    weights: Option<&std::path::Path>,
    verbose: bool,
) -> Result<PackageDescription> {
    let path = package.to_string_lossy();
    let weights = weights.map(|w| w.to_string_lossy());
    call::<Describe>(
        &PathArg {
            path: &path,
            weights: weights.as_deref(),
        },
        verbose,
    )
}

pub fn exec_function(request: &ExecRequest, verbose: bool) -> Result<ExecResult> {
    call::<ExecFunction>(request, verbose)
}

/// The build's palettization cache, a `palettize.WeightCache`: made once per
/// build and handed to every conversion, dropped (with its LUTs) when the
/// build ends.
pub struct WeightCache(Py<PyAny>);

impl WeightCache {
    /// `uses`: conversions that hold each weight (an entry is dropped after its last).
    pub fn new(uses: usize) -> PyResult<Self> {
        Python::attach(|py| {
            let cache = invoke::<NewWeightCache>(py, &WeightCacheArgs { uses }, &[])?;
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

/// `E(request)`'s reply read as `E::Reply` (through JSON).
fn reply_of<E: EntryPoint>(obj: &Bound<'_, PyAny>) -> PyResult<E::Reply> {
    serde_json::from_str(&dumps(obj)?).map_err(|e| {
        PyValueError::new_err(format!("bad reply from {}.{}: {e}", E::MODULE, E::FUNCTION))
    })
}

/// A failed `convert_chunk`: the function it was converting (`chunk` or
/// `chunk/function`, None before the first phase) and Python's error.
pub struct ChunkError {
    pub function: Option<String>,
    pub error: PyErr,
}

/// `joint.convert_jobs` with the build's `cache` and a `progress(function,
/// phase)` callback telling `on_phase` each phase as it starts; one
/// `convert_chunk` reply per job, or the error with the function it was in.
pub fn convert_jobs(
    args: &ConvertJobsArgs,
    cache: &WeightCache,
    on_phase: OnPhase,
) -> Result<Vec<ConvertedChunk>, ChunkError> {
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
        let objects = [cache.0.bind(py).clone(), report.into_any()];
        let reply = invoke::<ConvertJobs>(py, args, &objects)?;
        reply_of::<ConvertJobs>(&reply)
    });
    let function = current.lock().unwrap_or_else(|e| e.into_inner()).take();
    result.map_err(|error| ChunkError { function, error })
}

pub fn combine(args: &BundleArgs) -> PyResult<Bundle> {
    Python::attach(|py| reply_of::<Combine>(&invoke::<Combine>(py, args, &[])?))
}

pub fn compose(job: &ComposeJob) -> PyResult<Composed> {
    Python::attach(|py| reply_of::<Compose>(&invoke::<Compose>(py, job, &[])?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// python/tests/seam.json: every declared entry point with its
    /// request's and reply's schemas, as test_seam.py reads them.
    const SEAM_JSON: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/python/tests/seam.json");

    #[test]
    fn seam_json_is_current() {
        let mut text = serde_json::to_string_pretty(&declared()).unwrap();
        text.push('\n');
        if chunkforge_model::generated::bless() {
            std::fs::write(SEAM_JSON, &text).unwrap();
        }
        let on_disk = std::fs::read_to_string(SEAM_JSON).unwrap_or_default();
        assert!(
            on_disk == text,
            "{SEAM_JSON} is not what src/py/calls.rs declares: a request or reply type of an \
             entry point changed. {}, then make python/chunkforge_py/contract.py agree \
             (python/tests/test_seam.py says where it does not)",
            chunkforge_model::generated::REGENERATE
        );
    }

    #[test]
    fn every_entry_point_is_declared_once() {
        let all = declared();
        let mut names: Vec<(&str, &str)> = all.iter().map(|d| (d.module, d.function)).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }
}
