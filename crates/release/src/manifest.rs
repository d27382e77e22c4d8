//! `manifest.json`, the release's table of contents for the app's downloader:
//! what model and release this is, which packages it holds with their layer
//! ranges and I/O contracts, how prefill KV maps into each decode layout, the
//! conversion settings and tool versions, the parity summary, and every file
//! with its size and SHA-256. [`Manifest`] is its type: `package` writes it,
//! `run` and the run book read it, and `manifests/manifest.schema.json` is
//! generated from it (`crate::schemas`).
//!
//! Everything here is read out of `build.json` (the plan computed at build
//! time); nothing is re-derived.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use chunkforge_model::layouts::{spec, Purpose, ReleaseLayout, REFERENCE};
use chunkforge_model::plan::{
    AliasUse, ChunkPlan, Dims, Dtype, FunctionKind, FunctionPlan, Layout, LayoutKind, SlotCopy,
    TensorSpec, ANE_LAYER_CEILING,
};
use chunkforge_model::quality::{EmbeddedEval, EvalReport, EVAL_FORMAT};
use chunkforge_model::records::{
    BuildRecord, ChunkRecord, ConversionSettings, ParityCheckpoint, ParityReport, ParitySummary,
    Verdict, BUILD_FORMAT, PARITY_FORMAT,
};

use crate::downloader::{self, Client, ShareHow};
use crate::hashing::FileDigest;
use crate::paths::check_rel_path;
use crate::strict_json;

pub const FORMAT: &str = "chunkforge-release/1";
pub const MANIFEST_FILE: &str = "manifest.json";

/// Problems with the inputs of `package`: build folders, reports, options.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseInputError {
    #[error("{}: {message}", path.display())]
    Build { path: PathBuf, message: String },
    #[error("{}: {message}", path.display())]
    Parity { path: PathBuf, message: String },
    #[error("{}: {message}", path.display())]
    Eval { path: PathBuf, message: String },
    #[error("{option}: {message}")]
    Option {
        option: &'static str,
        message: String,
    },
}

chunkforge_model::named! {
    /// What the runtime uses a package for (the manifest's `roles`).
    pub enum PackageRole {
        /// Token-by-token decode (`chunk1..4`, or a merged layout's packages).
        Decode = "decode",
        /// Speculative verify of K draft tokens (`verify_qK`).
        Verify = "verify",
        /// Batched prefill (`prefill_chunk1..4`).
        Prefill = "prefill",
    }
}

/// One package of a release: its chunk plan (from build.json), the layout it
/// belongs to, and what the runtime uses it for.
pub struct ReleaseChunk<'a> {
    pub layout: LayoutKind,
    pub plan: &'a ChunkPlan,
    pub roles: Vec<PackageRole>,
}

impl ReleaseChunk<'_> {
    pub fn name(&self) -> &str {
        &self.plan.name
    }

    /// Its folder in the release, the app's repository: the package at its
    /// remote path (`swa/chunk1.mlpackage`, `prefill/chunk1.mlpackage`,
    /// `merged_full.mlpackage`).
    pub fn file(&self) -> String {
        package_file(self.name(), false)
    }
}

/// The folder of package `name` in a release, the app's repository:
/// `swa/chunk1.mlpackage`, or `.mlmodelc` once compiled.
pub fn package_file(name: &str, compiled: bool) -> String {
    let path = chunkforge_model::layouts::repository_path(name).unwrap_or_else(|| name.to_string());
    format!("{path}.{}", if compiled { "mlmodelc" } else { "mlpackage" })
}

/// Why `file` cannot be package `name`'s folder in a release, if it cannot:
/// it must be the package at its remote path or at the root under its name
/// (a local-layout release), `.mlpackage` or compiled `.mlmodelc`. So a
/// manifest never leads a reader out of the folder (`..`, an absolute
/// path) or to another package's files.
pub fn check_package_file(name: &str, file: &str) -> Result<(), String> {
    if let Err(why) = crate::paths::check_component(name) {
        return Err(format!("package name '{name}' {why}"));
    }
    if let Err(why) = check_rel_path(file) {
        return Err(format!("'{file}' {why}"));
    }
    let allowed = [
        package_file(name, false),
        package_file(name, true),
        format!("{name}.mlpackage"),
        format!("{name}.mlmodelc"),
    ];
    if !allowed.iter().any(|a| a == file) {
        return Err(format!(
            "'{file}' is not package {name}'s folder (one of {})",
            allowed.join(", ")
        ));
    }
    Ok(())
}

/// Whether a function of `layout` holds more layers than the Neural Engine
/// is known to compile in one function ([`ANE_LAYER_CEILING`]).
pub fn over_ceiling(layout: &Layout) -> bool {
    layout
        .chunks
        .iter()
        .any(|c| c.layer_count() > ANE_LAYER_CEILING)
}

/// A build folder and its `build.json`.
pub struct Build {
    pub dir: PathBuf,
    pub record: BuildRecord,
}

impl Build {
    pub fn load(dir: &Path) -> Result<Build, ReleaseInputError> {
        let path = dir.join("build.json");
        let bad = |message: String| ReleaseInputError::Build {
            path: path.clone(),
            message,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| {
            bad(format!(
                "cannot read ({e}); is {} a `chunkforge build` output folder?",
                dir.display()
            ))
        })?;
        let json: Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON ({e})")))?;
        // The format first, so that another file is named as such.
        #[derive(Default, Deserialize)]
        struct Format {
            #[serde(default)]
            format: Value,
        }
        let format = serde_json::from_value::<Format>(json.clone())
            .unwrap_or_default()
            .format;
        if format != BUILD_FORMAT {
            return Err(bad(format!(
                "format is {format}, expected \"{BUILD_FORMAT}\""
            )));
        }
        let record: BuildRecord = serde_json::from_value(json)
            .map_err(|e| bad(format!("is not a chunkforge build record ({e})")))?;
        Ok(Build {
            dir: dir.to_path_buf(),
            record,
        })
    }

