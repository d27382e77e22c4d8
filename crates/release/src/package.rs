//! `chunkforge package`: a signed release directory from a build folder.
//!
//! The release is assembled in a staging folder beside `--output` (same file
//! system, so the final step is a rename): packages are copied and hashed in
//! one read, the side files, `DEVICE_RUNBOOK.md` (the device bench, from the
//! manifest's facts) and `manifest.json` are written, the whole folder is
//! signed into `model.sig`, and only then does the folder take the place of
//! `--output`.
//! It is published with its archive as one unit (`crate::publish`): a run
//! killed at any point leaves the previous release or the new one, and the
//! next run undoes a publish cut short before its commit.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::archive;
use crate::bench::runbook::{self, RunbookFacts};
use crate::bench::runtime_layout;
use crate::distribution::Distribution;
use crate::downloader;
use crate::hashing::{self, FileDigest};
pub use crate::manifest::Compiled;
use crate::manifest::{
    self, Build, Manifest, ManifestInputs, PredicateSummary, ReleaseChunk, ReleaseInputError,
    ShareUse, WeightShare, MANIFEST_FILE,
};
use crate::onto::Onto;
use crate::paths::{
    self, DISTRIBUTION_FILE, HF_MODEL_DIR, HF_MODEL_FILES, RUNBOOK_FILE, TOKENIZER_FILE,
};
use crate::sidefiles::{self, SideFilesReport, SideFilesRequest};
use crate::sign::{self, SIG_FILE};
use crate::staging::{OnLocked, OutputLock};
use crate::staging::{Staging, TempFile};
use chunkforge_model::checkpoint::Checkpoint;
use chunkforge_model::config::TextConfig;
use chunkforge_model::layouts::{spec, ReleaseLayout, Runtime};
use chunkforge_model::plan::{LayoutKind, Role, ANE_LAYER_CEILING};
use chunkforge_model::records::{rule_counts_text, AuditRecord, RuleCounts, Verdict};

/// What `chunkforge package` is asked to do (the CLI's options, resolved).
#[derive(Clone, Debug)]
pub struct PackageRequest {
    pub build_dir: PathBuf,
    pub layout: ReleaseLayout,
    pub key: PathBuf,
    pub output: PathBuf,
    pub version: Option<String>,
    pub model_id: Option<String>,
    pub base_url: Option<String>,
    pub parity_report: Option<PathBuf>,
    /// An eval report of the build (`chunkforge eval --report`) whose figures the manifest records.
    pub eval_report: Option<PathBuf>,
    pub allow_failed_parity: bool,
    /// Sign an inconclusive parity report (recorded as such).
    pub accept_inconclusive_parity: bool,
    pub zip: Option<PathBuf>,
    pub on_locked: OnLocked,
    /// The checkpoint the side files and `hf_model/` come from (default:
    /// build.json's `checkpoint.dir`); its config.json must be the build's.
    pub hf_dir: Option<PathBuf>,
    /// Ship without `hf_model/tokenizer.json` (the app then needs its own).
    pub no_tokenizer: bool,
    /// Rows of the RoPE tables (default: the build's context length).
    pub rope_positions: Option<usize>,
    /// Whether `.mlmodelc` were compiled next to the packages (macOS only).
    pub compiled: Compiled,
    /// Ship although the build's audit has errors in the shipped packages.
    pub allow_audit_findings: bool,
    /// Ship even though a runtime would pick a layout with a function over
    /// the Neural Engine layer ceiling.
    pub allow_over_ceiling: bool,
    /// The bundle whose multimodal encoder files the release carries.
    pub encoders_from: Option<PathBuf>,
    /// The audit of the build's packages when its build.json has none (a
    /// build made before the audit existed; the caller runs it).
    pub audit: Option<AuditRecord>,
    /// An existing release to carry every file the build lacks from
    /// (`--onto`; [`crate::onto`]).
    pub onto: Option<PathBuf>,
    /// The public key `--onto`'s release is verified with (default: that
    /// of `key`).
    pub onto_public_key: Option<PathBuf>,
    /// Carry `--onto`'s release without verifying its signature (recorded
    /// in the manifest).
    pub allow_unverified_onto: bool,
}

/// What `package` did, for the summary line.
pub struct PackageReport {
    pub files: usize,
    pub bytes: u64,
    pub root_digest: String,
    pub zip: Option<(PathBuf, String)>,
    pub side_files: SideFilesReport,
    /// The `hf_model/` files shipped.
    pub hf_model: Vec<String>,
    /// The audit's errors in the shipped packages, by rule (shipped with
    /// `allow_audit_findings`; empty without errors).
    pub audit_errors: RuleCounts,
    /// Its warnings there, by rule (shipped: they cost speed only).
    pub audit_warnings: RuleCounts,
}

/// The checkpoint behind a build: its folder (checked to hold the config the
/// build was made from), config and tensors.
fn build_checkpoint(
    build: &Build,
    hf_dir: Option<&Path>,
) -> Result<(PathBuf, TextConfig, Checkpoint)> {
    let dir = hf_dir.map_or_else(
        || PathBuf::from(&build.record.checkpoint.dir),
        Path::to_path_buf,
    );
    if hf_dir.is_some() {
        chunkforge_model::checkpoint::check_folder(&dir)?;
    }
    let config = dir.join("config.json");
    if !config.is_file() {
        bail!(
            "{}: missing: the side files and hf_model/ come from the build's checkpoint; pass --hf-dir if it moved",
            config.display()
        );
    }
    let digest = hashing::sha256_file(&config)?;
    if digest != build.record.checkpoint.config_sha256 {
        bail!(
            "{}: not the checkpoint {} was built from (config.json sha256 {digest}, build.json has {})",
            config.display(),
            build.dir.join("build.json").display(),
            build.record.checkpoint.config_sha256
        );
    }
    let cfg = TextConfig::load(&dir)?;
    let ckpt = Checkpoint::open(&dir, &cfg)?;
    check_weights(build, &ckpt)?;
    Ok((dir, cfg, ckpt))
}

/// The checkpoint's weights are the ones the build was made from (its
/// config.json alone does not say: a fine-tune or another seed has the same
/// one): the side files are made from them, and a parity verdict signed
/// beside them is about the build's. Reads the weights once more (seconds
/// at real size: `bench hash`).
fn check_weights(build: &Build, ckpt: &Checkpoint) -> Result<()> {
    let record = build.dir.join("build.json");
    let Some(want) = &build.record.checkpoint.weights else {
        bail!(
            "{}: records no checkpoint.weights (built before chunkforge recorded them), so nothing ties the checkpoint's side files to the build's packages; rebuild",
            record.display()
        );
    };
    let got = hashing::weights_digest(ckpt)?;
    if got.sha256 != want.sha256 {
        let differ = got.differences(want, "the checkpoint", "build.json");
        bail!(
            "{}: not the weights {} was built from (same config.json): {}; the side files would come from another model than the packages: give --hf-dir the checkpoint the build was made from",
            ckpt.dir.display(),
            record.display(),
            if differ.is_empty() {
                format!("weights digest {} vs {}", got.sha256, want.sha256)
            } else {
                differ.join("; ")
            }
        );
    }
    Ok(())
}

