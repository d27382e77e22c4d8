//! `chunkforge client-check`: the app's own download of a release folder,
//! replayed from the entries of [`crate::downloader`] (transcribed from
//! upstream's `ModelDownloader.swift`; facts in RUNTIME.md, "The
//! downloader"), and what its runtime then assumes of the folder
//! ("What the runtimes assume beyond the files"):
//!
//! - every path the entry requests, and whether a missing one aborts the
//!   whole download (everything but the 404-optional files does);
//! - the weight blobs `finishDownload` links or copies, and that each pair is
//!   the same bytes;
//! - the downloader's context check on chunk1's `model.mil`;
//! - the widths both runtime builds hard-code, and the branch's slot counts;
//! - the decode layout the runtime picks from what was downloaded (and from
//!   the sideloaded packages beside it), against the ANE layer ceiling;
//! - the multimodal files the entry requires.
//!
//! An uncompiled release (Linux) holds `.mlpackage` where the app requests
//! `.mlmodelc`: those requests are reported as needing `chunkforge compile`
//! on macOS, checked as far as the package allows (its files are there, its
//! contract's context length), and are not failures here.
//!
//! `--materialize DIR` writes the folder as it stands after the download:
//! local names, blobs linked or copied per the share map, the RoPE tables at
//! the root, plus the release's `manifest.json` (which the app does not
//! fetch) so that `chunkforge run DIR` reads the package contracts.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use serde::Serialize;

use chunkforge_model::layouts::{spec, LayoutKind, Missing, VerifyCommit, REFERENCE};
use chunkforge_model::plan::{FunctionKind, ANE_LAYER_CEILING};

use crate::bench::runtime_layout;
use crate::downloader::{self, Client, Entry, Request, ShareHow, BRANCH_KV_HEADS, BRANCH_SLOTS};
use crate::folder::ReleaseFolder;
use crate::hashing;
use crate::manifest::{self, Manifest, MANIFEST_FILE};
use crate::staging::Staging;

#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", path.display())]
pub struct ClientCheckError {
    pub path: PathBuf,
    pub message: String,
}

type Result<T, E = ClientCheckError> = std::result::Result<T, E>;

fn err(path: &Path, message: impl Into<String>) -> ClientCheckError {
    ClientCheckError {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// What to replay.
pub struct CheckOptions<'a> {
    pub release: &'a Path,
    pub client: Client,
    /// main's `gemma4DownloadMultimodal` (the branch has no toggle).
    pub multimodal: bool,
    /// Whether `.mlmodelc` can be made here (macOS): then an uncompiled
    /// release's requests are failures, not work left to do.
    pub can_compile: bool,
}

chunkforge_model::named! {
    /// What a request finds in the release.
    pub enum Status {
        /// The file is there.
        Present = "present",
        /// Missing, and a 404 on it does not abort the download.
        Optional = "optional",
        /// The release holds the `.mlpackage` this compiled file is made from:
        /// `chunkforge compile` on macOS makes it.
        NeedsCompile = "needs-compile",
        /// Missing: the app's download aborts on it.
        Missing = "missing",
    }
}

chunkforge_model::named! {
    /// What a problem is about.
    pub enum ProblemKind {
        /// A request the download aborts on.
        Request = "request",
        /// A blob `finishDownload` links or copies.
        Share = "share",
        /// The downloader's and the runtime's context length check.
        Context = "context",
        /// A width the runtime hard-codes.
        Width = "width",
        /// The branch's hard-coded slot counts and KV heads.
        Slots = "slots",
        /// A side file's contents.
        SideFile = "side-file",
        /// The layout the runtime picks cannot load.
        Layout = "layout",
        /// An output the runtime reads from `verify_qK` is missing.
        Verify = "verify",
        /// The download's bytes pass main's safety stop.
        Size = "size",
    }
}

/// One request and what it finds.
#[derive(Clone, Debug, Serialize)]
pub struct RequestResult {
    pub remote: String,
    pub local: String,
    pub status: Status,
    /// Why, when not present.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub why: String,
}

/// Something that makes the download abort or the load fail, naming the
/// files involved (release paths).
#[derive(Clone, Debug, Serialize)]
pub struct Problem {
    pub kind: ProblemKind,
    pub files: Vec<String>,
    pub message: String,
}

/// The decode layout the runtime picks.
#[derive(Clone, Debug, Serialize)]
pub struct Pick {
    /// From what the entry downloads.
    pub downloaded: LayoutKind,
    /// With the release's sideloaded packages (`merged_*`) copied beside it,
    /// when that changes the pick.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub with_sideloaded: Option<LayoutKind>,
}

/// `client-check`'s report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub release: String,
    pub client: Client,
    pub model_id: &'static str,
    pub compiled: bool,
    pub multimodal: bool,
    pub requests: Vec<RequestResult>,
    pub problems: Vec<Problem>,
    pub pick: Option<Pick>,
    /// The bytes the download fetches (a file to be compiled counted by its
    /// blob's size, its small files by the app's estimate).
    pub download_bytes: u64,
    /// The sum of the list's `estimatedSize`.
    pub estimated_bytes: u64,
    /// Where main's safety stop aborts it (None: the branch has none).
    pub abort_limit: Option<u64>,
    /// What the replay could not check here, and other facts for the user.
    pub notes: Vec<String>,
}