    fn err(&self, message: String) -> ReleaseInputError {
        ReleaseInputError::Build {
            path: self.dir.join("build.json"),
            message,
        }
    }

    pub fn layout(&self, kind: LayoutKind) -> Option<&Layout> {
        self.record.plan.layouts.iter().find(|l| l.kind == kind)
    }

    fn kinds(&self) -> String {
        let kinds: Vec<&str> = self
            .record
            .plan
            .layouts
            .iter()
            .map(|l| l.kind.as_str())
            .collect();
        kinds.join(", ")
    }

    /// The decode layouts to ship for `layout`, in plan order.
    pub fn decode_layouts(&self, layout: ReleaseLayout) -> Result<Vec<&Layout>, ReleaseInputError> {
        let want: Vec<LayoutKind> = match layout.kind() {
            // Prefill packages ship with every layout but are not a decode layout.
            None => self
                .record
                .plan
                .layouts
                .iter()
                .filter(|l| spec(l.kind).purpose == Purpose::Decode)
                .filter(|l| layout != ReleaseLayout::App || !over_ceiling(l))
                .map(|l| l.kind)
                .collect(),
            Some(k) => vec![k],
        };
        let mut out = Vec::new();
        for k in want {
            out.push(self.layout(k).ok_or_else(|| {
                self.err(format!(
                    "the build has layouts [{}], not '{k}'; rebuild with a --mode that includes it (e.g. --mode all)",
                    self.kinds()
                ))
            })?);
        }
        if layout != ReleaseLayout::Only(REFERENCE) && self.layout(REFERENCE).is_none() {
            return Err(self.err(format!(
                "layout {layout} releases also ship {} (the runtime keeps them for prefill and speculative verify), but the build has layouts [{}]; rebuild with --mode all, or carry them from a release of the same checkpoint with --onto",
                spec(REFERENCE).summary(),
                self.kinds()
            )));
        }
        Ok(out)
    }

    /// Every chunk plan to ship, each once: the decode layouts' chunks, then
    /// the four-chunk prefill chunks if not already there. Each comes with the
    /// layout it belongs to and its roles.
    pub fn release_chunks(
        &self,
        layout: ReleaseLayout,
    ) -> Result<Vec<ReleaseChunk<'_>>, ReleaseInputError> {
        let decode = self.decode_layouts(layout)?;
        let mut out: Vec<ReleaseChunk> = Vec::new();
        // A package's roles are the functions it holds: chunk1..4 decode (the
        // runtime's fallback layout) and, when built with it, verify_qK.
        let roles_of = |c: &ChunkPlan| {
            let has = |k: FunctionKind| c.functions.iter().any(|f| f.kind == k);
            if has(FunctionKind::Prefill) {
                vec![PackageRole::Prefill]
            } else if has(FunctionKind::Verify) {
                vec![PackageRole::Decode, PackageRole::Verify]
            } else {
                vec![PackageRole::Decode]
            }
        };
        let mut ship = decode.clone();
        if !decode.iter().any(|l| l.kind == REFERENCE) {
            ship.extend(self.layout(REFERENCE));
        }
        ship.extend(self.layout(LayoutKind::Prefill));
        for l in ship {
            // A borrowed first chunk is the reference's package, which ships
            // as the reference's.
            let skip = usize::from(spec(l.kind).borrows_first);
            for c in l.chunks.iter().skip(skip) {
                if out.iter().any(|o| o.name() == c.name) {
                    continue;
                }
                out.push(ReleaseChunk {
                    layout: l.kind,
                    plan: c,
                    roles: roles_of(c),
                });
            }
        }
        for c in &out {
            let name = c.name();
            if name.is_empty() || check_rel_path(name).is_err() || name.contains('/') {
                return Err(self.err(format!(
                    "plan has a chunk with an unusable name {:?}",
                    c.plan.name
                )));
            }
        }
        Ok(out)
    }

    /// The build record of package `name` (`chunks[]` in build.json).
    pub fn chunk_record(&self, name: &str) -> Option<&ChunkRecord> {
        self.record.chunk(name)
    }
}

/// A path as a case-insensitive file system compares it: upper- then
/// lower-cased, so that `ß`/`SS` and `ſ`/`s` meet as full case folding makes
/// them. (Unicode normalization, which APFS also ignores, is not applied.)
fn case_fold(p: &str) -> String {
    p.to_uppercase().to_lowercase()
}

/// Pairs of distinct paths that name the same file, or a file and a folder,
/// on a case-insensitive file system (APFS as the app's devices use it): one
/// would overwrite or block the other when the release is unpacked there.
pub fn case_collisions<'a>(paths: impl IntoIterator<Item = &'a str>) -> Vec<(String, String)> {
    let mut files: BTreeMap<String, &str> = BTreeMap::new();
    let mut folders: BTreeMap<String, &str> = BTreeMap::new();
    let mut out = Vec::new();
    for p in paths {
        match files.entry(case_fold(p)) {
            Entry::Occupied(e) if *e.get() != p => out.push((e.get().to_string(), p.to_string())),
            Entry::Occupied(_) => {}
            Entry::Vacant(e) => {
                e.insert(p);
            }
        }
        for (i, _) in p.match_indices('/') {
            folders.entry(case_fold(&p[..i])).or_insert(&p[..i]);
        }
    }
    for (folded, file) in &files {
        if let Some(folder) = folders.get(folded) {
            out.push((file.to_string(), format!("{folder}/...")));
        }
    }
    out
}