/// The `hf_model/` files to copy: (source, path in the release). Without a
/// tokenizer that is an error naming it, unless `no_tokenizer`.
fn hf_model_sources(hf_dir: &Path, no_tokenizer: bool) -> Result<Sources> {
    let tokenizer = hf_dir.join(TOKENIZER_FILE);
    if !tokenizer.is_file() && !no_tokenizer {
        bail!(
            "{}: missing: the app's tokenizer ships in hf_model/; add it to the checkpoint, or pass --no-tokenizer to release without one",
            tokenizer.display()
        );
    }
    let sources: Sources = HF_MODEL_FILES
        .iter()
        .filter(|n| !(no_tokenizer && **n == TOKENIZER_FILE))
        .map(|n| (hf_dir.join(n), format!("{HF_MODEL_DIR}/{n}")))
        .filter(|(src, _)| src.is_file())
        .collect();
    // A link out of the checkpoint would copy that file into the release.
    for (src, _) in &sources {
        if let Some(why) = chunkforge_model::checkpoint::link_outside(hf_dir, src) {
            bail!("{}: {why}", src.display());
        }
    }
    Ok(sources)
}

/// Every full-attention mask of every function must span the context length
/// `model_config.json` states: the runtime throws on a mismatch and the
/// downloader deletes such a folder.
fn check_context_length(chunks: &[ReleaseChunk], context_length: usize) -> Result<()> {
    for c in chunks {
        let functions = c
            .plan
            .functions
            .iter()
            .map(|f| (f.name.as_str(), &f.inputs));
        let top = std::iter::once(("(default)", &c.plan.inputs));
        for (function, inputs) in top.chain(functions) {
            for t in inputs.iter().filter(|t| t.role == Role::MaskFull) {
                if t.shape.last() != Some(&context_length) {
                    bail!(
                        "{}.mlpackage: {function}'s {} is {:?} but model_config.json's context_length is {context_length}; the runtime would refuse this folder",
                        c.name(),
                        t.name,
                        t.shape
                    );
                }
            }
        }
    }
    Ok(())
}

/// The audit's (errors, warnings) in the packages `chunks` ship, from
/// build.json's audit record (or, for a build whose record is missing or
/// stale, `a.audit`). Errors refuse the release unless
/// `a.allow_audit_findings`; warnings are reported.
fn check_audit(
    build: &Build,
    chunks: &[ReleaseChunk],
    a: &PackageRequest,
) -> Result<(RuleCounts, RuleCounts)> {
    let path = build.dir.join("build.json");
    let bad = |message: String| ReleaseInputError::Build {
        path: path.clone(),
        message,
    };
    // A fresh audit (the record was missing or stale) over the recorded one.
    let audit = a.audit.as_ref().or(build.record.audit.as_ref()).ok_or_else(|| {
        bad("no audit record (a build made before `chunkforge audit`); rebuild, or package it with chunkforge, which audits it".into())
    })?;
    let names: Vec<String> = chunks
        .iter()
        .map(|c| format!("{}.mlpackage", c.name()))
        .collect();
    let found = audit
        .findings_of(names.iter().map(String::as_str))
        .map_err(|p| bad(format!("the audit record does not cover {p}; rebuild")))?;
    let (errors, warnings) = audit.split(&found);
    let total: u64 = errors.values().sum();
    if total > 0 && !a.allow_audit_findings {
        let with: Vec<&str> = names
            .iter()
            .filter(|n| !audit.split(&audit.packages[n.as_str()]).0.is_empty())
            .map(String::as_str)
            .collect();
        return Err(bad(format!(
            "the audit found {total} errors in the packages this release ships ({}; in {}); run `chunkforge audit {}` for the list, or pass --allow-audit-findings to ship them anyway",
            rule_counts_text(&errors),
            with.join(", "),
            build.dir.display()
        ))
        .into());
    }
    if total > 0 {
        eprintln!(
            "warning: {}: shipping packages with {total} audit errors ({}) as --allow-audit-findings asks",
            path.display(),
            rule_counts_text(&errors)
        );
    }
    let warned: u64 = warnings.values().sum();
    if warned > 0 {
        eprintln!(
            "note: {}: the packages this release ships have {warned} audit warnings ({}): patterns that cost speed on the Neural Engine, not a working package; `chunkforge audit {}` lists them",
            path.display(),
            rule_counts_text(&warnings),
            build.dir.display()
        );
    }
    Ok((errors, warnings))
}

/// Refuses to replace something that is not a previous release.
fn check_output(out: &Path) -> Result<()> {
    if out.is_symlink() {
        bail!(
            "{}: is a symlink; give the release folder's real path",
            out.display()
        );
    }
    if !out.exists() {
        return Ok(());
    }
    if !out.is_dir() {
        bail!("{}: exists and is not a folder", out.display());
    }
    let empty = fs::read_dir(out)
        .with_context(|| format!("{}: cannot list", out.display()))?
        .next()
        .is_none();
    if !empty && !out.join(SIG_FILE).exists() && !out.join(MANIFEST_FILE).exists() {
        bail!(
            "{}: exists and holds files but no {SIG_FILE} or {MANIFEST_FILE}: not a previous release; refusing to replace it",
            out.display()
        );
    }
    Ok(())
}

/// The output's parent folder and its final name.
pub fn split_output(out: &Path) -> Result<(PathBuf, String)> {
    split_path(out, "--output needs a folder name")
}

/// A path's parent folder (`.` for a bare name) and its final name; `missing`
/// says what is wrong when it has no usable name (`/`, `..`, non-UTF-8).
fn split_path(path: &Path, missing: &str) -> Result<(PathBuf, String)> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty() && *n != "..")
        .with_context(|| format!("{}: {missing}", path.display()))?
        .to_string();
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// [`paths::canonical_target`], as an error naming `path`.
fn canonical_target(path: &Path) -> Result<PathBuf> {
    paths::canonical_target(path)
        .with_context(|| format!("{}: cannot resolve the path", path.display()))
}

