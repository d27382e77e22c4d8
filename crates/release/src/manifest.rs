//! `manifest.json`, the release's table of contents for the app's downloader:
//! what model and release this is, which packages it holds with their layer
//! ranges and I/O contracts, how prefill KV maps into each decode layout, the
//! conversion settings and tool versions, the parity summary, and every file
//! with its size and SHA-256. The schema is `manifests/manifest.schema.json`.
//!
//! Everything here is read out of `build.json` (the plan computed at build
//! time); nothing is re-derived.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use chunkforge_model::plan::{ChunkPlan, FunctionKind, Layout, LayoutKind, TensorSpec};
use chunkforge_model::records::{
    BuildRecord, ChunkRecord, ParityCheckpoint, ParityReport, BUILD_FORMAT, PARITY_FORMAT,
};

use crate::hashing::FileDigest;
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
    #[error("{option}: {message}")]
    Option {
        option: &'static str,
        message: String,
    },
}

chunkforge_model::named! {
    /// Which decode layouts a release carries.
    pub enum ReleaseLayout {
        /// chunk1..chunk4.
        Four = "four",
        /// chunk1_3way..chunk3_3way, plus chunk1..4.
        Three = "three",
        /// merged_chunk1 + merged_chunk2, plus chunk1..4 for prefill and verify.
        Two = "two",
        /// merged_full, plus chunk1..4 for prefill and verify.
        One = "one",
        /// Every layout in the build.
        All = "all",
    }
}