/// Percent-encodes a relative path for a URL (keeps `/` and unreserved characters).
fn url_path(p: &str) -> String {
    let mut s = String::with_capacity(p.len());
    for b in p.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

/// The URL of release path `p` served from `base_url`.
pub fn file_url(base_url: &str, p: &str) -> String {
    format!("{}/{}", base_url.trim_end_matches('/'), url_path(p))
}

/// Reads `--parity-report` and returns its `summary`, to be embedded.
/// The report must be about the build's checkpoint (same `config.json`
/// digest) and must have passed: `summary.ok` true and no failed step, oracle
/// step or artifact check behind it. With `allow_failed` a failed (or
/// inconclusive) report is accepted, with `accept_inconclusive` an
/// inconclusive one; either is embedded as it is (`ok: false`, its
/// `verdict`), never as passed.
pub fn parity_summary(
    path: &Path,
    build: &Build,
    allow_failed: bool,
    accept_inconclusive: bool,
) -> Result<EmbeddedParity, ReleaseInputError> {
    let bad = |message: String| ReleaseInputError::Parity {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read ({e})")))?;
    let v: Value = strict_json::from_str(&text)
        .map_err(|e| bad(format!("not valid JSON ({e}); expected a parity report")))?;
    // What is checked before the whole report is read, each with a message of
    // its own (anything but an object reads as an empty outline).
    #[derive(Default, Deserialize)]
    struct Outline {
        #[serde(default)]
        summary: Option<Value>,
        #[serde(default)]
        format: Option<Value>,
        #[serde(default)]
        checkpoint: Option<Value>,
    }
    #[derive(Deserialize)]
    struct OkField {
        #[serde(default)]
        ok: Option<Value>,
    }
    let outline: Outline = serde_json::from_value(v.clone()).unwrap_or_default();
    let summary = match outline.summary {
        Some(s @ Value::Object(_)) => s,
        Some(_) => return Err(bad("`summary` must be a JSON object".into())),
        None => {
            return Err(bad(
                "no top-level `summary` object; is this a chunkforge parity report?".into(),
            ))
        }
    };
    let format = outline.format.unwrap_or(Value::Null);
    if format != PARITY_FORMAT {
        return Err(bad(format!(
            "format is {format}, expected \"{PARITY_FORMAT}\" (written by `chunkforge parity --report`)"
        )));
    }
    // The checkpoint first: a report about another model is refused as such,
    // whatever else is wrong with it.
    let checkpoint: ParityCheckpoint = outline
        .checkpoint
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| bad(format!("is not a chunkforge parity report ({e})")))?
        .unwrap_or_default();
    let theirs = checkpoint.config_sha256.as_str();
    let ours = build.record.checkpoint.config_sha256.as_str();
    if ours.is_empty() {
        return Err(build.err(
            "has no checkpoint.config_sha256, so no parity report can be matched to it".into(),
        ));
    }
    if theirs != ours {
        return Err(bad(format!(
            "is about another checkpoint: its config.json digest is {} ({}), the build's is {ours} ({}); run parity on the checkpoint that was built",
            if theirs.is_empty() { "missing" } else { theirs },
            if checkpoint.dir.is_empty() { "?" } else { &checkpoint.dir },
            build.record.checkpoint.dir,
        )));
    }
    let Some(ours) = &build.record.checkpoint.weights else {
        return Err(build.err(
            "records no digest of the checkpoint's weights (built by an older chunkforge), so no parity \
             report can be matched to the weights it was built from; build it again, or package it \
             without --parity-report"
                .into(),
        ));
    };
    let Some(theirs) = &checkpoint.weights else {
        return Err(bad(
            "does not say which weights it was run on (written by an older chunkforge, or by hand); \
             run chunkforge parity --report on the checkpoint that was built"
                .into(),
        ));
    };
    if theirs.sha256 != ours.sha256 {
        let differ = ours.differences(theirs, "build.json", "the report");
        return Err(bad(format!(
            "is about other weights than the build's (same config.json): {}; the report's checkpoint is {}, \
             the build's {}; run parity on the checkpoint that was built",
            if differ.is_empty() {
                format!("weights digest {} vs {}", theirs.sha256, ours.sha256)
            } else {
                differ.join("; ")
            },
            if checkpoint.dir.is_empty() { "?" } else { &checkpoint.dir },
            build.record.checkpoint.dir,
        )));
    }
    let ok_field: OkField = serde_json::from_value(summary.clone())
        .map_err(|e| bad(format!("is not a chunkforge parity report ({e})")))?;
    let ok = match ok_field.ok {
        Some(Value::Bool(ok)) => ok,
        other => {
            return Err(bad(format!(
                "summary.ok is {}, expected true or false",
                other.unwrap_or(Value::Null)
            )))
        }
    };
    let embedded: EmbeddedParity = serde_json::from_value(summary)
        .map_err(|e| bad(format!("is not a chunkforge parity report ({e})")))?;
    let report: ParityReport = serde_json::from_value(v)
        .map_err(|e| bad(format!("is not a chunkforge parity report ({e})")))?;
    let failed = report.failed_checks();
    let verdict = report.summary.verdict();
    if ok {
        if let Some((f, v)) = report.checks_not_ok().first() {
            return Err(bad(format!(
                "summary.ok is true but {f} {}; the report contradicts itself",
                if *v == Verdict::Fail {
                    "failed"
                } else {
                    "is inconclusive"
                }
            )));
        }
        if verdict != Verdict::Ok {
            return Err(bad(format!(
                "summary.ok is true but summary.verdict is {verdict}; the report contradicts itself"
            )));
        }
    } else if verdict == Verdict::Ok {
        return Err(bad(
            "summary.ok is false but summary.verdict is ok; the report contradicts itself".into(),
        ));
    } else if verdict == Verdict::Inconclusive {
        if let Some(f) = failed.first() {
            return Err(bad(format!(
                "summary.verdict is inconclusive but {f} failed; the report contradicts itself"
            )));
        }
        if report.inconclusive_checks().is_empty() {
            return Err(bad(
                "summary.verdict is inconclusive but no oracle step is ill-conditioned and failing; the report contradicts itself".into(),
            ));
        }
        if !(accept_inconclusive || allow_failed) {
            return Err(bad(format!(
                "parity INCONCLUSIVE ({}): the reference disagrees with transformers only where transformers \
                 disagrees with itself, so a conversion error there would go unseen; refusing to sign it \
                 (--accept-inconclusive-parity signs it, recorded as inconclusive)",
                report.inconclusive_checks().join("; ")
            )));
        }
    } else if !allow_failed {
        return Err(bad(format!(
            "parity FAILED (summary.ok is false{}); refusing to sign a failed result (--allow-failed-parity embeds it, marked failed)",
            failed
                .first()
                .map(|f| format!(", first: {f}"))
                .unwrap_or_default()
        )));
    }
    Ok(embedded)
}

/// What `package` signs beside the resource list (the predicate's
/// `chunkforge` member): enough for a downloader to know what it is looking
/// at before it reads the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PredicateSummary {
    pub format: String,
    pub model_id: String,
    pub version: String,
    pub layout: ReleaseLayout,
    pub packages: Vec<String>,
    pub manifest_sha256: String,
    pub files: usize,
    pub bytes: u64,
}