/// True when `line` is what `write_zip_staged` writes for an archive named `name`.
fn is_digest_line(text: &str, name: &str) -> bool {
    text.strip_suffix('\n')
        .and_then(|t| t.strip_suffix(name))
        .and_then(|t| t.strip_suffix("  "))
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Refuses a `--zip` that could destroy something. The archive and its
/// `FILE.sha256` replace only a previous release archive and its digest file
/// (never a folder, a symlink, a key, `build.json` or any other file), and
/// the archive goes neither inside the release folder nor inside a package of
/// the build folder: canonical paths are compared, so `..`, symlinks and
/// absolute or relative spellings all count.
fn check_zip(z: &Path, output: &Path, build_dir: &Path) -> Result<()> {
    let (_, name) = split_path(z, "--zip needs a file name")?;
    let target = canonical_target(z)?;
    if target.starts_with(canonical_target(output)?) {
        bail!(
            "{}: --zip must not be inside the release folder {}",
            z.display(),
            output.display()
        );
    }
    if let (Ok(b), Some(p)) = (build_dir.canonicalize(), target.parent()) {
        if p.starts_with(&b) && p != b {
            bail!(
                "{}: --zip must not be inside a package of the build folder {}",
                z.display(),
                build_dir.display()
            );
        }
    }
    let refuse = |p: &Path, what: &str| -> Result<()> {
        bail!(
            "{}: {what}; --zip replaces only a previous release archive and its .sha256 file, refusing to replace it",
            p.display()
        )
    };
    let digest = archive::digest_path(z);
    for p in [z, digest.as_path()] {
        match fs::symlink_metadata(p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => bail!("{}: cannot inspect ({e})", p.display()),
            Ok(m) if m.file_type().is_symlink() => refuse(p, "is a symlink")?,
            Ok(m) if !m.file_type().is_file() => refuse(p, "exists and is not a file")?,
            Ok(_) if p == z => {
                let names = archive::names(z).unwrap_or_default();
                if !names.iter().any(|n| n == SIG_FILE) || !names.iter().any(|n| n == MANIFEST_FILE)
                {
                    refuse(p, "exists and is not a release archive")?;
                }
            }
            Ok(m) => {
                let text = (m.len() < 4096)
                    .then(|| fs::read_to_string(p).ok())
                    .flatten();
                if !text.is_some_and(|t| is_digest_line(&t, &name)) {
                    refuse(p, "exists and is not an archive digest file")?;
                }
            }
        }
    }
    Ok(())
}

/// Files to copy: (source path, path inside the release).
pub type Sources = Vec<(PathBuf, String)>;

/// Files of one package folder as (source, path inside the release), plus its
/// sub-folders (release paths). A symlink, a special file or a name that is
/// not one plain path component is an error naming it
/// ([`hashing::Tree::refuse_odd`]): no release path is made from it.
fn package_files(src: &Path, pkg: &str) -> Result<(Sources, Vec<String>)> {
    let tree = hashing::walk(src, &|_| false)?;
    tree.refuse_odd(src)?;
    let dirs = tree.dirs.iter().map(|d| format!("{pkg}/{d}")).collect();
    let files = tree
        .files
        .into_iter()
        .map(|r| (src.join(&r), format!("{pkg}/{r}")))
        .collect();
    Ok((files, dirs))
}

/// The same digest `build` records as `sha256_tree`, over the files of
/// package `pkg` (release paths `pkg/...`).
fn tree_digest(pkg: &str, files: &[(String, FileDigest)]) -> String {
    let prefix = format!("{pkg}/");
    let own: BTreeMap<String, FileDigest> = files
        .iter()
        .filter_map(|(p, d)| p.strip_prefix(&prefix).map(|r| (r.to_string(), *d)))
        .collect();
    hashing::tree_sha256(&own)
}

/// Copies `sources` into `root` (creating `dirs` first), hashing each file as
/// it is copied, in parallel. Returns (path in release, digest), sorted by
/// path components. Every release path is checked ([`paths::check_rel_path`])
/// before it is joined to `root`, and every folder is made before the copy
/// starts: a copy never makes a folder, so once Ctrl-C has removed the
/// staging folder nothing is made again in its place (and copies stop).
pub fn copy_tree(
    root: &Path,
    sources: &[(PathBuf, String)],
    dirs: &[String],
) -> Result<Vec<(String, FileDigest)>> {
    let mut folders = std::collections::BTreeSet::new();
    let listed = dirs.iter().map(|d| (d.as_str(), true));
    let files = sources.iter().map(|(_, rel)| (rel.as_str(), false));
    for (rel, is_dir) in listed.chain(files) {
        paths::check_rel_path(rel)
            .map_err(|why| anyhow::anyhow!("{}: release path '{rel}' {why}", root.display()))?;
        let mut at = if is_dir {
            Some(rel)
        } else {
            rel.rsplit_once('/').map(|(d, _)| d)
        };
        while let Some(d) = at {
            folders.insert(d.to_string());
            at = d.rsplit_once('/').map(|(p, _)| p);
        }
    }
    // Sorted, a folder comes before everything inside it.
    for d in &folders {
        let path = root.join(d);
        match fs::create_dir(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(e).with_context(|| format!("{}: cannot create", path.display()))
            }
            _ => {}
        }
    }
    let mut out: Vec<(String, FileDigest)> = sources
        .par_iter()
        .map(|(src, rel)| {
            crate::staging::stop_if_interrupted();
            Ok((rel.clone(), hashing::copy_hashed(src, &root.join(rel))?))
        })
        .collect::<Result<_>>()?;
    out.sort_by(|a, b| hashing::cmp_components(&a.0, &b.0));
    Ok(out)
}

/// The summary chunkforge puts into the signed predicate beside the resource
/// list: enough for a downloader to know what it is looking at before it
/// reads the manifest.
fn predicate_summary(
    inp: &ManifestInputs,
    packages: &[ReleaseChunk],
    manifest_digest: &FileDigest,
    files: usize,
    bytes: u64,
) -> PredicateSummary {
    PredicateSummary {
        format: manifest::FORMAT.into(),
        model_id: inp.model_id.into(),
        version: inp.version.into(),
        layout: inp.layout,
        packages: packages.iter().map(ReleaseChunk::file).collect(),
        manifest_sha256: manifest_digest.hex(),
        files,
        bytes,
    }
}

/// What the checks before any copy establish: the release's packages, its
/// context length and RoPE rows, the audit findings it ships with, the
/// signing key, the parity summary, its version and model id, the
/// checkpoint, and where it goes.
struct Checked<'b> {
    chunks: Vec<ReleaseChunk<'b>>,
    context_length: usize,
    /// The audit's errors and warnings in the shipped packages, by rule.
    audit_errors: RuleCounts,
    audit_warnings: RuleCounts,
    parity: Option<manifest::EmbeddedParity>,
    eval: Option<chunkforge_model::quality::EmbeddedEval>,
    version: String,
    hf_dir: PathBuf,
    cfg: TextConfig,
    /// The build's checkpoint (None with `--onto` a release: nothing is
    /// made from it).
    ckpt: Option<Checkpoint>,
    inputs: Inputs,
}

/// The inputs of a release that its build does not decide: the options, the
/// signing key, the checkpoint's `hf_model/` files and where the release
/// goes ([`check_inputs`]).
pub struct Inputs {
    pub rope_positions: usize,
    pub key: p256::ecdsa::SigningKey,
    pub model_id: String,
    /// The `hf_model/` files: (source, path in the release).
    pub hf_sources: Sources,
    /// The folder `--output` goes into, and its name there.
    pub parent: PathBuf,
    pub name: String,
}

/// Checks the inputs of `a` that its build does not decide (`--rope-positions`
/// against `context_length`, the key, `--base-url`, `--version`, `--model-id`
/// or its default from `checkpoint_dir`, the name build.json records, the
/// tokenizer in `hf_dir`, the output and zip paths). `package` checks them
/// before it copies anything (in two steps, [`check_options`] and
/// [`check_paths`], the checkpoint between them); `release` before it starts
/// the build, so that a missing key file does not cost a build.
pub fn check_inputs(
    a: &PackageRequest,
    context_length: usize,
    checkpoint_dir: &Path,
    hf_dir: &Path,
) -> Result<Inputs> {
    let options = check_options(a, context_length, checkpoint_dir)?;
    Ok(Inputs::of(options, check_paths(a, hf_dir)?))
}

/// What [`check_options`] returns.
type Options = (usize, p256::ecdsa::SigningKey, String);
/// What [`check_paths`] returns.
type Paths = (Sources, PathBuf, String);

impl Inputs {
    fn of((rope_positions, key, model_id): Options, (hf_sources, parent, name): Paths) -> Self {
        Inputs {
            rope_positions,
            key,
            model_id,
            hf_sources,
            parent,
            name,
        }
    }
}