impl Report {
    /// The download completes and the runtime loads what it downloaded
    /// (work left to `chunkforge compile` aside).
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// The download aborts (a required request is missing).
    pub fn aborts(&self) -> bool {
        self.requests.iter().any(|r| r.status == Status::Missing)
    }

    pub fn needs_compile(&self) -> Vec<&RequestResult> {
        self.requests
            .iter()
            .filter(|r| r.status == Status::NeedsCompile)
            .collect()
    }
}

/// The release being checked.
struct Release<'a> {
    dir: &'a Path,
    manifest: Manifest,
    compiled: bool,
}

impl Release<'_> {
    /// Package `name`'s folder in the release, as the manifest lists it.
    fn package(&self, name: &str) -> String {
        self.manifest.chunk(name).map_or_else(
            || manifest::package_file(name, self.compiled),
            |c| c.file.clone(),
        )
    }

    fn exists(&self, rel: &str) -> bool {
        self.dir.join(rel).is_file()
    }

    /// The weight blob of package `name` in the release.
    fn blob(&self, name: &str) -> String {
        let p = self.package(name);
        format!("{p}/{}", downloader::blob_in(&p))
    }
}

/// Replays `o.client`'s download of `o.release`.
pub fn check(o: &CheckOptions) -> Result<Report> {
    let dir = o.release;
    if !dir.is_dir() {
        return Err(err(dir, "not a release folder (no such folder)"));
    }
    let manifest_path = dir.join(MANIFEST_FILE);
    let manifest = Manifest::load(&manifest_path).map_err(|e| err(&manifest_path, e))?;
    let compiled = manifest.compiled.mlmodelc;
    let r = Release {
        dir,
        manifest,
        compiled,
    };
    let entry = downloader::entry(o.client);
    let mut notes = Vec::new();
    if !o.multimodal && !entry.multimodal_toggle {
        notes.push(format!(
            "--multimodal off: the {} entry has no such toggle; it always fetches the multimodal files",
            entry.client
        ));
    }
    let requests: Vec<RequestResult> = entry
        .requests(o.multimodal)
        .iter()
        .map(|q| request(&r, entry, q, o))
        .collect();
    let mut problems: Vec<Problem> = requests
        .iter()
        .filter(|q| q.status == Status::Missing)
        .map(|q| Problem {
            kind: ProblemKind::Request,
            files: vec![q.remote.clone()],
            message: q.why.clone(),
        })
        .collect();
    problems.extend(shares(&r, entry));
    let downloaded: BTreeSet<&str> = entry
        .whole
        .iter()
        .chain(entry.meta_only)
        .copied()
        .filter(|p| {
            let files: Vec<_> = requests
                .iter()
                .zip(entry.requests(o.multimodal))
                .filter(|(_, q)| q.package == Some(*p))
                .collect();
            files.iter().all(|(res, _)| res.status != Status::Missing)
                && files
                    .iter()
                    .any(|(res, _)| matches!(res.status, Status::Present | Status::NeedsCompile))
        })
        .collect();
    let pick = pick(&r, entry, &downloaded, &mut problems, &mut notes);
    // The folder's contents, as far as they can be read.
    match ReleaseFolder::open(dir) {
        Ok(folder) => {
            if let Err(e) = folder.check_files() {
                problems.push(Problem {
                    kind: ProblemKind::SideFile,
                    files: vec![rel(dir, &e.path)],
                    message: e.message,
                });
            }
            context(&r, folder.context_length, &mut problems, &mut notes);
        }
        Err(e) => problems.push(Problem {
            kind: ProblemKind::SideFile,
            files: vec![rel(dir, &e.path)],
            message: e.message,
        }),
    }
    widths(&r, entry, &pick, &mut problems);
    verify(&r, entry, &mut problems, &mut notes);
    let multimodal = o.multimodal || !entry.multimodal_toggle;
    let download_bytes = size(&r, entry, multimodal, &mut problems, &mut notes);
    if !requests.iter().any(|q| q.status == Status::NeedsCompile) && !compiled {
        notes.push("no package is compiled and none is requested".into());
    }
    if requests.iter().any(|q| q.status == Status::NeedsCompile) {
        notes.push(
            "the .mlmodelc requests need `chunkforge compile RELEASE --key K`; this replay checks the .mlpackage each is made from"
                .into(),
        );
    }
    if compiled && !r.manifest.compiled.device_verified {
        notes.push(format!(
            "the .mlmodelc requests count as present: compiled by {}; no device has loaded them yet (manifest.json compiled.device_verified: false; DEVICE_RUNBOOK.md's first step loads every function on the phone)",
            r.manifest.compiled.by.as_deref().unwrap_or("an unrecorded compiler")
        ));
    }
    notes.push(
        "not checked here: that Core ML on the device compiles and loads the packages within memory, and their speed (DEVICE_RUNBOOK.md)"
            .into(),
    );
    Ok(Report {
        release: dir.display().to_string(),
        client: o.client,
        model_id: entry.model_id,
        compiled,
        multimodal,
        requests,
        problems,
        pick,
        download_bytes,
        estimated_bytes: entry.estimate(multimodal),
        abort_limit: entry.abort_limit(multimodal),
        notes,
    })
}