impl PredicateSummary {
    /// Its member of the signed statement's predicate.
    pub const MEMBER: &'static str = "chunkforge";

    /// The summary a signed predicate holds, if it holds one of this shape.
    pub fn of_predicate(predicate: &serde_json::Map<String, Value>) -> Option<Self> {
        let member = predicate.get(Self::MEMBER)?;
        serde_json::from_value(member.clone()).ok()
    }
}

/// Reads `--eval-report` (`chunkforge eval --report` of the build, or of a
/// release of it) and returns what the manifest records of it. The report
/// must be about the build's checkpoint (config.json and weights digests)
/// and its packages' precision, and its fp16 range check, if it ran, must
/// have held.
pub fn eval_summary(path: &Path, build: &Build) -> Result<EmbeddedEval, ReleaseInputError> {
    let bad = |message: String| ReleaseInputError::Eval {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read ({e})")))?;
    let v: Value = strict_json::from_str(&text)
        .map_err(|e| bad(format!("not valid JSON ({e}); expected an eval report")))?;
    if v.get("format") != Some(&Value::String(EVAL_FORMAT.into())) {
        return Err(bad(format!(
            "format is {}, expected \"{EVAL_FORMAT}\" (written by `chunkforge eval --report`)",
            v.get("format").unwrap_or(&Value::Null)
        )));
    }
    let report: EvalReport = serde_json::from_value(v)
        .map_err(|e| bad(format!("is not a chunkforge eval report ({e})")))?;
    let b = &build.record.checkpoint;
    if report.checkpoint.config_sha256 != b.config_sha256 {
        return Err(bad(format!(
            "is about another checkpoint: its config.json digest is {}, the build's is {}; evaluate the build",
            report.checkpoint.config_sha256, b.config_sha256
        )));
    }
    match (&report.checkpoint.weights, &b.weights) {
        (Some(theirs), Some(ours)) if theirs.sha256 == ours.sha256 => {}
        _ => {
            return Err(bad(
                "is not about the weights the build was made from (or does not say); evaluate the build".into(),
            ))
        }
    }
    let precision = if build.record.settings.quantize {
        "INT4"
    } else {
        "FP16"
    };
    if report.precision != precision {
        return Err(bad(format!(
            "evaluated {} packages, the build's are {precision}",
            report.precision
        )));
    }
    if let Some(bad_op) = report
        .result
        .fp16_range
        .as_ref()
        .and_then(|r| r.introduced.first())
    {
        return Err(bad(format!(
            "its fp16 range check failed ({} makes inf or NaN in fp16 that fp32 does not); refusing to sign",
            bad_op.name()
        )));
    }
    Ok(report.embedded())
}

/// A parity report's summary as the manifest embeds it (`parity`): the
/// report's typed summary, and whatever else a hand-written summary says,
/// kept as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EmbeddedParity {
    #[serde(flatten)]
    pub summary: ParitySummary,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

impl EmbeddedParity {
    pub fn ok(&self) -> bool {
        self.summary.ok
    }
}

/// Whether the release's packages were compiled to `.mlmodelc`, as the
/// manifest records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Compiled {
    pub mlmodelc: bool,
    pub note: String,
    /// What wrote the `.mlmodelc` files: chunkforge's own writer (any
    /// platform) or Core ML's compiler through coremltools (macOS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// Whether a device has loaded these compiled models; chunkforge never
    /// sets it (DEVICE_RUNBOOK.md's first step is that load).
    #[serde(default)]
    pub device_verified: bool,
}

impl Compiled {
    /// Not compiled: `why` says so in the manifest.
    pub fn not(why: &str) -> Self {
        Compiled {
            mlmodelc: false,
            note: why.into(),
            by: None,
            device_verified: false,
        }
    }
}

/// Everything the manifest says besides the file list.
pub struct ManifestInputs<'a> {
    pub build: &'a Build,
    pub layout: ReleaseLayout,
    pub version: &'a str,
    pub model_id: &'a str,
    pub parity: Option<EmbeddedParity>,
    pub base_url: Option<&'a str>,
    pub compiled: &'a Compiled,
}

chunkforge_model::named! {
    /// What the runtime uses a file of the release for (`files[].roles`).
    pub enum FileRole {
        /// A decode package's file.
        Decode = "decode",
        /// A package holding `verify_qK`.
        Verify = "verify",
        /// A prefill package's file.
        Prefill = "prefill",
        /// The int8 embedding tables and the per-layer projection files.
        Embedding = "embedding",
        /// The cos/sin tables.
        Rope = "rope",
        /// `model_config.json`.
        Config = "config",
        /// `hf_model/`: the tokenizer and the config it dispatches on.
        Tokenizer = "tokenizer",
        /// For people, not the runtime: `DEVICE_RUNBOOK.md`.
        Docs = "docs",
        /// `distribution.json`, upstream's per-file distribution manifest.
        Distribution = "distribution",
        /// A multimodal encoder file of the image encoders (carried by
        /// `package --encoders-from`).
        Vision = "vision",
        /// A file of the audio encoder and its side files (carried).
        Audio = "audio",
    }
}