/// The options and the key of [`check_inputs`]: the RoPE rows, the signing
/// key and the model id.
fn check_options(
    a: &PackageRequest,
    context_length: usize,
    checkpoint_dir: &Path,
) -> Result<Options> {
    let rope_positions = a.rope_positions.unwrap_or(context_length);
    if rope_positions < context_length {
        return Err(ReleaseInputError::Option {
            option: "--rope-positions",
            message: format!("{rope_positions} is below the context length {context_length}: the runtime would read rows of zeros past the table's end"),
        }
        .into());
    }
    let key = sign::load_private_key(&a.key)?;
    if let Some(u) = &a.base_url {
        if let Err(why) = crate::distribution::check_base_url(u) {
            return Err(ReleaseInputError::Option {
                option: "--base-url",
                message: format!("{u:?} {why}"),
            }
            .into());
        }
    }
    if a.version.as_ref().is_some_and(|v| v.trim().is_empty()) {
        return Err(ReleaseInputError::Option {
            option: "--version",
            message: "must not be empty".into(),
        }
        .into());
    }
    let model_id = match &a.model_id {
        Some(id) => id.clone(),
        None => {
            let name = checkpoint_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "unknown".into());
            chunkforge_model::args::model_id(&name).map_err(|e| ReleaseInputError::Option {
                option: "--model-id",
                message: format!(
                    "not given, and the default (the checkpoint folder's name from build.json) {e}; pass --model-id"
                ),
            })?
        }
    };
    Ok((rope_positions, key, model_id))
}

/// The paths of [`check_inputs`]: the `hf_model/` files, and the folder
/// `--output` goes into with its name there.
fn check_paths(a: &PackageRequest, hf_dir: &Path) -> Result<Paths> {
    let hf_sources = hf_model_sources(hf_dir, a.no_tokenizer)?;
    check_output(&a.output)?;
    let (parent, name) = split_output(&a.output)?;
    // The staging folder goes into `parent`; inside a package it would be
    // copied into the release along with the package.
    if let (Ok(b), Ok(p)) = (a.build_dir.canonicalize(), parent.canonicalize()) {
        if p.starts_with(&b) && p != b {
            bail!(
                "{}: --output must not be inside a package of the build folder {}",
                a.output.display(),
                a.build_dir.display()
            );
        }
    }
    if let Some(z) = &a.zip {
        check_zip(z, &a.output, &a.build_dir)?;
    }
    check_inputs_kept(a)?;
    if let Some(d) = encoders_dir(a) {
        crate::encoders::encoder_sources(&d, &hf_dir.join("config.json"))?;
    }
    Ok((hf_sources, parent, name))
}

/// Refuses outputs that would change an input folder: the release and its
/// archive go neither into `--onto`'s nor `--encoders-from`'s folder (left
/// as they were), and replacing `--output` removes no input (resolved
/// paths are compared: symlinks and `..` count).
fn check_inputs_kept(a: &PackageRequest) -> Result<()> {
    let inputs = [
        ("--onto", a.onto.as_deref()),
        ("--encoders-from", a.encoders_from.as_deref()),
    ];
    for (option, dir) in inputs {
        let Some(dir) = dir else { continue };
        let outputs = std::iter::once(("--output", a.output.as_path()))
            .chain(a.zip.as_deref().map(|z| ("--zip", z)));
        for (out_option, out) in outputs {
            if paths::inside(out, dir) {
                bail!(
                    "{}: {out_option} must not be inside the {option} folder {} (package leaves it as it was)",
                    out.display(),
                    dir.display()
                );
            }
        }
    }
    let folders = [("build", Some(a.build_dir.as_path()))]
        .into_iter()
        .chain(inputs)
        .filter_map(|(what, d)| d.map(|d| (what, d)));
    for (what, dir) in folders {
        if paths::inside(dir, &a.output) {
            bail!(
                "{}: the {what} folder {} is inside it, and the release replaces it",
                a.output.display(),
                dir.display()
            );
        }
    }
    Ok(())
}

/// Where the encoder files come from: `--encoders-from`, else `--onto`'s
/// release when it holds any of the app's encoder files (a release packaged
/// with encoders carries them on). Never implicitly from an upstream bundle
/// (no manifest): nothing checks its encoders, so it takes `--encoders-from`.
fn encoders_dir(a: &PackageRequest) -> Option<PathBuf> {
    a.encoders_from.clone().or_else(|| {
        a.onto.clone().filter(|d| {
            d.join(MANIFEST_FILE).is_file()
                && crate::downloader::all_encoder_files()
                    .iter()
                    .any(|e| d.join(e.path).exists())
        })
    })
}

/// Refuses a release in which a runtime build would pick, by file presence, a
/// layout with a function over the Neural Engine layer ceiling (the branch
/// picks `merged_full` before anything else), unless
/// `--allow-over-ceiling`.
fn check_ceiling(a: &PackageRequest, build: &Build, chunks: &[ReleaseChunk]) -> Result<()> {
    if a.allow_over_ceiling {
        return Ok(());
    }
    let has = |n: &str| chunks.iter().any(|c| c.name() == n);
    for rt in Runtime::ALL {
        let kind = runtime_layout::pick_for(*rt, has);
        let Some(l) = build.layout(kind).filter(|l| manifest::over_ceiling(l)) else {
            continue;
        };
        let big: Vec<String> = l
            .chunks
            .iter()
            .filter(|c| c.layer_count() > ANE_LAYER_CEILING)
            .map(|c| format!("{} ({} layers)", c.name, c.layer_count()))
            .collect();
        return Err(ReleaseInputError::Option {
            option: "--layout",
            message: format!(
                "{}: {rt_name} would pick the {kind} layout, whose {} exceed the {ANE_LAYER_CEILING} layers one Neural Engine function is known to compile (35 failed on the iPhone 17 Pro); ship --layout app (every layout within the ceiling), or pass --allow-over-ceiling to ship it anyway",
                a.layout,
                big.join(", "),
                rt_name = rt.describe(),
            ),
        }
        .into());
    }
    Ok(())
}