impl ReleaseLayout {
    /// The one decode layout this ships (None: every layout of the build).
    pub fn kind(self) -> Option<LayoutKind> {
        match self {
            ReleaseLayout::Four => Some(LayoutKind::Four),
            ReleaseLayout::Three => Some(LayoutKind::Three),
            ReleaseLayout::Two => Some(LayoutKind::Two),
            ReleaseLayout::One => Some(LayoutKind::One),
            ReleaseLayout::All => None,
        }
    }
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
        if json.get("format").and_then(Value::as_str) != Some(BUILD_FORMAT) {
            return Err(bad(format!(
                "format is {}, expected \"{BUILD_FORMAT}\"",
                json.get("format").unwrap_or(&Value::Null)
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
                .map(|l| l.kind)
                .filter(|k| *k != LayoutKind::Prefill)
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
        if layout != ReleaseLayout::Four && self.layout(LayoutKind::Four).is_none() {
            return Err(self.err(format!(
                "layout {layout} releases also ship chunk1..chunk4 (the runtime keeps them for prefill and speculative verify), but the build has layouts [{}]; rebuild with --mode all",
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
        if !decode.iter().any(|l| l.kind == LayoutKind::Four) {
            ship.push(
                self.layout(LayoutKind::Four)
                    .expect("checked in decode_layouts"),
            );
        }
        ship.extend(self.layout(LayoutKind::Prefill));
        for l in ship {
            for c in &l.chunks {
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

/// Why a relative path in a manifest, signature or archive is unsafe, if it is.
pub fn check_rel_path(p: &str) -> Result<(), &'static str> {
    if p.is_empty() {
        return Err("is empty");
    }
    if p.starts_with('/') {
        return Err("is absolute");
    }
    if p.contains('\\') {
        return Err("contains a backslash");
    }
    if p.contains('\0') {
        return Err("contains a NUL byte");
    }
    let b = p.as_bytes();
    if b.len() >= 2 && b[1] == b':' && b[0].is_ascii_alphabetic() {
        return Err("starts with a drive letter");
    }
    for c in p.split('/') {
        match c {
            ".." => return Err("contains '..'"),
            "." | "" => return Err("has an empty or '.' component"),
            _ => {}
        }
    }
    Ok(())
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

/// Reads `--parity-report` and returns its `summary`, to be embedded verbatim.
/// The report must be about the build's checkpoint (same `config.json`
/// digest) and must have passed: `summary.ok` true and no failed step, oracle
/// step or artifact check behind it. With `allow_failed` a failed report is
/// accepted, and embedded as it is (`ok: false`), never as passed.
pub fn parity_summary(
    path: &Path,
    build: &Build,
    allow_failed: bool,
) -> Result<EmbeddedParity, ReleaseInputError> {
    let bad = |message: String| ReleaseInputError::Parity {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read ({e})")))?;
    let v: Value = strict_json::from_str(&text)
        .map_err(|e| bad(format!("not valid JSON ({e}); expected a parity report")))?;
    let summary = match v.get("summary") {
        Some(s @ Value::Object(_)) => s,
        Some(_) => return Err(bad("`summary` must be a JSON object".into())),
        None => {
            return Err(bad(
                "no top-level `summary` object; is this a chunkforge parity report?".into(),
            ))
        }
    };
    let format = v.get("format").unwrap_or(&Value::Null);
    if format != PARITY_FORMAT {
        return Err(bad(format!(
            "format is {format}, expected \"{PARITY_FORMAT}\" (written by `chunkforge parity --report`)"
        )));
    }
    // The checkpoint first: a report about another model is refused as such,
    // whatever else is wrong with it.
    #[derive(Deserialize)]
    struct About {
        #[serde(default)]
        checkpoint: ParityCheckpoint,
    }
    let about: About = serde_json::from_value(v.clone())
        .map_err(|e| bad(format!("is not a chunkforge parity report ({e})")))?;
    let theirs = about.checkpoint.config_sha256.as_str();
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
            if about.checkpoint.dir.is_empty() { "?" } else { &about.checkpoint.dir },
            build.record.checkpoint.dir,
        )));
    }
    let ok = match summary.get("ok") {
        Some(Value::Bool(ok)) => *ok,
        other => {
            return Err(bad(format!(
                "summary.ok is {}, expected true or false",
                other.unwrap_or(&Value::Null)
            )))
        }
    };
    let embedded = summary.clone();
    let report: ParityReport = serde_json::from_value(v)
        .map_err(|e| bad(format!("is not a chunkforge parity report ({e})")))?;
    let failed = report.failed_checks();
    if ok {
        if let Some(f) = failed.first() {
            return Err(bad(format!(
                "summary.ok is true but {f} failed; the report contradicts itself"
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
    Ok(EmbeddedParity {
        ok,
        summary: embedded,
    })
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

/// A parity report's summary as the manifest embeds it, and its verdict.
pub struct EmbeddedParity {
    pub ok: bool,
    /// The report's `summary`, verbatim.
    pub summary: Value,
}

/// Everything the manifest says besides the file list.
pub struct ManifestInputs<'a> {
    pub build: &'a Build,
    pub layout: ReleaseLayout,
    pub version: &'a str,
    pub model_id: &'a str,
    pub parity: Option<EmbeddedParity>,
    pub base_url: Option<&'a str>,
    pub compiled: &'a crate::package::Compiled,
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
    }
}

/// The roles of the file at release path `path`: its package's roles, or
/// what the side file or `hf_model/` file is for.
fn file_roles(path: &str, chunks: &[ReleaseChunk]) -> Vec<FileRole> {
    if path.starts_with(&format!("{}/", crate::package::HF_MODEL_DIR)) {
        return vec![FileRole::Tokenizer];
    }
    if path == crate::runbook::RUNBOOK_FILE {
        return vec![FileRole::Docs];
    }
    let top = path.split('/').next().unwrap_or_default();
    if let Some(pkg) = top
        .strip_suffix(".mlpackage")
        .or_else(|| top.strip_suffix(".mlmodelc"))
    {
        if let Some(c) = chunks.iter().find(|c| c.name() == pkg) {
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
    }
    crate::sidefiles::SIDE_FILES
        .iter()
        .find(|f| f.name == path)
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
fn shared_blobs(files: &[(String, FileDigest)]) -> Vec<Value> {
    let mut by_digest: BTreeMap<String, (u64, Vec<&str>)> = BTreeMap::new();
    for (p, d) in files {
        by_digest
            .entry(d.hex())
            .or_insert((d.size, Vec::new()))
            .1
            .push(p);
    }
    by_digest
        .into_iter()
        .filter(|(_, (size, paths))| paths.len() > 1 && *size > 0)
        .map(|(sha, (size, paths))| json!({"sha256": sha, "size": size, "paths": paths}))
        .collect()
}

/// Builds `manifest.json`. `files` are every file of the release except the
/// manifest and the signature, sorted by path components.
pub fn build_manifest(
    inp: &ManifestInputs,
    files: &[(String, FileDigest)],
) -> Result<Value, ReleaseInputError> {
    let b = &inp.build.record;
    let chunks = inp.build.release_chunks(inp.layout)?;
    let decode = inp.build.decode_layouts(inp.layout)?;
    let names = |l: &Layout| l.chunks.iter().map(|c| c.name.clone()).collect::<Vec<_>>();
    let chunk_json: Vec<Value> = chunks
        .iter()
        .map(|rc| {
            let c = rc.plan;
            let name = rc.name();
            let mut m = json!({
                "name": name,
                "file": format!("{name}.mlpackage"),
                "layout": rc.layout,
                "roles": rc.roles,
                "first_layer": c.first_layer,
                "last_layer": c.last_layer,
                "sliding_slots": c.sliding_slots,
                "full_slots": c.full_slots,
                "emits": c.emits,
                "consumes": c.consumes,
                "computes_per_layer_input": c.computes_per_layer_input,
                "has_head": c.has_head,
                "inputs": contract(&c.inputs),
                "outputs": contract(&c.outputs),
            });
            let m = m.as_object_mut().expect("an object");
            if !c.functions.is_empty() {
                let functions: Vec<Value> = c
                    .functions
                    .iter()
                    .map(|f| {
                        let mut v = json!({
                            "name": f.name,
                            "kind": f.kind,
                            "tokens": f.tokens,
                            "inputs": contract(&f.inputs),
                            "outputs": contract(&f.outputs),
                        });
                        if !f.kv_layers.is_empty() {
                            v.as_object_mut()
                                .expect("an object")
                                .insert("kv_layers".into(), json!(f.kv_layers));
                        }
                        v
                    })
                    .collect();
                m.insert("functions".into(), json!(functions));
            }
            if let Some(r) = inp.build.chunk_record(name) {
                m.insert("sha256_tree".into(), json!(r.sha256_tree));
                m.insert("weight_bytes".into(), json!(r.weight_bytes));
            }
            Value::Object(std::mem::take(m))
        })
        .collect();
    let layouts: Vec<Value> = decode
        .iter()
        .map(|l| json!({"kind": l.kind, "chunks": names(l), "kv_slot_map": l.kv_slot_map}))
        .collect();
    let four = inp
        .build
        .layout(LayoutKind::Four)
        .expect("checked by release_chunks");
    let base = inp.base_url.map(|u| u.trim_end_matches('/').to_string());
    let file_json: Vec<Value> = files
        .iter()
        .map(|(p, d)| {
            let mut m = Map::new();
            m.insert("path".into(), json!(p));
            m.insert("size".into(), json!(d.size));
            m.insert("sha256".into(), json!(d.hex()));
            m.insert("roles".into(), json!(file_roles(p, &chunks)));
            if let Some(base) = &base {
                m.insert("url".into(), json!(format!("{base}/{}", url_path(p))));
            }
            Value::Object(m)
        })
        .collect();
    // Batched prefill packages when the build has them; otherwise the runtime
    // prefills one token at a time through chunk1..4.
    let prefill = inp.build.layout(LayoutKind::Prefill).unwrap_or(four);
    let mut m = Map::new();
    m.insert("format".into(), json!(FORMAT));
    m.insert(
        "model".into(),
        json!({
            "id": inp.model_id,
            "architecture": b.checkpoint.architecture,
            "config_sha256": b.checkpoint.config_sha256,
        }),
    );
    m.insert(
        "release".into(),
        json!({"version": inp.version, "layout": inp.layout}),
    );
    m.insert("dims".into(), json!(b.plan.dims));
    m.insert("chunks".into(), Value::Array(chunk_json));
    m.insert("decode_layouts".into(), Value::Array(layouts));
    m.insert(
        "prefill".into(),
        json!({"layout": prefill.kind, "chunks": names(prefill)}),
    );
    m.insert("settings".into(), json!(b.settings));
    if let Some(p) = &inp.parity {
        m.insert("parity".into(), p.summary.clone());
    }
    m.insert(
        "tools".into(),
        json!({
            "chunkforge": b.tool.chunkforge,
            "chunkforge_package": env!("CARGO_PKG_VERSION"),
            "python": b.tool.python("python"),
            "coremltools": b.tool.python("coremltools"),
            "torch": b.tool.python("torch"),
            "transformers": b.tool.python("transformers"),
        }),
    );
    m.insert("compiled".into(), json!(inp.compiled));
    m.insert("files".into(), Value::Array(file_json));
    m.insert("shared_blobs".into(), Value::Array(shared_blobs(files)));
    Ok(Value::Object(m))
}

/// A contract as the manifest states it: name, shape and dtype per tensor
/// (roles are the plan's internal wiring, not part of the runtime's contract).
pub fn contract(specs: &[TensorSpec]) -> Vec<Value> {
    specs
        .iter()
        .map(|t| json!({"name": t.name, "shape": t.shape, "dtype": t.dtype}))
        .collect()
}

/// The manifest's `files` as (path, size, sha256 hex), for verification.
/// Entries that are not objects with those fields are reported as problems.
pub fn manifest_files(m: &Value) -> (Vec<(String, u64, String)>, Vec<String>) {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    match m.get("files").and_then(Value::as_array) {
        None => problems.push("manifest.json: has no `files` list".to_string()),
        Some(a) => {
            for (i, f) in a.iter().enumerate() {
                match (
                    f.get("path").and_then(Value::as_str),
                    f.get("size").and_then(Value::as_u64),
                    f.get("sha256").and_then(Value::as_str),
                ) {
                    (Some(p), Some(s), Some(h)) => out.push((p.to_string(), s, h.to_string())),
                    _ => problems.push(format!(
                        "manifest.json: files[{i}] needs path, size and sha256"
                    )),
                }
            }
        }
    }
    (out, problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_paths() {
        for bad in [
            "",
            "/etc/passwd",
            "a/../b",
            "..",
            "a//b",
            "./a",
            "a\\b",
            "C:x",
        ] {
            assert!(check_rel_path(bad).is_err(), "{bad}");
        }
        for good in [
            "a",
            "a/b.c",
            "merged_full.mlpackage/Manifest.json",
            "..a",
            "a..",
        ] {
            assert!(check_rel_path(good).is_ok(), "{good}");
        }
    }

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