/// The roles of the file at release path `path`: its package's roles, or
/// what the side file or `hf_model/` file is for.
fn file_roles(path: &str, chunks: &[ManifestChunk]) -> Vec<FileRole> {
    if path.starts_with(&format!("{}/", crate::paths::HF_MODEL_DIR)) {
        return vec![FileRole::Tokenizer];
    }
    if path == crate::paths::RUNBOOK_FILE {
        return vec![FileRole::Docs];
    }
    if path == crate::paths::DISTRIBUTION_FILE {
        return vec![FileRole::Distribution];
    }
    let encoder = downloader::all_encoder_files().into_iter().find(|e| {
        path == e.path
            || path
                .strip_prefix(e.path)
                .is_some_and(|r| r.starts_with('/'))
    });
    if let Some(e) = encoder {
        return vec![match e.role {
            downloader::EncoderRole::Vision => FileRole::Vision,
            downloader::EncoderRole::Audio => FileRole::Audio,
        }];
    }
    let package = chunks.iter().find(|c| {
        path.strip_prefix(&c.file)
            .is_some_and(|r| r.starts_with('/'))
    });
    if let Some(c) = package {
        return c
            .roles
            .iter()
            .map(|r| match r {
                PackageRole::Decode => FileRole::Decode,
                PackageRole::Verify => FileRole::Verify,
                PackageRole::Prefill => FileRole::Prefill,
            })
            .collect();
    }
    crate::sidefiles::spec_of(path)
        .map(|f| match f.role {
            crate::sidefiles::Role::Embedding => FileRole::Embedding,
            crate::sidefiles::Role::Rope => FileRole::Rope,
            crate::sidefiles::Role::Config => FileRole::Config,
        })
        .into_iter()
        .collect()
}

/// Groups of files with one blob digest (e.g. a prefill package's weights
/// equal to its decode package's), so a downloader fetches each blob once.
fn shared_blobs(files: &[(String, FileDigest)]) -> Vec<SharedBlob> {
    let mut by_digest: BTreeMap<String, (u64, Vec<String>)> = BTreeMap::new();
    for (p, d) in files {
        by_digest
            .entry(d.hex())
            .or_insert((d.size, Vec::new()))
            .1
            .push(p.clone());
    }
    by_digest
        .into_iter()
        .filter(|(_, (size, paths))| paths.len() > 1 && *size > 0)
        .map(|(sha256, (size, paths))| SharedBlob {
            sha256,
            size,
            paths,
        })
        .collect()
}

/// A SHA-256 digest as lowercase hex (for the schema).
struct Sha256Hex;

impl JsonSchema for Sha256Hex {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "sha256".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({"type": "string", "pattern": "^[0-9a-f]{64}$"})
    }
}

/// A release path (for the schema): what [`check_rel_path`] accepts.
struct RelPath;

impl JsonSchema for RelPath {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "rel_path".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Relative POSIX path: no leading '/', no backslash, no control character, no '.', '..' or empty component.",
            "type": "string",
            "minLength": 1,
            "pattern": "^(?!/)(?!.*\\\\)(?!(.*/)?\\.\\.?(/|$))(?!.*//)[^\\u0000-\\u001f\\u007f-\\u009f]+$"
        })
    }
}

/// `manifest.json`. Members are written in this order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(
    deny_unknown_fields,
    title = "chunkforge release manifest (manifest.json)",
    description = "Table of contents of a chunkforge release folder: model, release, packages with layer ranges and I/O contracts, KV slot maps, conversion settings, parity summary, tool versions and every file with size and SHA-256. manifest.json itself and model.sig are not listed in `files`; model.sig (OpenSSF model signing format) covers manifest.json and every listed file."
)]
pub struct Manifest {
    #[schemars(extend("const" = FORMAT))]
    pub format: String,
    pub model: ModelInfo,
    pub release: ReleaseInfo,
    /// Model dimensions from the build plan (config.json-derived), as the runtime needs them.
    pub dims: Dims,
    /// Every package, each once: the decode layouts' chunks, then the reference's and the prefill packages.
    #[schemars(length(min = 1))]
    pub chunks: Vec<ManifestChunk>,
    /// The decode layouts this release carries, each with the KV slot map from the reference's prefill caches into its caches (empty for the reference).
    #[schemars(length(min = 1))]
    pub decode_layouts: Vec<DecodeLayout>,
    /// The packages that prefill: batched prefill packages when the build has them, else the reference's chunks token by token.
    pub prefill: PrefillLayout,
    /// Conversion settings from build.json.
    #[serde(serialize_with = "ConversionSettings::recorded")]
    pub settings: ConversionSettings,
    /// The `summary` object of the parity report given to `package --parity-report` (schema in parity/).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "EmbeddedParity")]
    pub parity: Option<EmbeddedParity>,
    /// What the release costs against its source checkpoint: the figures of the eval
    /// report given to `package --eval-report` (`release --eval`; schema in eval/).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EmbeddedEval>,
    pub tools: Tools,
    /// Whether the packages were compiled to .mlmodelc (xcrun coremlcompiler, macOS only), and why not.
    pub compiled: Compiled,
    /// Every file of the release except manifest.json and model.sig, sorted by path components.
    #[schemars(length(min = 1))]
    pub files: Vec<FileEntry>,
    /// Groups of files with the same SHA-256 (e.g. a prefill package's weights equal to its decode package's): a downloader fetches each blob once.
    pub shared_blobs: Vec<SharedBlob>,
    /// The weight blobs the app's downloader links or copies from one package into another (ModelDownloader.swift's finishDownload, per download entry): each package's blob and the packages it comes from, which must be byte-identical to it.
    #[serde(default)]
    pub shares: Vec<WeightShare>,
    /// The release these files were carried from (`package --onto`): the files marked `carried` came from it, checked against the build first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub onto: Option<OntoRecord>,
}