/// Every cheap check of `a` against `build`, before gigabytes are copied.
fn check<'b>(a: &PackageRequest, build: &'b Build, onto: Option<&Onto>) -> Result<Checked<'b>> {
    let chunks = build.release_chunks(a.layout)?;
    let carried = |n: &str| onto.is_some_and(|o| o.carries(n));
    // Fail on every cheap check before copying gigabytes.
    for c in chunks.iter().filter(|c| !carried(c.name())) {
        let name = c.name();
        let dir = a.build_dir.join(format!("{name}.mlpackage"));
        if !dir.is_dir() {
            return Err(ReleaseInputError::Build {
                path: dir,
                message: format!(
                    "missing: layout {} needs package {name}.mlpackage, which this build folder does not have (was the build interrupted, or built with another --mode?)",
                    a.layout
                ),
            }
            .into());
        }
    }
    if build.layout(LayoutKind::Prefill).is_none() {
        return Err(ReleaseInputError::Build {
            path: a.build_dir.join("build.json"),
            message: format!(
                "no {}: the runtime requires them in every model folder; build with --mode all (or --prefill-len), or carry them from a release with --onto",
                spec(LayoutKind::Prefill).range()
            ),
        }
        .into());
    }
    check_ceiling(a, build, &chunks)?;
    let context_length = build.record.settings.ctx;
    check_context_length(&chunks, context_length)?;
    // The build's audit covers the packages it made.
    let built: Vec<ReleaseChunk> = chunks
        .iter()
        .filter(|c| !carried(c.name()))
        .map(|c| ReleaseChunk {
            layout: c.layout,
            plan: c.plan,
            roles: c.roles.clone(),
        })
        .collect();
    let (audit_errors, audit_warnings) = check_audit(build, &built, a)?;
    let options = check_options(a, context_length, Path::new(&build.record.checkpoint.dir))?;
    let parity = a
        .parity_report
        .as_deref()
        .map(|p| {
            manifest::parity_summary(
                p,
                build,
                a.allow_failed_parity,
                a.accept_inconclusive_parity,
            )
        })
        .transpose()?;
    let eval = a
        .eval_report
        .as_deref()
        .map(|p| manifest::eval_summary(p, build))
        .transpose()?;
    if let (Some(p), Some(s)) = (&a.parity_report, &parity) {
        if !s.ok() {
            let verdict = s.summary.verdict();
            eprintln!(
                "warning: {}: parity {}; embedded in the manifest as such (summary.ok false)",
                p.display(),
                if verdict == Verdict::Inconclusive {
                    "INCONCLUSIVE"
                } else {
                    "FAILED"
                }
            );
        }
    }
    // With --onto a release, the side files and hf_model/ come from DIR
    // (its config checked to be the build's), and the checkpoint is not
    // read; an upstream bundle carries only its packages.
    let (hf_dir, cfg, ckpt) = match onto.filter(|o| !o.compiled()) {
        Some(o) => (o.dir().join(HF_MODEL_DIR), o.cfg().clone(), None),
        None => {
            let (d, c, k) = build_checkpoint(build, a.hf_dir.as_deref())?;
            (d, c, Some(k))
        }
    };
    let inputs = Inputs::of(options, check_paths(a, &hf_dir)?);
    let build_json_digest = hashing::hash_file(&a.build_dir.join("build.json"))?;
    let version = a
        .version
        .clone()
        .unwrap_or_else(|| format!("build-{}", &build_json_digest.hex()[..12]));

    Ok(Checked {
        chunks,
        context_length,
        audit_errors,
        audit_warnings,
        parity,
        eval,
        version,
        hf_dir,
        cfg,
        ckpt,
        inputs,
    })
}

/// What the release copies, read from its inputs and checked before
/// anything is written ([`gather`]).
struct Gathered {
    /// Files to copy: the packages, `hf_model/`, the encoders.
    sources: Sources,
    /// The folders they go into (release paths).
    dirs: Vec<String>,
    /// The side files carried from `--onto`'s release.
    side: Sources,
    /// Each package: (name, release path, the folder it comes from).
    pkgs: Vec<(String, String, PathBuf)>,
    /// The weight blobs no entry the release serves fetches: each package's
    /// is shared in from another package's, so the release holds it once.
    held_back: Sources,
    /// Blobs a carried package holds only through a share in DIR: their
    /// digests as DIR's manifest records them.
    held_known: Vec<(String, FileDigest)>,
    /// The files carried from `--onto`'s DIR: (release path, source).
    carried: Vec<(String, PathBuf)>,
    /// The shares of the entries the release serves.
    planned: Vec<downloader::PlannedShare>,
}

/// Every file the release copies, each folder walked and each name checked
/// (no symlink, special file or name that is not one plain path component:
/// [`package_files`]), the weight blobs the app shares found, and a `--zip`
/// the app could not extract refused: before anything is written.
fn gather(a: &PackageRequest, build: &Build, c: &Checked, onto: Option<&Onto>) -> Result<Gathered> {
    let carried = |n: &str| onto.filter(|o| o.carries(n));
    let mut g = Gathered {
        sources: c.inputs.hf_sources.clone(),
        dirs: vec![HF_MODEL_DIR.to_string()],
        side: onto.map(Onto::side_files).unwrap_or_default(),
        pkgs: Vec::new(),
        held_back: Vec::new(),
        held_known: Vec::new(),
        carried: Vec::new(),
        planned: planned_shares(a, build)?,
    };
    for chunk in &c.chunks {
        let n = chunk.name();
        // A package carried from an upstream bundle stays compiled.
        let pkg = carried(n).map_or_else(|| chunk.file(), |o| o.release_file(n));
        let src = match carried(n) {
            Some(o) => o.package_dir(n),
            None => a.build_dir.join(format!("{n}.mlpackage")),
        };
        let (mut f, d) = package_files(&src, &pkg)?;
        if carried(n).is_some() {
            g.carried
                .extend(f.iter().map(|(src, rel)| (rel.clone(), src.clone())));
        }
        let blob = format!("{pkg}/{}", downloader::blob_in(&pkg));
        let has_blob = f.iter().any(|(_, rel)| *rel == blob);
        match g.planned.iter().find(|s| s.package == n) {
            Some(share) if !share.stored => match f.iter().position(|(_, rel)| *rel == blob) {
                Some(at) => g.held_back.push(f.remove(at)),
                None => match carried(n).map(|o| (o, o.held_blob(n, share.from))) {
                    Some((_, Some(d))) => g.held_known.push((blob, d)),
                    // DIR holds it only through the share: the blob missing
                    // is the one shared in.
                    Some((o, None)) => {
                        let from = o.release_file(share.from);
                        return Err(ReleaseInputError::Build {
                            path: o.package_dir(share.from).join(downloader::blob_in(&from)),
                            message: format!(
                                "missing: {n} holds no weight blob of its own in {}, and this one, which the app's download shares into it, is not there either",
                                o.dir().display()
                            ),
                        }
                        .into());
                    }
                    None => {
                        return Err(ReleaseInputError::Build {
                            path: src.join(downloader::blob_in(&pkg)),
                            message: "missing: every package holds its weight blob".into(),
                        }
                        .into())
                    }
                },
            },
            // An entry fetches this package with its blob: a bundle that
            // holds it only through a share cannot serve that entry.
            Some(share) if !has_blob && carried(n).is_some() => {
                return Err(ReleaseInputError::Build {
                    path: src.join(downloader::blob_in(&pkg)),
                    message: format!(
                        "missing: the app's {} download fetches {n} with its weights (the bundle shares {}'s in)",
                        share.by.iter().map(|(c, _)| c.as_str()).collect::<Vec<_>>().join(", "),
                        share.from
                    ),
                }
                .into())
            }
            _ => {}
        }
        g.dirs.push(pkg.clone());
        g.dirs.extend(d);
        g.sources.extend(f);
        if a.compiled.mlmodelc && !carried(n).is_some_and(|o| o.compiled()) {
            let compiled = manifest::package_file(n, true);
            let (f, d) = package_files(&a.build_dir.join(format!("{n}.mlmodelc")), &compiled)?;
            g.dirs.push(compiled);
            g.dirs.extend(d);
            g.sources.extend(f);
        }
        g.pkgs.push((n.to_string(), pkg, src));
    }
    if let Some(d) = encoders_dir(a) {
        let config = c
            .inputs
            .hf_sources
            .iter()
            .find(|(_, rel)| rel == &format!("{HF_MODEL_DIR}/config.json"))
            .map(|(src, _)| src.clone())
            .unwrap_or_default();
        let enc = crate::encoders::encoder_sources(&d, &config)?;
        for (e, clients) in &enc.absent {
            eprintln!(
                "note: {} has no {} ({} encoder): the {} download{} abort{} on it with multimodal on",
                d.display(),
                e.path,
                e.role,
                clients.join(", "),
                if clients.len() == 1 { "" } else { "s" },
                if clients.len() == 1 { "s" } else { "" }
            );
        }
        g.dirs.extend(enc.dirs);
        // From `--onto`'s release (no --encoders-from): carried, checked
        // against DIR's manifest with the rest.
        if a.encoders_from.is_none() && onto.is_some() {
            g.carried.extend(
                enc.files
                    .iter()
                    .map(|(src, rel)| (rel.clone(), src.clone())),
            );
        }
        g.sources.extend(enc.files);
    }
    if let Some((x, y)) =
        manifest::case_collisions(g.sources.iter().map(|(_, r)| r.as_str())).first()
    {
        bail!(
            "{}: '{x}' and '{y}' are the same path on a case-insensitive file system (as on iOS and macOS), so the release could not be unpacked there; rename one",
            a.build_dir.display()
        );
    }
    if let Some(o) = onto.filter(|o| !o.compiled()) {
        g.carried.extend(
            c.inputs
                .hf_sources
                .iter()
                .chain(&g.side)
                .map(|(src, rel)| (rel.clone(), src.clone())),
        );
        // Each carried file must be one DIR's manifest lists.
        for (_, src) in &g.carried {
            o.listed(src)?;
        }
    }
    check_zip_early(a, &g, c)?;
    Ok(g)
}