/// The bytes the entry's download fetches from the release
/// ([`Entry::fetched_bytes`]), against main's safety stop (1.5 x its list's
/// `estimatedSize`).
fn size(
    r: &Release,
    entry: &Entry,
    multimodal: bool,
    problems: &mut Vec<Problem>,
    notes: &mut Vec<String>,
) -> u64 {
    let len = |rel: &str| {
        fs::metadata(r.dir.join(rel))
            .ok()
            .filter(|m| m.is_file())
            .map(|m| m.len())
    };
    let (total, estimated) = entry.fetched_bytes(multimodal, &len);
    let Some(limit) = entry.abort_limit(multimodal) else {
        notes.push(format!(
            "the download fetches {total} bytes; the {} entry has no size stop",
            entry.client
        ));
        return total;
    };
    let how = if estimated > 0 {
        format!(" ({estimated} files to be compiled counted at the app's estimate)")
    } else {
        String::new()
    };
    if total <= limit {
        notes.push(format!(
            "the download fetches {total} bytes{how}, within main's stop at {limit} ({} x the list's estimatedSize)",
            downloader::ABORT_OVER_ESTIMATE
        ));
        return total;
    }
    let mut sizes: Vec<(String, u64)> = entry
        .requests(multimodal)
        .into_iter()
        .filter_map(|q| len(&q.remote).map(|n| (q.remote, n)))
        .collect();
    sizes.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    sizes.truncate(3);
    problems.push(Problem {
        kind: ProblemKind::Size,
        files: sizes.iter().map(|(f, _)| f.clone()).collect(),
        message: format!(
            "the download fetches {total} bytes{how}, over {limit}: main aborts a download once its bytes pass {} x its list's estimatedSize sum ({} bytes), \"exceeds expected by 50%+\" (ModelDownloader.swift at 72178c6, updateProgress); the largest files: {}",
            downloader::ABORT_OVER_ESTIMATE,
            entry.estimate(multimodal),
            sizes
                .iter()
                .map(|(f, b)| format!("{f} ({b} bytes)"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    });
    total
}

/// `path` relative to `dir`, for a report.
fn rel(dir: &Path, path: &Path) -> String {
    path.strip_prefix(dir)
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

/// What request `q` finds in the release.
fn request(r: &Release, entry: &Entry, q: &Request, o: &CheckOptions) -> RequestResult {
    let result = |status: Status, why: String| RequestResult {
        remote: q.remote.clone(),
        local: q.local.clone(),
        status,
        why,
    };
    if r.exists(&q.remote) {
        return result(Status::Present, String::new());
    }
    let optional = entry.optional_404(&q.local);
    // A compiled package's file, of a package the release holds uncompiled.
    let uncompiled = |p: &&str| !r.compiled && !r.package(p).ends_with(".mlmodelc");
    if let Some(package) = q.package.filter(uncompiled) {
        let pkg = manifest::package_file(package, false);
        let inner = q.remote.split_once(".mlmodelc/").map_or("", |(_, f)| f);
        let source = if inner == downloader::COMPILED_BLOB {
            format!("{pkg}/{}", downloader::PACKAGE_BLOB)
        } else {
            format!("{pkg}/Data/com.apple.CoreML/model.mlmodel")
        };
        if r.exists(&source) {
            return if o.can_compile {
                result(
                    Status::Missing,
                    format!("the release is not compiled: run `chunkforge compile` (it makes this from {source})"),
                )
            } else {
                result(
                    Status::NeedsCompile,
                    format!("needs `chunkforge compile RELEASE --key K` (made from {source})"),
                )
            };
        }
        if optional {
            return result(
                Status::Optional,
                "missing; a 404 on it does not abort the download".into(),
            );
        }
        return result(
            Status::Missing,
            format!("missing, and so is {source} it would be compiled from: the download aborts"),
        );
    }
    if optional {
        return result(
            Status::Optional,
            "missing; a 404 on it does not abort the download".into(),
        );
    }
    let why = match q.encoder {
        Some(e) if entry.multimodal_toggle => format!(
            "missing ({} encoder file): the download aborts; `package --encoders-from BUNDLE` carries an existing bundle's encoders, or the user turns `gemma4DownloadMultimodal` off (--multimodal off)",
            e.role
        ),
        Some(e) => format!(
            "missing ({} encoder file): the download aborts, and the {} entry cannot skip encoders; `package --encoders-from BUNDLE` carries an existing bundle's",
            e.role, entry.client
        ),
        None => "missing: the download aborts on it".into(),
    };
    result(Status::Missing, why)
}

/// The entry's shares: each source blob is there, and is the blob the
/// receiving package was built with (its own copy in the release, or the
/// manifest's record of it).
fn shares(r: &Release, entry: &Entry) -> Vec<Problem> {
    let mut out = Vec::new();
    let how = match entry.how {
        ShareHow::Link => "hard-links",
        ShareHow::Copy => "copies",
    };
    for &(package, from) in entry.shares {
        let (to_blob, from_blob) = (r.blob(package), r.blob(from));
        let mut problem = |message: String| {
            out.push(Problem {
                kind: ProblemKind::Share,
                files: vec![from_blob.clone(), to_blob.clone()],
                message,
            })
        };
        if !r.exists(&from_blob) {
            problem(format!(
                "{from_blob} is missing: the {} download {how} it into {package} ({to_blob}), which has no weights without it",
                entry.client
            ));
            continue;
        }
        let digest = |rel: &str| hashing::sha256_file(&r.dir.join(rel)).ok();
        let got = digest(&from_blob);
        if r.exists(&to_blob) {
            if got != digest(&to_blob) {
                problem(format!(
                    "{from_blob} and {to_blob} differ: the {} download {how} the first over the second, so {package} would run another program's weights",
                    entry.client
                ));
            }
            continue;
        }
        let record = r
            .manifest
            .shares
            .iter()
            .find(|s| s.package == package && s.from == from);
        match record {
            Some(s) if got.as_deref() != Some(s.sha256.as_str()) => problem(format!(
                "{from_blob} is not the blob {package} ({to_blob}) was built with (manifest.json shares: sha256 {}): the {} download {how} it in, so {package} would run other weights",
                s.sha256, entry.client
            )),
            Some(_) => {}
            None => problem(format!(
                "manifest.json records no share of {from}'s blob into {package}: nothing says the {} download's {how} gives {package} its own weights",
                entry.client
            )),
        }
    }
    out
}

/// The layout the entry's runtime picks from what it downloaded (and with
/// the sideloaded packages the release holds), checked for loading.
fn pick(
    r: &Release,
    entry: &Entry,
    downloaded: &BTreeSet<&str>,
    problems: &mut Vec<Problem>,
    notes: &mut Vec<String>,
) -> Option<Pick> {
    let got = runtime_layout::pick_for(entry.runtime, |p| downloaded.contains(p));
    let decode = spec(got).decode_packages();
    let absent: Vec<&String> = decode
        .iter()
        .filter(|p| !downloaded.contains(p.as_str()))
        .collect();
    if !absent.is_empty() {
        problems.push(Problem {
            kind: ProblemKind::Layout,
            files: absent.iter().map(|p| r.package(p)).collect(),
            message: format!(
                "the runtime picks the {got} layout from the download but does not get {}: loading fails",
                absent.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
            ),
        });
    }
    let over = |kind: LayoutKind| {
        spec(kind).decode_packages().iter().any(|p| {
            r.manifest
                .chunk(p)
                .is_some_and(|c| c.layers() > ANE_LAYER_CEILING)
        })
    };
    if over(got) {
        problems.push(Problem {
            kind: ProblemKind::Layout,
            files: decode.iter().map(|p| r.package(p)).collect(),
            message: format!(
                "the runtime picks the {got} layout, whose function holds more than {ANE_LAYER_CEILING} layers: past what the Neural Engine was seen to compile"
            ),
        });
    }
    // The packages no entry fetches, kept in the release for sideloading.
    let sideloaded: Vec<&str> = r
        .manifest
        .chunks
        .iter()
        .map(|c| c.name.as_str())
        .filter(|n| {
            !downloader::ENTRIES
                .iter()
                .any(|e| e.whole.contains(n) || e.meta_only.contains(n))
        })
        .collect();
    let with = runtime_layout::pick_for(entry.runtime, |p| {
        downloaded.contains(p) || sideloaded.contains(&p)
    });
    notes.push(format!(
        "{} picks the {got} layout from this download",
        entry.runtime.describe()
    ));
    let with_sideloaded = (with != got).then_some(with);
    if let Some(w) = with_sideloaded {
        notes.push(format!(
            "with the release's sideloaded {} copied into the model folder it picks {w}{}",
            sideloaded.join(", "),
            if over(w) {
                format!(
                    ", over the ANE layer ceiling ({ANE_LAYER_CEILING}): do not sideload {}",
                    spec(w).decode_packages().join(", ")
                )
            } else {
                String::new()
            }
        ));
    }
    Some(Pick {
        downloaded: got,
        with_sideloaded,
    })
}

/// The downloader's context check: chunk1's `model.mil` declares
/// `tensor<fp16, [1, 1, 1, N]> causal_mask_full`, N must be
/// `model_config.json`'s `context_length` (else it deletes the folder). On
/// an uncompiled release, chunk1's contract in the manifest stands in.
fn context(r: &Release, ctx: usize, problems: &mut Vec<Problem>, notes: &mut Vec<String>) {
    let first = spec(crate::downloader::entry(Client::Main).layout)
        .package_names()
        .into_iter()
        .next()
        .unwrap_or_default();
    let config = crate::sidefiles::MODEL_CONFIG.to_string();
    let mil = format!("{}/model.mil", manifest::package_file(&first, true));
    let mut problem = |file: String, message: String| {
        problems.push(Problem {
            kind: ProblemKind::Context,
            files: vec![config.clone(), file],
            message,
        })
    };
    if r.exists(&mil) {
        let bytes = fs::read(r.dir.join(&mil)).unwrap_or_default();
        match std::str::from_utf8(&bytes) {
            Err(_) => problem(
                mil.clone(),
                "not UTF-8 text (a binary model.mil, as `xcrun coremlcompiler` writes): the iPhone rejects it and the downloader's context check cannot read it; compile with `chunkforge compile`".into(),
            ),
            Ok(text) => match mil_context(text) {
                None => problem(
                    mil.clone(),
                    "declares no `tensor<fp16, [1, 1, 1, N]> causal_mask_full`: the downloader cannot check the context length, and the runtime's load check fails".into(),
                ),
                Some(n) if n != ctx => problem(
                    mil.clone(),
                    format!("causal_mask_full is {n} wide, model_config.json's context_length is {ctx}: the downloader deletes the folder"),
                ),
                Some(_) => {}
            },
        }
        return;
    }
    let width = r.manifest.chunk(&first).and_then(|c| {
        c.inputs
            .iter()
            .find(|t| t.name == "causal_mask_full")
            .and_then(|t| t.shape.last().copied())
    });
    let pkg = r.package(&first);
    match width {
        Some(n) if n != ctx => problem(
            pkg,
            format!("{first}'s causal_mask_full is {n} wide (manifest.json's contract), model_config.json's context_length is {ctx}: the compiled model.mil would disagree and the downloader deletes the folder"),
        ),
        Some(_) => notes.push(format!(
            "context_length {ctx} agrees with {first}'s causal_mask_full in manifest.json; the downloader's own check reads {mil}, which `chunkforge compile` writes and checks"
        )),
        None => problem(pkg, format!("manifest.json states no causal_mask_full input of {first}")),
    }
}

/// The downloader's context pattern (ModelDownloader.swift,
/// `isChunkCtxMismatched`, main 72178c6 and the branch 4cd6c6c):
/// `tensor<fp16,\s*\[\s*1,\s*1,\s*1,\s*(\d+)\s*\]>\s*causal_mask_full`
/// as NSRegularExpression (ICU) reads it: `\s` is ICU's white space
/// `[\t\n\f\r\p{Z}]` (not vertical tab or NEL, which Rust's `\s` takes) and
/// `\d` any decimal digit `\p{Nd}`. No space is allowed inside `tensor<fp16,`,
/// before a comma or between `]` and `>`.
const CONTEXT_PATTERN: &str = concat!(
    r"tensor<fp16,[\t\n\f\r\p{Z}]*\[[\t\n\f\r\p{Z}]*1,[\t\n\f\r\p{Z}]*1,",
    r"[\t\n\f\r\p{Z}]*1,[\t\n\f\r\p{Z}]*(\p{Nd}+)[\t\n\f\r\p{Z}]*\]>[\t\n\f\r\p{Z}]*causal_mask_full"
);

/// N of the downloader's context check on chunk1's MIL text: its pattern's
/// first match, its digits read as Swift's `Int(_:)` reads them (ASCII, 64
/// bits). None where the downloader finds no N: no match, or a first match
/// whose digits `Int` refuses (other scripts' digits, too large); it then
/// leaves the folder alone.
pub fn mil_context(text: &str) -> Option<usize> {
    static PATTERN: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(CONTEXT_PATTERN).expect("the downloader's pattern compiles")
    });
    let digits = PATTERN.captures(text)?.get(1)?.as_str();
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits
        .parse::<i64>()
        .ok()
        .and_then(|n| usize::try_from(n).ok())
}

/// The widths the runtime hard-codes, and on the branch its slot counts.
fn widths(r: &Release, entry: &Entry, pick: &Option<Pick>, problems: &mut Vec<Problem>) {
    let d = &r.manifest.dims;
    let config = format!("{}/config.json", crate::paths::HF_MODEL_DIR);
    let rope = |names: [&str; 2]| -> Vec<String> {
        let mut v = vec![config.clone()];
        v.extend(names.iter().map(|n| format!("swa/{n}")));
        v
    };
    let mut width = |files: Vec<String>, message: String| {
        problems.push(Problem {
            kind: ProblemKind::Width,
            files,
            message,
        })
    };
    if d.max_head_dim != downloader::KV_WIDTH {
        width(
            vec![config.clone()],
            format!(
                "the KV caches are {} wide (the larger head dim); the runtime allocates them {} wide (maxHd) and feeds them as K/V inputs: the prediction fails",
                d.max_head_dim,
                downloader::KV_WIDTH
            ),
        );
    }
    if d.head_dim_sliding != downloader::ROPE_SLIDING {
        width(
            rope([crate::sidefiles::COS_SLIDING, crate::sidefiles::SIN_SLIDING]),
            format!(
                "sliding layers' head dim is {}; the runtime reads {} RoPE values a row for them (and verify's slidingHd): the tables are misread and the cos_s/sin_s inputs have the wrong shape",
                d.head_dim_sliding,
                downloader::ROPE_SLIDING
            ),
        );
    }
    if d.head_dim_full != downloader::ROPE_FULL {
        width(
            rope([crate::sidefiles::COS_FULL, crate::sidefiles::SIN_FULL]),
            format!(
                "full layers' head dim is {}; the runtime reads {} RoPE values a row for them: the tables are misread and the cos_f/sin_f inputs have the wrong shape",
                d.head_dim_full,
                downloader::ROPE_FULL
            ),
        );
    }
    if entry.client != Client::Branch {
        return;
    }
    for heads in [d.num_kv_heads_sliding, d.num_kv_heads_full] {
        if heads != BRANCH_KV_HEADS {
            problems.push(Problem {
                kind: ProblemKind::Slots,
                files: vec![config.clone()],
                message: format!(
                    "{heads} KV heads; the branch's runtime allocates its KV buffers for {BRANCH_KV_HEADS}"
                ),
            });
            break;
        }
    }
    let mut layouts: Vec<LayoutKind> = Vec::new();
    if let Some(p) = pick {
        layouts.push(p.downloaded);
        layouts.extend(p.with_sideloaded);
    }
    for kind in layouts {
        for p in spec(kind).decode_packages() {
            let Some(&(_, sliding, full)) = BRANCH_SLOTS.iter().find(|(n, _, _)| *n == p) else {
                continue;
            };
            let Some(c) = r.manifest.chunk(&p) else {
                continue;
            };
            let got = (c.sliding_slots.len(), c.full_slots.len());
            if got != (sliding, full) {
                problems.push(Problem {
                    kind: ProblemKind::Slots,
                    files: vec![r.package(&p)],
                    message: format!(
                        "{p} has {} sliding / {} full KV slots; the branch's runtime hard-codes {sliding} / {full}",
                        got.0, got.1
                    ),
                });
            }
        }
    }
}

/// The outputs the entry's runtime reads from the reference's `verify_qK`
/// (main: the new rows; the branch: the write-through caches, force-unwrapped),
/// in the contracts `manifest.json` records.
fn verify(r: &Release, entry: &Entry, problems: &mut Vec<Problem>, notes: &mut Vec<String>) {
    let names = spec(REFERENCE).package_names();
    let contract = entry.runtime.verify();
    let has_verify = |name: &str| {
        r.manifest
            .chunk(name)
            .is_some_and(|c| c.functions.iter().any(|f| f.kind == FunctionKind::Verify))
    };
    if !names.iter().all(|n| has_verify(n)) {
        notes.push(format!(
            "{} hold no verify_qK: the runtime loads no verify functions and decodes without speculation",
            spec(REFERENCE).range()
        ));
        return;
    }
    if !names
        .iter()
        .all(|n| entry.whole.contains(&n.as_str()) || entry.meta_only.contains(&n.as_str()))
    {
        notes.push(format!(
            "the {} download does not fetch all of {}: the runtime finds no verify functions to load and decodes without speculation",
            entry.client,
            spec(REFERENCE).range()
        ));
        return;
    }
    let before = problems.len();
    for read in contract.reads {
        let Some(name) = names.get(read.chunk) else {
            continue;
        };
        let Some(c) = r.manifest.chunk(name) else {
            continue;
        };
        let found = c
            .functions
            .iter()
            .filter(|f| f.kind == FunctionKind::Verify)
            .any(|f| f.outputs.iter().any(|t| t.name == read.output));
        if found {
            continue;
        }
        problems.push(Problem {
            kind: ProblemKind::Verify,
            files: vec![r.package(name)],
            message: format!(
                "{name}'s verify_qK returns no {}, which {} reads ({}; it loads verify {}): {}",
                read.output,
                entry.runtime.describe(),
                contract.source,
                contract.loaded,
                match read.missing {
                    Missing::Crashes => "read force-unwrapped, so the app crashes on the first verify call",
                    Missing::SkipsCommit => "read as an optional, so its commit is skipped and decode goes on without the verified rows",
                }
            ),
        });
    }
    if problems.len() == before {
        notes.push(format!(
            "verify_qK: {} loads it {} and commits {}; every output it reads is there",
            entry.runtime.describe(),
            contract.loaded,
            match contract.commit {
                VerifyCommit::AcceptedRows => "the accepted rows (new_K/V_*)",
                VerifyCommit::WriteThrough =>
                    "write-through (the whole K/V_*_out caches after every call)",
            }
        ));
    }
}

/// Writes the model folder as it stands after `report`'s download into
/// `out` (which must not exist): every present request under its local name
/// (an uncompiled package as `.mlpackage` under its local name), the shares
/// linked or copied as the entry does, and the release's `manifest.json`.
/// Written beside `out` and renamed when complete.
pub fn materialize(report: &Report, out: &Path) -> Result<()> {
    if report.aborts() {
        return Err(err(
            out,
            "not written: the app's download of this release aborts (see the missing requests)",
        ));
    }
    if fs::symlink_metadata(out).is_ok() {
        return Err(err(
            out,
            "already exists: --materialize writes a new folder",
        ));
    }
    let dir = Path::new(&report.release);
    // Written into the release (directly or through a symlink), the folder
    // would change the release, which then no longer verifies.
    if crate::paths::inside(out, dir) {
        return Err(err(
            out,
            format!(
                "inside the release {} (once resolved): --materialize writes a folder outside it, which it leaves as it was",
                dir.display()
            ),
        ));
    }
    // Read only where nothing leads out of the release.
    crate::folder::refuse_links(dir).map_err(|e| err(&e.path, e.message))?;
    let entry = downloader::entry(report.client);
    let name = out
        .file_name()
        .filter(|n| *n != "..")
        .ok_or_else(|| err(out, "not a folder path"))?
        .to_string_lossy()
        .into_owned();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    remove_old_partials(&parent, &name);
    // A staging folder beside `out`: removed by Ctrl-C, and by the next run
    // in that folder after a kill.
    let staging = Staging::new(&parent).map_err(|e| err(&parent, format!("{e:#}")))?;
    let tmp = staging.dir.join(&name);
    let written = (|| -> Result<()> {
        fs::create_dir(&tmp).map_err(|e| err(&tmp, format!("cannot create: {e}")))?;
        let copy = |from: &Path, to: &Path| -> Result<()> {
            if let Some(p) = to.parent() {
                folders_under(&tmp, p)?;
            }
            crate::publish::test_pause("copy");
            fs::copy(from, to)
                .map(|_| ())
                .map_err(|e| err(from, format!("cannot copy to {}: {e}", to.display())))
        };
        let manifest = Manifest::load(&dir.join(MANIFEST_FILE))
            .map_err(|e| err(&dir.join(MANIFEST_FILE), e))?;
        let compiled = manifest.compiled.mlmodelc;
        let mut packages_done: BTreeSet<&str> = BTreeSet::new();
        for (q, res) in entry
            .requests(report.multimodal)
            .iter()
            .zip(&report.requests)
        {
            match (q.package, res.status) {
                (_, Status::Missing | Status::Optional) => {}
                // An uncompiled package: the .mlpackage under its local
                // name, without its blob when fetched without weights/.
                (Some(p), Status::NeedsCompile) => {
                    if packages_done.insert(p) {
                        let src = dir.join(manifest::package_file(p, false));
                        let dst = tmp.join(format!("{p}.mlpackage"));
                        let skip_blob = entry.meta_only.contains(&p);
                        copy_tree(&src, &dst, &|rel| {
                            skip_blob && rel == downloader::PACKAGE_BLOB
                        })?;
                    }
                }
                _ => copy(&dir.join(&q.remote), &tmp.join(&q.local))?,
            }
        }
        // finishDownload's shares: only where the package arrived and its
        // blob did not.
        // Each package as it arrived: compiled, or (not yet) an .mlpackage.
        let local = |p: &str| {
            let c = tmp.join(format!("{p}.mlmodelc"));
            if compiled || c.is_dir() {
                c
            } else {
                tmp.join(format!("{p}.mlpackage"))
            }
        };
        for &(package, from) in entry.shares {
            let pkg = local(package);
            let to = pkg.join(downloader::blob_in(&pkg.to_string_lossy()));
            let src = local(from);
            let src = src.join(downloader::blob_in(&src.to_string_lossy()));
            if !pkg.is_dir() || to.exists() || !src.is_file() {
                continue;
            }
            if let Some(p) = to.parent() {
                folders_under(&tmp, p)?;
            }
            match entry.how {
                // A copy where the file system cannot link, as the app does.
                ShareHow::Link => {
                    if fs::hard_link(&src, &to).is_err() {
                        copy(&src, &to)?;
                    }
                }
                ShareHow::Copy => copy(&src, &to)?,
            }
        }
        copy(&dir.join(MANIFEST_FILE), &tmp.join(MANIFEST_FILE))?;
        if fs::symlink_metadata(out).is_ok() {
            return Err(err(out, "appeared while it was written: not replaced"));
        }
        staging
            .publish(&[(tmp.clone(), out.to_path_buf())])
            .map_err(|e| err(out, format!("{e:#}")))
    })();
    written?;
    staging.finish().map_err(|e| err(out, format!("{e:#}")))
}

/// Makes the folders of `path` below `root`, which must exist: never
/// `root` itself, so nothing is made again in a staging folder that Ctrl-C
/// removed (and no copy starts once Ctrl-C is being handled).
fn folders_under(root: &Path, path: &Path) -> Result<()> {
    crate::staging::stop_if_interrupted();
    let rest = path.strip_prefix(root).unwrap_or(path);
    let mut at = root.to_path_buf();
    for c in rest.components() {
        at.push(c);
        match fs::create_dir(&at) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(err(&at, format!("cannot create: {e}")))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Removes the `.NAME.partial-PID` folders an older chunkforge's
/// `--materialize` into `parent/NAME` left when it was killed (its pid is
/// gone).
fn remove_old_partials(parent: &Path, name: &str) {
    let prefix = format!(".{name}.partial-");
    for e in fs::read_dir(parent).into_iter().flatten().flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = file
            .strip_prefix(&prefix)
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// Copies the tree `from` to `to`, leaving out the files whose path relative
/// to `from` `skip` names.
fn copy_tree(from: &Path, to: &Path, skip: &dyn Fn(&str) -> bool) -> Result<()> {
    let tree = hashing::walk(from, &|_| false)
        .map_err(|e| err(&e.path, format!("cannot list: {}", e.source)))?;
    tree.refuse_odd(from)
        .map_err(|e| err(&e.path, e.source.to_string()))?;
    for f in &tree.files {
        crate::staging::stop_if_interrupted();
        if skip(f) {
            continue;
        }
        let dst = to.join(f);
        if let Some(p) = dst.parent() {
            folders_under(to.parent().unwrap_or(to), p)?;
        }
        fs::copy(from.join(f), &dst)
            .map_err(|e| err(&from.join(f), format!("cannot copy: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mil_context_reads_the_downloaders_pattern() {
        let mil = "func main<ios18>(tensor<fp16, [1, 1, 64]> hidden_states, tensor<fp16, [1, 1, 1, 2048]> causal_mask_full, tensor<fp16, [1, 1, 1, 512]> causal_mask_sliding)";
        assert_eq!(mil_context(mil), Some(2048));
        // Where the Swift regex allows white space, ICU's kinds of it.
        assert_eq!(
            mil_context(
                "tensor<fp16,\t[\n1,\u{a0}1,\u{2028}1,\r8192\u{3000}]>\x0c causal_mask_full"
            ),
            Some(8192)
        );
        // Where it does not: a space before a comma, between `]` and `>`,
        // inside `tensor<fp16,`; and kinds of white space ICU's \s lacks
        // (vertical tab, NEL) where it allows some.
        for negative in [
            "tensor<fp16,[ 1,1 ,1, 8192 ] >  causal_mask_full",
            "tensor<fp16, [1, 1, 1, 8192] > causal_mask_full",
            "tensor<fp16, [1 , 1, 1, 8192]> causal_mask_full",
            "tensor< fp16, [1, 1, 1, 8192]> causal_mask_full",
            "tensor<fp16 , [1, 1, 1, 8192]> causal_mask_full",
            "tensor<fp16,\x0b[1, 1, 1, 8192]> causal_mask_full",
            "tensor<fp16, [1, 1, 1, 8192]>\u{85}causal_mask_full",
        ] {
            assert_eq!(mil_context(negative), None, "{negative:?}");
        }
        // A first match whose digits Swift's Int() refuses: no N at all,
        // even with a readable match after it.
        assert_eq!(
            mil_context("tensor<fp16, [1, 1, 1, \u{664}\u{660}]> causal_mask_full tensor<fp16, [1, 1, 1, 40]> causal_mask_full"),
            None
        );
        assert_eq!(
            mil_context("tensor<fp16, [1, 1, 1, 99999999999999999999]> causal_mask_full"),
            None
        );
        // Another shape or dtype is not the pattern; a later match is read.
        assert_eq!(
            mil_context("tensor<fp32, [1, 1, 1, 2048]> causal_mask_full"),
            None
        );
        assert_eq!(
            mil_context("tensor<fp16, [1, 1, 4, 2048]> causal_mask_full; tensor<fp16, [1, 1, 1, 1024]> causal_mask_full"),
            Some(1024)
        );
        assert_eq!(mil_context("causal_mask_full"), None);
    }
}