/// The existing release `package --onto` carried the files the build did
/// not make from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct OntoRecord {
    /// Its manifest's model id (an upstream bundle's `model_config.json` `model_name`).
    pub model_id: String,
    /// Its manifest's release version (an upstream bundle has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Its layout: `repository` (the app's remote paths) or `local` (every file at the root).
    #[schemars(pattern("^(repository|local)$"))]
    pub layout: String,
    /// An upstream bundle (compiled packages, no manifest), not a chunkforge release.
    #[serde(default, skip_serializing_if = "is_false")]
    pub upstream: bool,
    /// The packages carried from it.
    pub packages: Vec<String>,
    /// Whether its signature, and every carried file against its signed digest, verified. False: `package --allow-unverified-onto` carried a release unverified (each file checked against its unsigned manifest.json only), or an upstream bundle, which has no signature (only its packages are carried, checked against the plan's contracts).
    #[serde(default)]
    pub verified: bool,
    /// The SHA-256 (hex) of the public key (PEM, as model_signing's key hint) its signature verified with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Sha256Hex>")]
    pub public_key_sha256: Option<String>,
}

/// One package whose weight blob the app takes from another package's: the
/// entries in `by` fetch it without `weights/` and link or copy `from`'s
/// blob in. The blob files are `weights/weight.bin` inside each package's
/// `file` (`Data/com.apple.CoreML/weights/weight.bin` in an `.mlpackage`), so
/// the record holds compiled or not.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct WeightShare {
    /// The package receiving the blob (its name in the app's model folder).
    #[schemars(length(min = 1))]
    pub package: String,
    /// The package whose blob it receives.
    #[schemars(length(min = 1))]
    pub from: String,
    /// The download entries that make this share, and how.
    #[schemars(length(min = 1))]
    pub by: Vec<ShareUse>,
    /// Whether the release holds the package's own blob too (an entry it serves fetches it with its weights).
    pub stored: bool,
    /// The package's blob as built: `from`'s must be these bytes.
    pub size: u64,
    #[schemars(with = "Sha256Hex")]
    pub sha256: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ShareUse {
    pub client: Client,
    pub how: ShareHow,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ModelInfo {
    #[schemars(length(min = 1))]
    pub id: String,
    pub architecture: String,
    #[schemars(with = "Sha256Hex")]
    pub config_sha256: String,
    /// The digest of the weights the packages were built from (build.json's
    /// `checkpoint.weights.sha256`); a parity report embedded in `parity` was
    /// run on these weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Sha256Hex>")]
    pub weights_sha256: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ReleaseInfo {
    #[schemars(length(min = 1))]
    pub version: String,
    pub layout: ReleaseLayout,
}

/// One tensor of a contract as the manifest states it: name, shape and
/// dtype (roles are the plan's internal wiring, not part of the runtime's
/// contract).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ContractTensor {
    #[schemars(length(min = 1))]
    pub name: String,
    #[schemars(inner(range(min = 1)))]
    pub shape: Vec<usize>,
    pub dtype: Dtype,
}

/// One function of a package: decode (`main` or `decode_q1`), `verify_qK`, `prefill_bN`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ManifestFunction {
    #[schemars(pattern("^(main|decode_q1|verify_qK|prefill_b[0-9]+)$"))]
    pub name: String,
    pub kind: FunctionKind,
    #[schemars(range(min = 1))]
    pub tokens: usize,
    #[schemars(length(min = 1))]
    pub inputs: Vec<ContractTensor>,
    #[schemars(length(min = 1))]
    pub outputs: Vec<ContractTensor>,
    /// Prefill: the layer of each K{i}/V{i} output.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_layers: Vec<usize>,
}

/// One package of the release.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ManifestChunk {
    #[schemars(pattern("^[A-Za-z0-9_.-]+$"))]
    pub name: String,
    /// Its folder in the release (the app's repository): `swa/chunk1.mlpackage`, `prefill/chunk1.mlpackage`, `merged_full.mlpackage` (sideloaded); `.mlmodelc` once compiled.
    #[schemars(pattern(r"^((swa|prefill)/)?[A-Za-z0-9_.-]+\.(mlpackage|mlmodelc)$"))]
    pub file: String,
    pub layout: LayoutKind,
    #[schemars(length(min = 1))]
    pub roles: Vec<PackageRole>,
    pub first_layer: usize,
    pub last_layer: usize,
    /// Layers owning a sliding KV slot, in slot order.
    pub sliding_slots: Vec<usize>,
    /// Layers owning a full KV slot, in slot order.
    pub full_slots: Vec<usize>,
    pub emits: Vec<AliasUse>,
    pub consumes: Vec<AliasUse>,
    pub computes_per_layer_input: bool,
    pub has_head: bool,
    #[schemars(length(min = 1))]
    pub inputs: Vec<ContractTensor>,
    #[schemars(length(min = 1))]
    pub outputs: Vec<ContractTensor>,
    /// Every function of the package, the default first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub functions: Vec<ManifestFunction>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Sha256Hex")]
    pub sha256_tree: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "u64")]
    pub weight_bytes: Option<u64>,
}