/// Refuses, before anything is copied, a `--zip` the app's extractor could
/// not read already from what is known now: every copied file with its
/// size, and the files still to be written counted (the required side files
/// at their sizes, the run book, `manifest.json`, `model.sig`,
/// `distribution.json`). `write_zip_staged` checks the archive as written.
fn check_zip_early(a: &PackageRequest, g: &Gathered, c: &Checked) -> Result<()> {
    let Some(z) = &a.zip else {
        return Ok(());
    };
    let mut entries: Vec<(String, u64)> = Vec::new();
    for (src, rel) in g.sources.iter().chain(&g.side) {
        let len = fs::metadata(src)
            .with_context(|| format!("{}: cannot stat", src.display()))?
            .len();
        entries.push((rel.clone(), len));
    }
    if c.ckpt.is_some() {
        for spec in sidefiles::SIDE_FILES.iter().filter(|s| s.required) {
            let len = match spec.expected(&c.cfg) {
                sidefiles::Expected::Bytes(n) => n,
                _ => 0,
            };
            entries.push((spec.repository_path(), len));
        }
    }
    let mut written = vec![RUNBOOK_FILE, MANIFEST_FILE, SIG_FILE];
    if a.base_url.is_some() {
        written.push(DISTRIBUTION_FILE);
    }
    entries.extend(written.into_iter().map(|n| (n.to_string(), 0)));
    archive::check_app_extractable(z, &entries, archive::stored_size(&entries))
        .map_err(anyhow::Error::msg)
}

/// Copies what [`gather`] found into `root` (hashing each file in the same
/// read), writes the side files there, and checks each package against
/// build.json (a carried one against DIR's manifest) and each carried file
/// against DIR's manifest, as copied.
fn write_files(
    a: &PackageRequest,
    build: &Build,
    c: &Checked,
    g: Gathered,
    root: &Path,
    onto: Option<&Onto>,
) -> Result<Staged> {
    let carried = |n: &str| onto.filter(|o| o.carries(n));
    let mut files = copy_tree(root, &g.sources, &g.dirs)?;
    let side_files = match (onto.filter(|o| !o.compiled()), &c.ckpt) {
        (Some(_), _) => {
            let t = std::time::Instant::now();
            let copied = copy_tree(root, &g.side, &[])?;
            let report = SideFilesReport {
                files: copied
                    .iter()
                    .map(|(rel, d)| {
                        Ok(sidefiles::SideFile {
                            path: rel.into(),
                            bytes: d.size,
                            role: sidefiles::role_of(rel).with_context(|| {
                                format!(
                                    "{rel}: carried as a side file, but no side file has that name"
                                )
                            })?,
                            seconds: 0.0,
                        })
                    })
                    .collect::<Result<_>>()?,
                bytes_read: copied.iter().map(|(_, d)| d.size).sum(),
                seconds: t.elapsed().as_secs_f64(),
            };
            files.extend(copied);
            report
        }
        (None, Some(ckpt)) => {
            let side_files = sidefiles::write_side_files(&SideFilesRequest {
                hf_dir: &c.hf_dir,
                cfg: &c.cfg,
                checkpoint: ckpt,
                context_length: c.context_length,
                rope_positions: c.inputs.rope_positions,
                model_name: &c.inputs.model_id,
                dest: root,
                repository: true,
            })?;
            let side_digests: Vec<(String, FileDigest)> = side_files
                .files
                .par_iter()
                .map(|f| {
                    let rel = f.path.to_string_lossy().into_owned();
                    Ok((rel.clone(), hashing::hash_file(&root.join(&rel))?))
                })
                .collect::<Result<_>>()?;
            files.extend(side_digests);
            side_files
        }
        (None, None) => unreachable!("check() opens the checkpoint unless --onto a release"),
    };
    files.sort_by(|a, b| hashing::cmp_components(&a.0, &b.0));
    // The held-back blobs count in their packages' trees as built.
    let mut held: Vec<(String, FileDigest)> = g
        .held_back
        .par_iter()
        .map(|(src, rel)| Ok((rel.clone(), hashing::hash_file(src)?)))
        .collect::<Result<_>>()?;
    // Each carried file as copied (or hashed, when held back) is the one
    // DIR's manifest lists: DIR cannot change between its check and the copy.
    if let Some(o) = onto {
        let sources: Vec<(&String, &PathBuf)> = g
            .carried
            .iter()
            .map(|(rel, src)| (rel, src))
            .chain(g.held_back.iter().map(|(src, rel)| (rel, src)))
            .collect();
        for (rel, src) in sources {
            if !src.starts_with(o.dir()) {
                continue;
            }
            let Some((size, sha)) = o.listed(src)? else {
                continue;
            };
            let got = files.iter().chain(&held).find(|(r, _)| r == rel);
            if let Some((_, d)) = got.filter(|(_, d)| d.size != size || d.hex() != sha) {
                bail!(
                    "{}: changed while it was copied (sha256 {}, {} lists {sha}); nothing was published",
                    src.display(),
                    d.hex(),
                    o.dir().join(MANIFEST_FILE).display()
                );
            }
        }
    }
    held.extend(g.held_known);
    let all: Vec<(String, FileDigest)> = files.iter().chain(&held).cloned().collect();
    for (n, pkg, src) in &g.pkgs {
        let (recorded, by, after) = match carried(n) {
            Some(o) => (
                o.chunk_record(n).0,
                o.dir().join(MANIFEST_FILE),
                "it was packaged",
            ),
            None => (
                build.chunk_record(n).map(|r| r.sha256_tree.clone()),
                a.build_dir.join("build.json"),
                "the build (an interrupted or edited build?)",
            ),
        };
        let want = recorded.as_deref().unwrap_or("");
        let got = tree_digest(pkg, &all);
        if !want.is_empty() && want != got {
            bail!(
                "{}: contents differ from what {} records (sha256_tree {want}, now {got}); the package changed after {after}",
                src.display(),
                by.display()
            );
        }
    }
    Ok(Staged {
        files,
        side_files,
        held,
        planned: g.planned,
        carried: g.carried.into_iter().map(|(rel, _)| rel).collect(),
        pkgs: g.pkgs,
    })
}