impl ManifestChunk {
    /// The package's layer count.
    pub fn layers(&self) -> usize {
        self.last_layer + 1 - self.first_layer
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct DecodeLayout {
    pub kind: LayoutKind,
    #[schemars(length(min = 1))]
    pub chunks: Vec<String>,
    pub kv_slot_map: Vec<SlotCopy>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct PrefillLayout {
    pub layout: LayoutKind,
    #[schemars(length(min = 1))]
    pub chunks: Vec<String>,
}

/// Tool versions: chunkforge's that built and that packaged, and the Python side's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Tools {
    /// chunkforge version that built the packages.
    pub chunkforge: String,
    /// chunkforge version that made this release.
    pub chunkforge_package: String,
    pub python: Option<String>,
    pub coremltools: Option<String>,
    pub torch: Option<String>,
    pub transformers: Option<String>,
}

/// One file of the release.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct FileEntry {
    #[schemars(with = "RelPath")]
    pub path: String,
    pub size: u64,
    #[schemars(with = "Sha256Hex")]
    pub sha256: String,
    /// What the runtime uses the file for: a package's roles, a side file's, tokenizer (hf_model/) or docs (for people).
    #[schemars(length(min = 1))]
    pub roles: Vec<FileRole>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String", pattern("^https?://"))]
    pub url: Option<String>,
    /// Carried from the release `onto` names (`package --onto`), not made by this build.
    #[serde(default, skip_serializing_if = "is_false")]
    pub carried: bool,
}

fn is_false(b: &bool) -> bool {
    !b
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct SharedBlob {
    #[schemars(with = "Sha256Hex")]
    pub sha256: String,
    #[schemars(range(min = 1))]
    pub size: u64,
    #[schemars(with = "Vec<RelPath>", length(min = 2))]
    pub paths: Vec<String>,
}

impl Manifest {
    /// Everything but the file list (filled by [`Manifest::list_files`]).
    pub fn build(inp: &ManifestInputs) -> Result<Manifest, ReleaseInputError> {
        let b = &inp.build.record;
        let chunks = inp.build.release_chunks(inp.layout)?;
        let decode = inp.build.decode_layouts(inp.layout)?;
        let names = |l: &Layout| l.chunks.iter().map(|c| c.name.clone()).collect::<Vec<_>>();
        let chunks = chunks
            .iter()
            .map(|rc| {
                let c = rc.plan;
                let record = inp.build.chunk_record(rc.name());
                ManifestChunk {
                    name: c.name.clone(),
                    file: rc.file(),
                    layout: rc.layout,
                    roles: rc.roles.clone(),
                    first_layer: c.first_layer,
                    last_layer: c.last_layer,
                    sliding_slots: c.sliding_slots.clone(),
                    full_slots: c.full_slots.clone(),
                    emits: c.emits.clone(),
                    consumes: c.consumes.clone(),
                    computes_per_layer_input: c.computes_per_layer_input,
                    has_head: c.has_head,
                    inputs: contract(&c.inputs),
                    outputs: contract(&c.outputs),
                    functions: c.functions.iter().map(ManifestFunction::of).collect(),
                    sha256_tree: record.map(|r| r.sha256_tree.clone()),
                    weight_bytes: record.map(|r| r.weight_bytes),
                }
            })
            .collect();
        // Batched prefill packages when the build has them; otherwise the
        // runtime prefills one token at a time through the reference.
        let prefill = inp
            .build
            .layout(LayoutKind::Prefill)
            .or(inp.build.layout(REFERENCE))
            .ok_or_else(|| inp.build.err(format!("has no {REFERENCE} layout")))?;
        Ok(Manifest {
            format: FORMAT.into(),
            model: ModelInfo {
                id: inp.model_id.into(),
                architecture: b.checkpoint.architecture.clone(),
                config_sha256: b.checkpoint.config_sha256.clone(),
                weights_sha256: b.checkpoint.weights.as_ref().map(|w| w.sha256.clone()),
            },
            release: ReleaseInfo {
                version: inp.version.into(),
                layout: inp.layout,
            },
            dims: b.plan.dims.clone(),
            chunks,
            decode_layouts: decode
                .iter()
                .map(|l| DecodeLayout {
                    kind: l.kind,
                    chunks: names(l),
                    kv_slot_map: l.kv_slot_map.clone(),
                })
                .collect(),
            prefill: PrefillLayout {
                layout: prefill.kind,
                chunks: names(prefill),
            },
            settings: b.settings.clone(),
            parity: inp.parity.clone(),
            eval: None,
            tools: Tools {
                chunkforge: b.tool.chunkforge.clone(),
                chunkforge_package: env!("CARGO_PKG_VERSION").into(),
                python: b.tool.python("python").map(str::to_string),
                coremltools: b.tool.python("coremltools").map(str::to_string),
                torch: b.tool.python("torch").map(str::to_string),
                transformers: b.tool.python("transformers").map(str::to_string),
            },
            compiled: inp.compiled.clone(),
            files: Vec::new(),
            shared_blobs: Vec::new(),
            shares: Vec::new(),
            onto: None,
        })
    }

    /// Lists `files` (every file of the release except the manifest and the
    /// signature, sorted by path components) with their roles, and the
    /// blobs they share.
    pub fn list_files(&mut self, files: &[(String, FileDigest)], base_url: Option<&str>) {
        let base = base_url.map(|u| u.trim_end_matches('/').to_string());
        self.files = files
            .iter()
            .map(|(p, d)| FileEntry {
                path: p.clone(),
                size: d.size,
                sha256: d.hex(),
                roles: file_roles(p, &self.chunks),
                url: base.as_ref().map(|b| file_url(b, p)),
                carried: false,
            })
            .collect();
        self.shared_blobs = shared_blobs(files);
    }

    /// Reads a release's `manifest.json` (duplicate keys refused).
    pub fn load(path: &Path) -> Result<Manifest, String> {
        let bytes = std::fs::read(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                "missing".to_string()
            } else {
                format!("cannot read: {e}")
            }
        })?;
        let v = strict_json::from_slice(&bytes).map_err(|e| format!("not valid JSON: {e}"))?;
        let m: Manifest =
            serde_json::from_value(v).map_err(|e| format!("not a chunkforge manifest: {e}"))?;
        m.check_paths()?;
        Ok(m)
    }

    /// Every path the manifest states stays inside the release folder:
    /// `files[].path` and `shared_blobs[].paths` are safe relative paths
    /// ([`check_rel_path`]), each `chunks[].file` is its package's folder
    /// ([`check_package_file`]). A reader joins them to the folder only
    /// after this.
    pub fn check_paths(&self) -> Result<(), String> {
        for (i, c) in self.chunks.iter().enumerate() {
            check_package_file(&c.name, &c.file).map_err(|e| format!("chunks[{i}].file: {e}"))?;
        }
        let listed = self.files.iter().map(|f| ("files[].path", &f.path)).chain(
            self.shared_blobs
                .iter()
                .flat_map(|b| b.paths.iter().map(|p| ("shared_blobs[].paths", p))),
        );
        for (what, p) in listed {
            check_rel_path(p).map_err(|why| format!("{what}: '{p}' {why}"))?;
        }
        Ok(())
    }