/// What `write_files` wrote.
struct Staged {
    /// Every file of the release so far with its digest.
    files: Vec<(String, FileDigest)>,
    side_files: SideFilesReport,
    /// The weight blobs held back (shared in from another package's), by
    /// the release path they would have, with their digests.
    held: Vec<(String, FileDigest)>,
    /// The shares of the entries the release serves.
    planned: Vec<downloader::PlannedShare>,
    /// The release paths of the files carried from `--onto`'s DIR.
    carried: Vec<String>,
    /// Each package: (name, release path, the folder it came from).
    pkgs: Vec<(String, String, PathBuf)>,
}

/// The shares of the download entries a release of `a.layout` serves.
fn planned_shares(a: &PackageRequest, build: &Build) -> Result<Vec<downloader::PlannedShare>> {
    let layouts: Vec<LayoutKind> = build
        .decode_layouts(a.layout)?
        .iter()
        .map(|l| l.kind)
        .collect();
    Ok(downloader::shares_of(&layouts))
}

pub fn package(a: &PackageRequest) -> Result<PackageReport> {
    let build = Build::load(&a.build_dir)?;
    let onto = match &a.onto {
        Some(d) => Some(Onto::open(d, &build, &onto_trust(a)?)?),
        None => None,
    };
    if let (Some(o), Some(h)) = (onto.as_ref().filter(|o| !o.compiled()), &a.hf_dir) {
        return Err(ReleaseInputError::Option {
            option: "--hf-dir",
            message: format!(
                "{}: --onto a release carries the side files and hf_model/ from {}; --hf-dir names the checkpoint only for an upstream bundle",
                h.display(),
                o.dir().display()
            ),
        }
        .into());
    }
    let build = match &onto {
        Some(o) => o.augment(&build),
        None => build,
    };
    let c = check(a, &build, onto.as_ref())?;
    // Every input read and checked: only now is anything written.
    let gathered = gather(a, &build, &c, onto.as_ref())?;
    let _lock = OutputLock::take(&a.output, a.on_locked)?;
    let staging = Staging::new(&c.inputs.parent)?;
    let root = staging.dir.join(&c.inputs.name);
    fs::create_dir(&root).with_context(|| format!("{}: cannot create", root.display()))?;
    let Staged {
        mut files,
        side_files,
        held,
        planned,
        carried,
        pkgs,
    } = write_files(a, &build, &c, gathered, &root, onto.as_ref())?;
    let Checked {
        chunks,
        audit_errors,
        audit_warnings,
        parity,
        eval,
        version,
        inputs:
            Inputs {
                key,
                model_id,
                hf_sources,
                name,
                ..
            },
        ..
    } = c;

    let inputs = ManifestInputs {
        build: &build,
        layout: a.layout,
        version: &version,
        model_id: &model_id,
        parity,
        base_url: a.base_url.as_deref(),
        compiled: &a.compiled,
    };
    let mut m = Manifest::build(&inputs)?;
    m.eval = eval;
    if let Some(o) = onto.as_ref().filter(|o| o.compiled()) {
        mark_compiled(&mut m, o, &a.compiled);
    }
    let all: Vec<(String, FileDigest)> = files.iter().chain(&held).cloned().collect();
    m.shares = check_shares(&a.build_dir, &pkgs, &m, &planned, &all)?;
    files.push(write_runbook(&root, &m)?);
    files.sort_by(|a, b| hashing::cmp_components(&a.0, &b.0));
    if let Some(base) = inputs.base_url {
        let d = Distribution::of(&files, base, &version, &model_id);
        files.push(write_json(&root, DISTRIBUTION_FILE, &d)?);
        files.sort_by(|a, b| hashing::cmp_components(&a.0, &b.0));
    }
    m.list_files(&files, inputs.base_url);
    let sizes: BTreeMap<&str, u64> = files.iter().map(|(p, d)| (p.as_str(), d.size)).collect();
    let kinds: Vec<_> = m.decode_layouts.iter().map(|l| l.kind).collect();
    for w in downloader::oversized(&kinds, &|p| sizes.get(p).copied()) {
        eprintln!("warning: {w}");
    }
    if let Some(o) = &onto {
        mark_carried(&mut m, o, &carried, &all);
    }
    let mut text = serde_json::to_string_pretty(&m)?;
    text.push('\n');
    fs::write(root.join(MANIFEST_FILE), &text)
        .with_context(|| format!("{}: cannot write", root.join(MANIFEST_FILE).display()))?;
    let manifest_digest = FileDigest {
        size: text.len() as u64,
        sha256: Sha256::digest(text.as_bytes()).into(),
    };

    let mut signed = files;
    signed.push((MANIFEST_FILE.to_string(), manifest_digest));
    let bytes: u64 = signed.iter().map(|(_, d)| d.size).sum();
    let summary = predicate_summary(&inputs, &chunks, &manifest_digest, signed.len(), bytes);
    let root_digest = sign_into(&root, &name, &key, &signed, Some(summary))?;

    let zip = match &a.zip {
        Some(z) => Some(write_zip_staged(&root, z)?),
        None => None,
    };
    // The release, its archive and the archive's digest as one publish.
    let mut moves = vec![(root, a.output.clone())];
    let zip_report = match zip {
        Some((tmp_zip, tmp_sha, digest)) => {
            let z = a.zip.as_ref().expect("zip requested");
            moves.push((tmp_zip.publishing(), z.clone()));
            moves.push((tmp_sha.publishing(), archive::digest_path(z)));
            Some((z.clone(), digest))
        }
        None => None,
    };
    staging.publish(&moves)?;
    staging.finish()?;
    Ok(PackageReport {
        files: signed.len(),
        bytes,
        root_digest,
        zip: zip_report,
        side_files,
        hf_model: hf_sources.into_iter().map(|(_, r)| r).collect(),
        audit_errors,
        audit_warnings,
    })
}

/// How `--onto`'s DIR is verified: with `--onto-public-key`, else with the
/// public key of `--key` (a release carried forward by its own signer);
/// not at all with `--allow-unverified-onto`.
fn onto_trust(a: &PackageRequest) -> Result<crate::onto::Trust> {
    use crate::onto::Trust;
    if a.allow_unverified_onto {
        return Ok(Trust::Unverified);
    }
    Ok(match &a.onto_public_key {
        Some(p) => Trust::Key {
            key: sign::load_public_key(p)?,
            from: format!("--onto-public-key {}", p.display()),
        },
        None => Trust::Key {
            key: *sign::load_private_key(&a.key)?.verifying_key(),
            from: format!(
                "the public key of --key {} (give DIR's own with --onto-public-key)",
                a.key.display()
            ),
        },
    })
}

/// Records in `m` what came from `--onto`'s release: the release, each
/// carried file, and the carried packages' digests as it recorded them.
fn mark_carried(m: &mut Manifest, o: &Onto, carried: &[String], all: &[(String, FileDigest)]) {
    m.onto = Some(o.record());
    for f in &mut m.files {
        f.carried = carried.contains(&f.path);
    }
    let blobs: Vec<(String, Option<String>)> = m
        .chunks
        .iter()
        .map(|c| (c.name.clone(), m.blob_path(&c.name)))
        .collect();
    for ch in &mut m.chunks {
        if !o.carries(&ch.name) {
            continue;
        }
        (ch.sha256_tree, ch.weight_bytes) = o.chunk_record(&ch.name);
        if o.compiled() {
            // Nothing recorded them: the package as carried.
            let blob = blobs
                .iter()
                .find(|(n, _)| *n == ch.name)
                .and_then(|(_, b)| b.as_ref());
            ch.sha256_tree = Some(tree_digest(&ch.file, all));
            ch.weight_bytes = all
                .iter()
                .find(|(p, _)| Some(p) == blob)
                .map(|(_, d)| d.size);
        }
    }
}