    /// The entry of package `name`.
    pub fn chunk(&self, name: &str) -> Option<&ManifestChunk> {
        self.chunks.iter().find(|c| c.name == name)
    }

    /// The path of package `name`'s weight blob in the release.
    pub fn blob_path(&self, name: &str) -> Option<String> {
        self.chunk(name)
            .map(|c| format!("{}/{}", c.file, downloader::blob_in(&c.file)))
    }

    /// The decode layouts this release ships, by kind.
    pub fn layout_kinds(&self) -> Vec<LayoutKind> {
        self.decode_layouts.iter().map(|l| l.kind).collect()
    }
}

impl ManifestFunction {
    fn of(f: &FunctionPlan) -> Self {
        ManifestFunction {
            name: f.name.clone(),
            kind: f.kind,
            tokens: f.tokens,
            inputs: contract(&f.inputs),
            outputs: contract(&f.outputs),
            kv_layers: f.kv_layers.clone(),
        }
    }
}

/// A contract as the manifest states it.
pub fn contract(specs: &[TensorSpec]) -> Vec<ContractTensor> {
    specs
        .iter()
        .map(|t| ContractTensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            dtype: t.dtype,
        })
        .collect()
}

/// What `verify` reads of a `manifest.json` it cannot trust yet: its format
/// and each file entry on its own, so that every problem is collected.
#[derive(Default, Deserialize)]
pub struct LenientManifest {
    #[serde(default)]
    pub format: Value,
    #[serde(default)]
    files: Option<Value>,
}

#[derive(Deserialize)]
struct LenientFile {
    path: String,
    size: u64,
    sha256: String,
}

impl LenientManifest {
    /// Anything but a JSON object reads as an empty manifest.
    pub fn of(m: &Value) -> Self {
        serde_json::from_value(m.clone()).unwrap_or_default()
    }
}

/// The manifest's `files` as (path, size, sha256 hex), for verification.
/// Entries that are not objects with those fields are reported as problems.
pub fn manifest_files(m: &Value) -> (Vec<(String, u64, String)>, Vec<String>) {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    let files = LenientManifest::of(m)
        .files
        .and_then(|f| serde_json::from_value::<Vec<Value>>(f).ok());
    match files {
        None => problems.push("manifest.json: has no `files` list".to_string()),
        Some(a) => {
            for (i, f) in a.into_iter().enumerate() {
                match serde_json::from_value::<LenientFile>(f) {
                    Ok(f) => out.push((f.path, f.size, f.sha256)),
                    Err(_) => problems.push(format!(
                        "manifest.json: files[{i}] needs path, size and sha256"
                    )),
                }
            }
        }
    }
    (out, problems)
}

/// One of the manifest's weight shares as `verify` reads it: the release
/// paths of the package's blob and of the blob the app gives it, whether the
/// release holds the package's own, the digest both must have, and who
/// shares it (for the message).
pub struct ShareCheck {
    pub blob: String,
    pub from_blob: String,
    pub stored: bool,
    pub sha256: String,
    pub by: String,
}

/// The manifest's `shares` as paths to check (each blob inside its
/// package's `file`, compiled or not); entries it cannot read are problems.
pub fn manifest_shares(m: &Value) -> (Vec<ShareCheck>, Vec<String>) {
    #[derive(Deserialize)]
    struct Chunk {
        name: String,
        file: String,
    }
    #[derive(Deserialize)]
    struct Share {
        package: String,
        from: String,
        stored: bool,
        sha256: String,
        by: Vec<ShareUse>,
    }
    #[derive(Default, Deserialize)]
    struct Outline {
        #[serde(default)]
        chunks: Vec<Value>,
        #[serde(default)]
        shares: Vec<Value>,
    }
    let outline: Outline = serde_json::from_value(m.clone()).unwrap_or_default();
    let files: BTreeMap<String, String> = outline
        .chunks
        .into_iter()
        .filter_map(|c| serde_json::from_value::<Chunk>(c).ok())
        .map(|c| (c.name, c.file))
        .collect();
    let blob = |name: &str| {
        files
            .get(name)
            .filter(|f| check_rel_path(f).is_ok())
            .map(|f| format!("{f}/{}", downloader::blob_in(f)))
    };
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (i, v) in outline.shares.into_iter().enumerate() {
        let Ok(s) = serde_json::from_value::<Share>(v) else {
            problems.push(format!(
                "{MANIFEST_FILE}: shares[{i}] needs package, from, by, stored and sha256"
            ));
            continue;
        };
        match (blob(&s.package), blob(&s.from)) {
            (Some(b), Some(f)) => out.push(ShareCheck {
                blob: b,
                from_blob: f,
                stored: s.stored,
                sha256: s.sha256.to_ascii_lowercase(),
                by: s
                    .by
                    .iter()
                    .map(|u| format!("{}: {}", u.client, u.how))
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
            _ => problems.push(format!(
                "{MANIFEST_FILE}: shares[{i}] names {} and {}, not both packages of `chunks`",
                s.package, s.from
            )),
        }
    }
    (out, problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_insensitive_collisions() {
        let c = case_collisions([
            "a/Weight.bin",
            "a/weight.bin",
            "b",
            "b",
            "STRASSE",
            "straße",
        ]);
        assert_eq!(
            c,
            [
                ("a/Weight.bin".to_string(), "a/weight.bin".to_string()),
                ("STRASSE".to_string(), "straße".to_string())
            ]
        );
        // A file and a folder that fold to the same name.
        let c = case_collisions(["Data", "data/x.bin"]);
        assert_eq!(c, [("Data".to_string(), "data/...".to_string())]);
        // Folders differing in case merge harmlessly; different files stay apart.
        assert!(case_collisions(["A/x", "a/y", "w.b", "w/b"]).is_empty());
    }

    #[test]
    fn url_encoding() {
        assert_eq!(url_path("a b/c#d.bin"), "a%20b/c%23d.bin");
    }
}