/// Lists the packages carried from an upstream bundle as what they are,
/// compiled, and says in `compiled.note` which ones `compile` still makes.
fn mark_compiled(m: &mut Manifest, o: &Onto, compiled: &Compiled) {
    let mut made = Vec::new();
    for ch in &mut m.chunks {
        if o.carries(&ch.name) {
            ch.file = o.release_file(&ch.name);
        } else {
            made.push(ch.name.clone());
        }
    }
    m.compiled.note = format!(
        "{} carried compiled (.mlmodelc) from an upstream bundle; {} {}: {}",
        o.packages.join(", "),
        made.join(", "),
        if made.len() == 1 {
            "is an .mlpackage"
        } else {
            "are .mlpackage"
        },
        compiled.note
    );
}

/// The manifest's share records, each checked against the build: the
/// blob the app links or copies (`from`'s) must be the package's own byte
/// for byte, or its prefill would read another program's weights. `files`
/// are every package file's digest by release path, held-back blobs
/// included.
fn check_shares(
    build_dir: &Path,
    pkgs: &[(String, String, PathBuf)],
    m: &Manifest,
    planned: &[downloader::PlannedShare],
    files: &[(String, FileDigest)],
) -> Result<Vec<WeightShare>> {
    let digest = |package: &str| {
        m.blob_path(package)
            .and_then(|p| files.iter().find(|(rel, _)| *rel == p))
            .map(|(_, d)| *d)
    };
    // Each blob where it came from: the build folder, or `--onto`'s DIR.
    let built = |package: &str| match pkgs.iter().find(|(n, _, _)| n == package) {
        Some((_, rel, src)) => src.join(downloader::blob_in(rel)),
        None => build_dir
            .join(format!("{package}.mlpackage"))
            .join(downloader::PACKAGE_BLOB),
    };
    let mut out = Vec::new();
    for s in planned {
        let (Some(own), Some(src)) = (digest(s.package), digest(s.from)) else {
            let missing = if digest(s.from).is_none() {
                s.from
            } else {
                s.package
            };
            bail!(
                "{}: missing: the app's {} download shares {}'s weight blob into {}, which needs both",
                built(missing).display(),
                s.by.iter().map(|(c, _)| c.as_str()).collect::<Vec<_>>().join(", "),
                s.from,
                s.package
            );
        };
        if own != src {
            bail!(
                "{} and {}: the weight blobs differ, but the app's downloader gives {} the blob of {} ({}); rebuild both from one conversion",
                built(s.package).display(),
                built(s.from).display(),
                s.package,
                s.from,
                s.by
                    .iter()
                    .map(|(c, how)| format!("{c}: {how}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        out.push(WeightShare {
            package: s.package.into(),
            from: s.from.into(),
            by: s
                .by
                .iter()
                .map(|&(client, how)| ShareUse { client, how })
                .collect(),
            stored: s.stored,
            size: own.size,
            sha256: own.hex(),
        });
    }
    Ok(out)
}

/// Writes `DEVICE_RUNBOOK.md` into `root`, rendered from the manifest (the
/// run book reads no file list, so the manifest before its files are listed
/// says the same); returns its path in the release and digest.
pub fn write_runbook(root: &Path, m: &Manifest) -> Result<(String, FileDigest)> {
    write_text(
        root,
        RUNBOOK_FILE,
        &runbook::render(&RunbookFacts::from_manifest(m)),
    )
}

/// Writes `value` as pretty JSON to `root/name`; returns its path in the
/// release and digest.
pub fn write_json<T: serde::Serialize>(
    root: &Path,
    name: &str,
    value: &T,
) -> Result<(String, FileDigest)> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    write_text(root, name, &text)
}

/// Writes `text` to `root/name`; returns its path in the release and digest.
fn write_text(root: &Path, name: &str, text: &str) -> Result<(String, FileDigest)> {
    let path = root.join(name);
    fs::write(&path, text).with_context(|| format!("{}: cannot write", path.display()))?;
    Ok((
        name.to_string(),
        FileDigest {
            size: text.len() as u64,
            sha256: Sha256::digest(text.as_bytes()).into(),
        },
    ))
}

/// Signs the files of `root` (already hashed) into `root/model.sig`; returns
/// the subject digest.
pub fn sign_into(
    root: &Path,
    name: &str,
    key: &p256::ecdsa::SigningKey,
    files: &[(String, FileDigest)],
    summary: Option<PredicateSummary>,
) -> Result<String> {
    let summary = summary.map(|s| (PredicateSummary::MEMBER, json!(s)));
    let st = sign::statement(name, files, &[SIG_FILE], summary);
    let bundle = sign::sign_bundle(key, &st);
    let path = root.join(SIG_FILE);
    fs::write(&path, bundle).with_context(|| format!("{}: cannot write", path.display()))?;
    Ok(sign::root_hex(files))
}

/// Writes the archive and its digest file beside their final names under
/// temporary names; they are renamed into place after the release.
/// They are removed if the run fails or is interrupted before the publish.
fn write_zip_staged(root: &Path, z: &Path) -> Result<(TempFile, TempFile, String)> {
    let (dir, fname) = split_path(z, "--zip needs a file name")?;
    fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let tmp_zip = TempFile::new(dir.join(format!(".{fname}.tmp-{}", std::process::id())));
    let tmp_sha = TempFile::new(dir.join(format!(".{fname}.sha256.tmp-{}", std::process::id())));
    let digest = archive::write(root, &tmp_zip.path, z)?;
    let bytes = fs::metadata(&tmp_zip.path).map_or(0, |m| m.len());
    let why = archive::app_route(&archive::names(&tmp_zip.path).unwrap_or_default(), bytes);
    if !why.is_empty() {
        eprintln!(
            "note: {} is the release for mirrors and `verify --archive`; the app's zip route cannot download it: {}; the app downloads a release file by file from its Hugging Face repository",
            z.display(),
            why.join("; ")
        );
    }
    fs::write(&tmp_sha.path, archive::digest_line(&digest, &fname))
        .with_context(|| format!("{}: cannot write", tmp_sha.path.display()))?;
    Ok((tmp_zip, tmp_sha, digest))
}

/// Assembles a release of arbitrary files the way `package` does (copy while
/// hashing, sign, rename into place), without a manifest: what `bench hash`
/// times against openssl and model_signing.
pub fn copy_sign_publish(src: &Path, out: &Path, key: &p256::ecdsa::SigningKey) -> Result<usize> {
    check_output(out)?;
    let (parent, name) = split_output(out)?;
    let _lock = OutputLock::take(out, OnLocked::Wait)?;
    let staging = Staging::new(&parent)?;
    let root = staging.dir.join(&name);
    fs::create_dir(&root).with_context(|| format!("{}: cannot create", root.display()))?;
    let tree = hashing::walk(src, &|r| r == SIG_FILE)?;
    tree.refuse_odd(src)?;
    let sources: Vec<(PathBuf, String)> = tree
        .files
        .iter()
        .map(|r| (src.join(r), r.clone()))
        .collect();
    let files = copy_tree(&root, &sources, &[])?;
    sign_into(&root, &name, key, &files, None)?;
    staging.publish(&[(root, out.to_path_buf())])?;
    staging.finish()?;
    Ok(files.len())
}
