//! The app's download entries for a Gemma 4 model folder, as data
//! transcribed from upstream's `ModelDownloader.swift` (the revisions in
//! [`UPSTREAM`]; the facts are in RUNTIME.md, "The downloader"): which
//! packages each entry fetches with their weight blob and which without, and
//! the blobs its `finishDownload` then links or copies from one package into
//! another, and the multimodal encoder files it fetches beside them. No code
//! is copied.
//!
//! A release folder is the repository the app downloads from, so these rows
//! decide which blobs a release must hold (`package`), which pairs must be
//! byte-identical (`package`, `verify`) and where a package's blob comes
//! from when `run` loads it the way the app does.

use chunkforge_model::layouts::{LayoutKind, Runtime, REFERENCE};

/// The upstream revisions the rows were read from: (branch, commit).
pub const UPSTREAM: &[(&str, &str)] = &[
    ("main", "72178c6"),
    ("fix/2chunk-kv-prefill-transfer", "4cd6c6c"),
];

chunkforge_model::named! {
    /// A download entry of the app (a `ModelInfo` and its file list).
    pub enum Client {
        /// Main, `gemma4-e2b`: the legacy four-chunk entry.
        Main = "main",
        /// Main, `gemma4-e2b-3way`: the three-chunk entry (main's default).
        Main3Way = "main-3way",
        /// Branch `fix/2chunk-kv-prefill-transfer`, `gemma4-e2b`.
        Branch = "branch",
    }
}

chunkforge_model::named! {
    /// The app's runtime builds, as `run --runtime` names them.
    pub enum RuntimeBuild {
        /// The upstream main branch: chunk1 + chunk2_3way + chunk3_3way when both
        /// 3-way packages are there, else chunk1..4.
        Main = "main",
        /// Branch fix/2chunk-kv-prefill-transfer: merged_full, else merged_chunk1 +
        /// merged_chunk2, else chunk1..4.
        Branch = "branch",
    }
}

impl RuntimeBuild {
    pub fn runtime(self) -> Runtime {
        match self {
            RuntimeBuild::Main => Runtime::Main,
            RuntimeBuild::Branch => Runtime::Merged,
        }
    }
}

chunkforge_model::named! {
    /// How `finishDownload` gives a package another package's blob.
    pub enum ShareHow {
        /// A hard link (main; a copy where the file system cannot link).
        Link = "link",
        /// A copy (the branch).
        Copy = "copy",
    }
}

/// One download entry.
#[derive(Debug)]
pub struct Entry {
    pub client: Client,
    /// Its `ModelInfo.id`.
    pub model_id: &'static str,
    /// The runtime build that loads what it downloads.
    pub runtime: Runtime,
    /// The decode layout it downloads: a release serves the entry when it
    /// ships this layout.
    pub layout: LayoutKind,
    /// Packages it fetches with `weights/weight.bin`, by the name the app
    /// saves them under (its remote path: `layouts::repository_path`).
    pub whole: &'static [&'static str],
    /// Packages it fetches without `weights/` (their blob is shared in).
    pub meta_only: &'static [&'static str],
    /// The shares `finishDownload` makes for it: (package, the package
    /// whose blob it gets). It shares a blob only when the receiving
    /// package's `coremldata.bin` is there (main) and its blob is not, so a
    /// share whose source the entry does not fetch does nothing; those are
    /// left out.
    pub shares: &'static [(&'static str, &'static str)],
    pub how: ShareHow,
    /// The multimodal encoder files it fetches beside the text decoder
    /// (`multimodalFiles`; on the branch, the tail of `extraFiles`).
    pub multimodal: &'static [EncoderFile],
    /// Whether the user can turn the multimodal files off (main's
    /// `gemma4DownloadMultimodal`, default on); the branch always fetches them.
    pub multimodal_toggle: bool,
    /// Local-path prefixes whose 404 does not abort the download
    /// (`isOptionalMlmodelcFile`), besides [`OPTIONAL_404_SUFFIXES`].
    pub optional_404_prefixes: &'static [&'static str],
    /// The `estimatedSize` of each package's `weights/weight.bin` in its list
    /// (`mlc(..., weightSize:)`).
    pub weight_estimates: &'static [(&'static str, u64)],
    /// Main's safety stop: the download aborts once its bytes pass this
    /// multiple of its list's `estimatedSize` sum ([`ABORT_OVER_ESTIMATE`]);
    /// None: no such stop (the branch).
    pub abort_over: Option<f64>,
    /// The repository revision its `downloadURL` reads
    /// (`https://huggingface.co/REPO/resolve/REVISION`).
    pub revision: &'static str,
}

/// The one Hugging Face repository every entry's `downloadURL` names: a
/// release published anywhere else needs an app change (a new `ModelInfo`).
pub const REPOSITORY: &str = "mlboydaisuke/gemma-4-E2B-coreml";

/// The folder every E2B entry keeps its download in (`ModelInfo.folderName`),
/// under the app's `Documents/Models/` (`modelsDirectory`): the entries share
/// it, and a file already there is not fetched again.
pub const FOLDER_NAME: &str = "gemma4-e2b";

/// Main's safety stop (ModelDownloader.swift at 72178c6, `updateProgress`,
/// near 940-971): `bytes > Int64(Double(totalBytesForAllFiles) * 1.5)`
/// aborts the download ("exceeds expected … by 50%+"). The bytes are those
/// written so far (finished files and the ones in flight), so a download
/// whose files add up to more than the limit aborts on the way.
pub const ABORT_OVER_ESTIMATE: f64 = 1.5;

/// A non-Hugging Face `downloadURL` is fetched as one zip, listed with this
/// `estimatedSize` whatever its size (ModelDownloader.swift at 72178c6,
/// `download(_:)`): with the safety stop, main aborts any archive over
/// [`ARCHIVE_LIMIT`] bytes.
pub const ARCHIVE_ESTIMATE: u64 = 350_000_000;
pub const ARCHIVE_LIMIT: u64 = (ARCHIVE_ESTIMATE as f64 * ABORT_OVER_ESTIMATE) as u64;

/// What the zip route must find at the extracted folder's root
/// (`localModelURL`): the local names, not the repository's `swa/…`;
/// without it the download ends in `extractionFailed`.
pub const ARCHIVE_ROOT_FILE: &str = "chunk1.mlmodelc/weights/weight.bin";

/// A 404 on a local path ending so does not abort any entry's download
/// (`isOptionalMlmodelcFile`, main and the branch).
pub const OPTIONAL_404_SUFFIXES: &[&str] = &[
    ".mlmodelc/metadata.json",
    ".mlmodelc/analytics/coremldata.bin",
];

/// Main's optional 3-way files (`optionalMlmodelcPrefixes`).
const OPTIONAL_3WAY: &[&str] = &["chunk2_3way.mlmodelc/", "chunk3_3way.mlmodelc/"];

/// The text decoder's side files every entry requests, (remote path, local
/// path, `estimatedSize`), in the app's order: main's `coreFiles`, the head
/// of the branch's `extraFiles` (the same list).
pub const CORE_FILES: &[(&str, &str, u64)] = &[
    ("model_config.json", "model_config.json", 500),
    (
        "hf_model/tokenizer.json",
        "hf_model/tokenizer.json",
        30_000_000,
    ),
    (
        "hf_model/tokenizer_config.json",
        "hf_model/tokenizer_config.json",
        5_000,
    ),
    ("hf_model/config.json", "hf_model/config.json", 5_000),
    ("embed_tokens_q8.bin", "embed_tokens_q8.bin", 402_653_184),
    (
        "embed_tokens_scales.bin",
        "embed_tokens_scales.bin",
        524_288,
    ),
    (
        "embed_tokens_per_layer_q8.bin",
        "embed_tokens_per_layer_q8.bin",
        2_348_810_240,
    ),
    (
        "embed_tokens_per_layer_scales.bin",
        "embed_tokens_per_layer_scales.bin",
        524_288,
    ),
    (
        "per_layer_projection.bin",
        "per_layer_projection.bin",
        27_525_120,
    ),
    (
        "per_layer_norm_weight.bin",
        "per_layer_norm_weight.bin",
        1_024,
    ),
    ("swa/cos_sliding.npy", "cos_sliding.npy", 4_194_432),
    ("swa/sin_sliding.npy", "sin_sliding.npy", 4_194_432),
    ("swa/cos_full.npy", "cos_full.npy", 8_388_736),
    ("swa/sin_full.npy", "sin_full.npy", 8_388_736),
];

/// Widths both runtime builds hard-code (ChunkedEngine.swift): the KV
/// buffers' last dimension (`maxHd = 512`), the RoPE rows fed to sliding
/// and full layers (`dim: 256` / `dim: 512`; verify's `slidingHd = 256`).
pub const KV_WIDTH: usize = 512;
pub const ROPE_SLIDING: usize = 256;
pub const ROPE_FULL: usize = 512;

/// The branch's hard-coded KV buffers (ChunkedEngine.swift at 4cd6c6c,
/// `ioSurfaceArray(slots:)`): (package, sliding slots, full slots), with one
/// KV head. Main reads them from the packages' shapes.
pub const BRANCH_SLOTS: &[(&str, usize, usize)] = &[
    ("chunk1", 7, 1),
    ("chunk2", 5, 2),
    ("merged_chunk1", 12, 3),
    ("merged_full", 12, 3),
];
pub const BRANCH_KV_HEADS: usize = 1;

/// One file the app requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Its path in the repository (a release folder).
    pub remote: String,
    /// Where the app saves it in the model folder.
    pub local: String,
    /// The package it belongs to (its local name), if any.
    pub package: Option<&'static str>,
    /// The encoder file it belongs to, if any.
    pub encoder: Option<EncoderFile>,
    /// Its `estimatedSize` in the app's list.
    pub estimate: u64,
}

chunkforge_model::named! {
    /// What an encoder file serves, as the manifest records it.
    pub enum EncoderRole {
        /// The image (and video) encoders.
        Vision = "vision",
        /// The audio encoder, its mel filter bank, config and the Swift-side
        /// projection weights.
        Audio = "audio",
    }
}

/// One multimodal file of a download entry, by its remote path (the same as
/// its local one: they sit at the repository's root).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncoderFile {
    /// A compiled model folder (`vision.mlmodelc`: fetched as the files of
    /// [`MODELC_FILES`]) or a plain file (`mel_filterbank.bin`).
    pub path: &'static str,
    pub role: EncoderRole,
    /// The `estimatedSize` of each of its requests, in order.
    pub estimates: &'static [u64],
}

impl EncoderFile {
    /// A compiled model folder, fetched file by file.
    pub fn is_model(&self) -> bool {
        self.path.ends_with(".mlmodelc")
    }

    /// The paths the app requests for it.
    pub fn requests(&self) -> Vec<String> {
        if self.is_model() {
            MODELC_FILES
                .iter()
                .map(|f| format!("{}/{f}", self.path))
                .collect()
        } else {
            vec![self.path.to_string()]
        }
    }
}

/// The files the app requests inside every `.mlmodelc` it fetches, in its
/// order (`mlc(...)`); a package fetched without its blob (`prefillMeta`)
/// skips the first. What `chunkforge compile` lays out, no more.
pub const MODELC_FILES: &[&str] = &[
    COMPILED_BLOB,
    "coremldata.bin",
    "model.mil",
    "metadata.json",
    "analytics/coremldata.bin",
];

/// The `estimatedSize` of each of [`MODELC_FILES`] but the blob, whose
/// estimate is the package's (`mlc`, `prefillMeta`).
pub const MODELC_ESTIMATES: &[u64] = &[1_000, 450_000, 8_000, 250];

const fn enc(path: &'static str, role: EncoderRole, estimates: &'static [u64]) -> EncoderFile {
    EncoderFile {
        path,
        role,
        estimates,
    }
}

/// Main's `multimodalFiles` (ModelDownloader.swift at main 72178c6,
/// `buildHuggingFaceFileList`, after `coreFiles`), in its order, with each
/// request's `estimatedSize`.
const MULTIMODAL_MAIN: &[EncoderFile] = &[
    enc(
        "vision.mlmodelc",
        EncoderRole::Vision,
        &[320_000_000, 200_000, 50_000, 1_000, 1_000],
    ),
    // The video encoder (64 tokens a frame); only main fetches it.
    enc(
        "vision_video.mlmodelc",
        EncoderRole::Vision,
        &[338_081_024, 418, 711_289, 2_721, 243],
    ),
    enc(
        "audio.mlmodelc",
        EncoderRole::Audio,
        &[295_373_248, 1_000, 759_000, 3_000, 250],
    ),
    enc("mel_filterbank.bin", EncoderRole::Audio, &[131_584]),
    enc("audio_config.json", EncoderRole::Audio, &[500]),
    // "Audio projection weights (Swift-side float32 computation)".
    enc("output_proj_weight.npy", EncoderRole::Audio, &[3_145_856]),
    enc("output_proj_bias.npy", EncoderRole::Audio, &[3_200]),
    enc("embed_proj_weight.npy", EncoderRole::Audio, &[4_718_720]),
];

/// The branch's (ModelDownloader.swift at fix/2chunk-kv-prefill-transfer
/// 4cd6c6c, `buildHuggingFaceFileList`, the tail of `extraFiles`): main's
/// without `vision_video.mlmodelc`, not toggleable.
const MULTIMODAL_BRANCH: &[EncoderFile] = &[
    MULTIMODAL_MAIN[0],
    MULTIMODAL_MAIN[2],
    MULTIMODAL_MAIN[3],
    MULTIMODAL_MAIN[4],
    MULTIMODAL_MAIN[5],
    MULTIMODAL_MAIN[6],
    MULTIMODAL_MAIN[7],
];

/// Every multimodal file some entry fetches, once each, in entry order: the
/// files `package --encoders-from` carries when a folder holds them.
pub fn all_encoder_files() -> Vec<EncoderFile> {
    let mut out: Vec<EncoderFile> = Vec::new();
    for f in ENTRIES.iter().flat_map(|e| e.multimodal) {
        if !out.contains(f) {
            out.push(*f);
        }
    }
    out
}

/// The encoder file at `path` (its remote path) of some entry's list.
pub fn encoder_file(path: &str) -> Option<EncoderFile> {
    all_encoder_files().into_iter().find(|f| f.path == path)
}

const FOUR: &[&str] = &["chunk1", "chunk2", "chunk3", "chunk4"];
const PREFILL: &[&str] = &[
    "prefill_chunk1",
    "prefill_chunk2",
    "prefill_chunk3",
    "prefill_chunk4",
];
const PREFILL_FROM_FOUR: &[(&str, &str)] = &[
    ("prefill_chunk1", "chunk1"),
    ("prefill_chunk2", "chunk2"),
    ("prefill_chunk3", "chunk3"),
    ("prefill_chunk4", "chunk4"),
];

/// The legacy lists' blob estimates (`mlc(..., weightSize:)`, main 72178c6
/// and the branch 4cd6c6c).
const WEIGHTS_FOUR: &[(&str, u64)] = &[
    ("chunk1", 155_436_864),
    ("chunk2", 133_963_968),
    ("chunk3", 325_282_880),
    ("chunk4", 526_874_880),
];

/// Every entry that downloads a Gemma 4 E2B folder of the layouts chunkforge
/// builds.
pub const ENTRIES: &[Entry] = &[
    Entry {
        client: Client::Main,
        model_id: "gemma4-e2b",
        runtime: Runtime::Main,
        layout: REFERENCE,
        whole: FOUR,
        meta_only: PREFILL,
        shares: PREFILL_FROM_FOUR,
        how: ShareHow::Link,
        multimodal: MULTIMODAL_MAIN,
        multimodal_toggle: true,
        optional_404_prefixes: OPTIONAL_3WAY,
        weight_estimates: WEIGHTS_FOUR,
        abort_over: Some(ABORT_OVER_ESTIMATE),
        // "n1024 branch ships the N=1024 batched prefill".
        revision: "n1024",
    },
    Entry {
        client: Client::Main3Way,
        model_id: "gemma4-e2b-3way",
        runtime: Runtime::Main,
        layout: LayoutKind::Three,
        // chunk2..4 are not fetched: prefill_chunk2/3 come with their own
        // blobs, prefill_chunk4 takes chunk3_3way's (the same layers).
        whole: &[
            "chunk1",
            "chunk2_3way",
            "chunk3_3way",
            "prefill_chunk2",
            "prefill_chunk3",
        ],
        meta_only: &["prefill_chunk1", "prefill_chunk4"],
        shares: &[
            ("prefill_chunk1", "chunk1"),
            ("prefill_chunk4", "chunk3_3way"),
        ],
        how: ShareHow::Link,
        multimodal: MULTIMODAL_MAIN,
        multimodal_toggle: true,
        optional_404_prefixes: OPTIONAL_3WAY,
        weight_estimates: &[
            ("chunk1", 155_436_864),
            ("chunk2_3way", 459_900_000),
            ("chunk3_3way", 527_000_000),
            ("prefill_chunk2", 133_963_968),
            ("prefill_chunk3", 325_282_880),
        ],
        abort_over: Some(ABORT_OVER_ESTIMATE),
        revision: "main",
    },
    Entry {
        client: Client::Branch,
        model_id: "gemma4-e2b",
        runtime: Runtime::Merged,
        layout: REFERENCE,
        whole: FOUR,
        meta_only: PREFILL,
        shares: PREFILL_FROM_FOUR,
        how: ShareHow::Copy,
        multimodal: MULTIMODAL_BRANCH,
        multimodal_toggle: false,
        optional_404_prefixes: &[],
        weight_estimates: WEIGHTS_FOUR,
        abort_over: None,
        revision: "main",
    },
];

/// The row of `client`.
pub fn entry(client: Client) -> &'static Entry {
    ENTRIES
        .iter()
        .find(|e| e.client == client)
        .expect("every client has its row")
}

/// The entries a release of decode layouts `layouts` serves (the reference
/// ships with every release).
pub fn served(layouts: &[LayoutKind]) -> Vec<&'static Entry> {
    ENTRIES
        .iter()
        .filter(|e| e.layout == REFERENCE || layouts.contains(&e.layout))
        .collect()
}

/// The entry whose download `runtime` runs `decode` from: main decodes the
/// three-chunk layout from the 3-way entry's folder and the others from the
/// legacy entry's; the branch has one entry.
pub fn entry_for(runtime: Runtime, decode: LayoutKind) -> &'static Entry {
    entry(match (runtime, decode) {
        (Runtime::Main, LayoutKind::Three) => Client::Main3Way,
        (Runtime::Main, _) => Client::Main,
        (Runtime::Merged, _) => Client::Branch,
    })
}

impl Entry {
    /// Every file this entry requests, in the app's order (packages fetched
    /// whole, then without `weights/`, the core files, the multimodal files
    /// when `multimodal`).
    pub fn requests(&self, multimodal: bool) -> Vec<Request> {
        let mut out = Vec::new();
        let packages = self.whole.iter().map(|p| (p, true));
        for (package, with_blob) in packages.chain(self.meta_only.iter().map(|p| (p, false))) {
            let remote = format!(
                "{}.mlmodelc",
                chunkforge_model::layouts::repository_path(package)
                    .unwrap_or_else(|| package.to_string())
            );
            let blob = self
                .weight_estimates
                .iter()
                .find(|(p, _)| p == package)
                .map_or(0, |(_, e)| *e);
            let estimates = std::iter::once(blob).chain(MODELC_ESTIMATES.iter().copied());
            for (f, estimate) in MODELC_FILES
                .iter()
                .zip(estimates)
                .skip(usize::from(!with_blob))
            {
                out.push(Request {
                    remote: format!("{remote}/{f}"),
                    local: format!("{package}.mlmodelc/{f}"),
                    package: Some(package),
                    encoder: None,
                    estimate,
                });
            }
        }
        for (remote, local, estimate) in CORE_FILES {
            out.push(Request {
                remote: remote.to_string(),
                local: local.to_string(),
                package: None,
                encoder: None,
                estimate: *estimate,
            });
        }
        if multimodal || !self.multimodal_toggle {
            for e in self.multimodal {
                for (r, estimate) in e.requests().into_iter().zip(e.estimates) {
                    out.push(Request {
                        remote: r.clone(),
                        local: r,
                        package: None,
                        encoder: Some(*e),
                        estimate: *estimate,
                    });
                }
            }
        }
        out
    }

    /// The sum of its list's `estimatedSize` (`totalBytesForAllFiles`).
    pub fn estimate(&self, multimodal: bool) -> u64 {
        self.requests(multimodal).iter().map(|r| r.estimate).sum()
    }

    /// The bytes past which its download aborts (main's safety stop), if it
    /// has one: `Int64(Double(total) * 1.5)`.
    pub fn abort_limit(&self, multimodal: bool) -> Option<u64> {
        self.abort_over
            .map(|f| (self.estimate(multimodal) as f64 * f) as u64)
    }

    /// The bytes its download fetches from a release whose files have the
    /// sizes `size(repository path)` gives (None: absent), and how many of
    /// them are the app's estimates: a compiled file of a package the
    /// release holds uncompiled counts as its `.mlpackage` blob (the same
    /// bytes once compiled) or, for the compiler's small files, as the app
    /// estimates it; what is absent counts nothing.
    pub fn fetched_bytes(
        &self,
        multimodal: bool,
        size: &dyn Fn(&str) -> Option<u64>,
    ) -> (u64, usize) {
        let (mut total, mut estimated) = (0, 0);
        for q in self.requests(multimodal) {
            if let Some(n) = size(&q.remote) {
                total += n;
                continue;
            }
            let Some((package, inner)) = q.remote.split_once(".mlmodelc/") else {
                continue;
            };
            let blob = size(&format!("{package}.mlpackage/{PACKAGE_BLOB}"));
            match (inner == COMPILED_BLOB, blob) {
                (true, Some(n)) => total += n,
                (false, Some(_)) => {
                    total += q.estimate;
                    estimated += 1;
                }
                (_, None) => {}
            }
        }
        (total, estimated)
    }

    /// Its `downloadURL`.
    pub fn url(&self) -> String {
        format!(
            "https://huggingface.co/{REPOSITORY}/resolve/{}",
            self.revision
        )
    }

    /// Whether a 404 on `local` leaves this entry's download going.
    pub fn optional_404(&self, local: &str) -> bool {
        OPTIONAL_404_SUFFIXES.iter().any(|s| local.ends_with(s))
            || self
                .optional_404_prefixes
                .iter()
                .any(|p| local.starts_with(p))
    }

    /// The package whose blob `package` holds after this entry's download:
    /// a share's source when it is fetched without `weights/`, else its own.
    pub fn blob_of<'a>(&self, package: &'a str) -> &'a str {
        if self.meta_only.contains(&package) {
            if let Some((_, from)) = self.shares.iter().find(|(p, _)| *p == package) {
                return from;
            }
        }
        package
    }
}

/// What `package` warns of: for each entry serving decode layouts
/// `layouts` with a size stop, each multimodal setting whose download of the
/// release (files sized by `size`, repository paths) passes it. Multimodal
/// on is judged only when the release holds the entry's encoder files (else
/// the download aborts on the first missing one anyway).
pub fn oversized(layouts: &[LayoutKind], size: &dyn Fn(&str) -> Option<u64>) -> Vec<String> {
    let mut out = Vec::new();
    for e in served(layouts) {
        for multimodal in [false, true] {
            let Some(limit) = e.abort_limit(multimodal) else {
                continue;
            };
            let encoders = e.multimodal.iter().flat_map(|f| f.requests()).all(|r| {
                size(&r).is_some() || OPTIONAL_404_SUFFIXES.iter().any(|s| r.ends_with(s))
            });
            if multimodal && !encoders {
                continue;
            }
            let (total, _) = e.fetched_bytes(multimodal, size);
            if total > limit {
                out.push(format!(
                    "the app's {} download ({}, multimodal {}) would fetch {total} bytes, over {limit}, {ABORT_OVER_ESTIMATE} x its list's estimatedSize: main aborts it on the way (ModelDownloader.swift at 72178c6, updateProgress); `chunkforge client-check RELEASE --client {}` names the largest files",
                    e.client,
                    e.model_id,
                    if multimodal { "on" } else { "off" },
                    e.client
                ));
            }
        }
    }
    out
}

/// A share a release must hold good: `package` gets `from`'s blob in the
/// download of every entry in `by`.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedShare {
    pub package: &'static str,
    pub from: &'static str,
    pub by: Vec<(Client, ShareHow)>,
    /// Some entry the release serves fetches the package with its blob, so
    /// the release holds it; otherwise only its sources do.
    pub stored: bool,
}

/// The shares of a release of decode layouts `layouts`, in entry order.
pub fn shares_of(layouts: &[LayoutKind]) -> Vec<PlannedShare> {
    let entries = served(layouts);
    let mut out: Vec<PlannedShare> = Vec::new();
    for e in &entries {
        for &(package, from) in e.shares {
            match out
                .iter_mut()
                .find(|s| (s.package, s.from) == (package, from))
            {
                Some(s) => s.by.push((e.client, e.how)),
                None => out.push(PlannedShare {
                    package,
                    from,
                    by: vec![(e.client, e.how)],
                    stored: entries.iter().any(|x| x.whole.contains(&package)),
                }),
            }
        }
    }
    out
}

/// The weight blob inside a package folder, by its kind: an `.mlpackage`
/// keeps it under `Data/com.apple.CoreML/`, a compiled `.mlmodelc` (what the
/// app fetches) at `weights/weight.bin`.
pub fn blob_in(package_dir: &str) -> &'static str {
    if package_dir.ends_with(".mlmodelc") {
        COMPILED_BLOB
    } else {
        PACKAGE_BLOB
    }
}

pub const PACKAGE_BLOB: &str = "Data/com.apple.CoreML/weights/weight.bin";
pub const COMPILED_BLOB: &str = "weights/weight.bin";

#[cfg(test)]
mod tests {
    use super::*;
    use chunkforge_model::layouts::{kind_of_package, spec, SpansRule, LAYOUTS};

    /// `CORE_FILES` transcribes the app's list by its literal names: every
    /// one outside `hf_model/` is a side file a release writes, fetched from
    /// where the release puts it and saved under the side file's own name;
    /// a renamed side file (or a file the app adds) fails here.
    #[test]
    fn core_files_are_side_files() {
        use crate::sidefiles::SIDE_FILES;
        for (remote, local, _) in CORE_FILES
            .iter()
            .filter(|(r, _, _)| !r.starts_with("hf_model/"))
        {
            let spec = SIDE_FILES
                .iter()
                .find(|s| s.name == *local)
                .unwrap_or_else(|| panic!("{local}: in CORE_FILES but no side file of SIDE_FILES"));
            assert_eq!(
                *remote,
                spec.repository_path(),
                "{local}: fetched from where the release puts it"
            );
        }
    }

    /// The reference chunks a package's layers span (a group of `Groups`
    /// rows, one chunk of the reference).
    fn group(name: &str) -> (usize, usize) {
        let l = LAYOUTS
            .iter()
            .find(|l| {
                l.decode_packages().contains(&name.to_string())
                    || l.package_names().contains(&name.to_string())
            })
            .unwrap_or_else(|| panic!("{name} is no package of the layout table"));
        let names = match l.spans.count() {
            Some(n) => l.names_for(&vec![(0, 0); n], 1),
            None => Vec::new(),
        };
        let i = names.iter().position(|n| n == name).unwrap();
        match l.spans {
            SpansRule::Groups(g) => g[i],
            _ if l.kind == REFERENCE => (i, i),
            _ => panic!("{name}: not a tiling of the reference"),
        }
    }

    #[test]
    fn every_entry_finds_every_blob_it_loads() {
        for e in ENTRIES {
            for p in e.whole.iter().chain(e.meta_only) {
                assert!(kind_of_package(p).is_some(), "{}: {p}", e.client);
            }
            // A package fetched without its blob gets exactly one, from a
            // package the entry fetches whole, of the same layers.
            for p in e.meta_only {
                let from: Vec<_> = e.shares.iter().filter(|(to, _)| to == p).collect();
                assert_eq!(from.len(), 1, "{}: {p}", e.client);
                let (_, src) = from[0];
                assert!(e.whole.contains(src), "{}: {src}", e.client);
                assert_eq!(group(p), group(src), "{}: {p} <- {src}", e.client);
                assert_eq!(e.blob_of(p), *src);
            }
            for (p, _) in e.shares {
                assert!(e.meta_only.contains(p), "{}: {p}", e.client);
            }
            // It fetches every package its layout decodes with and every
            // prefill package.
            for p in spec(e.layout)
                .decode_packages()
                .iter()
                .chain(&spec(LayoutKind::Prefill).package_names())
            {
                assert!(
                    e.whole.contains(&p.as_str()) || e.meta_only.contains(&p.as_str()),
                    "{}: {p}",
                    e.client
                );
            }
            assert!(spec(e.layout).runtimes().contains(&e.runtime));
        }
        // A release without the three-chunk layout holds no prefill blob;
        // with it, prefill_chunk2/3's (the 3-way entry fetches them), and
        // prefill_chunk4 takes chunk3_3way's there, chunk4's elsewhere.
        let shares = shares_of(&[LayoutKind::Four, LayoutKind::Two]);
        assert_eq!(shares.len(), 4);
        assert!(shares.iter().all(|s| !s.stored && s.by.len() == 2));
        let shares = shares_of(&[LayoutKind::Four, LayoutKind::Three]);
        let stored: Vec<_> = shares
            .iter()
            .filter(|s| s.stored)
            .map(|s| s.package)
            .collect();
        assert_eq!(stored, ["prefill_chunk2", "prefill_chunk3"]);
        let four: Vec<_> = shares
            .iter()
            .filter(|s| s.package == "prefill_chunk4")
            .map(|s| (s.from, s.by.clone()))
            .collect();
        assert_eq!(
            four,
            [
                (
                    "chunk4",
                    vec![
                        (Client::Main, ShareHow::Link),
                        (Client::Branch, ShareHow::Copy)
                    ]
                ),
                ("chunk3_3way", vec![(Client::Main3Way, ShareHow::Link)])
            ]
        );
        assert_eq!(served(&[LayoutKind::Two]).len(), 2);
        assert_eq!(served(&[LayoutKind::Three]).len(), 3);
        assert_eq!(
            entry_for(Runtime::Main, LayoutKind::Three).client,
            Client::Main3Way
        );
        assert_eq!(
            entry_for(Runtime::Merged, LayoutKind::One).how,
            ShareHow::Copy
        );
        assert_eq!(blob_in("prefill/chunk1.mlmodelc"), "weights/weight.bin");
        // The encoders: main's eight entries with the video encoder, the
        // branch's seven without, one role each; 5 requests per model folder.
        let files = all_encoder_files();
        assert_eq!(files.len(), 8);
        assert_eq!(entry(Client::Branch).multimodal.len(), 7);
        assert!(!entry(Client::Branch).multimodal_toggle);
        assert!(entry(Client::Main3Way).multimodal_toggle);
        let video = encoder_file("vision_video.mlmodelc").unwrap();
        assert_eq!(video.role, EncoderRole::Vision);
        assert_eq!(video.requests().len(), 5);
        assert_eq!(
            video.requests()[4],
            "vision_video.mlmodelc/analytics/coremldata.bin"
        );
        assert_eq!(
            encoder_file("embed_proj_weight.npy").unwrap().requests(),
            ["embed_proj_weight.npy"]
        );
        assert_eq!(
            files
                .iter()
                .filter(|f| f.role == EncoderRole::Vision)
                .count(),
            2
        );
        assert_eq!(blob_in("prefill/chunk1.mlpackage"), PACKAGE_BLOB);
    }

    /// Main's safety stop, from the lists' `estimatedSize` as transcribed:
    /// the sums of ModelDownloader.swift's `mlc`/`prefillMeta`/`coreFiles`/
    /// `multimodalFiles` estimates at 72178c6, times 1.5, truncated.
    #[test]
    fn main_aborts_past_one_and_a_half_times_its_estimates() {
        let limits: Vec<_> = [Client::Main, Client::Main3Way, Client::Branch]
            .iter()
            .map(|c| (entry(*c).abort_limit(false), entry(*c).abort_limit(true)))
            .collect();
        assert_eq!(
            limits,
            [
                (Some(5_970_671_358), Some(7_415_447_437)),
                (Some(6_660_020_163), Some(8_104_796_242)),
                (None, None)
            ]
        );
        assert_eq!(entry(Client::Main).estimate(false), 3_980_447_572);
        // Every request has its estimate; only the blobs are large.
        for e in ENTRIES {
            for r in e.requests(true) {
                assert!(r.estimate > 0, "{}: {}", e.client, r.remote);
            }
        }
        assert_eq!(ARCHIVE_LIMIT, 525_000_000);
        assert_eq!(
            entry(Client::Main).url(),
            "https://huggingface.co/mlboydaisuke/gemma-4-E2B-coreml/resolve/n1024"
        );
        assert_eq!(entry(Client::Branch).revision, "main");
    }

    /// What `package` warns of: a release whose files, as each entry it
    /// serves fetches them, pass that entry's stop.
    #[test]
    fn oversized_releases_are_named_per_entry_and_setting() {
        // An uncompiled release: .mlpackage folders, no encoders.
        let small = |p: &str| -> Option<u64> {
            let absent = p.contains(".mlmodelc") || p.contains("vision") || p.contains("audio");
            (!absent).then_some(1_000)
        };
        assert!(oversized(&[LayoutKind::Four, LayoutKind::Three], &small).is_empty());
        // An FP16-sized 3-way blob: the 3-way entry passes its stop (multimodal
        // off; without encoders "on" aborts anyway), the legacy one does not
        // fetch it.
        let big = |p: &str| -> Option<u64> {
            small(p).map(|n| {
                if p.starts_with("swa/chunk2_3way.mlpackage/Data") {
                    7_000_000_000
                } else {
                    n
                }
            })
        };
        let w = oversized(&[LayoutKind::Four, LayoutKind::Three], &big);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("main-3way") && w[0].contains("multimodal off"),
            "{w:?}"
        );
        assert!(oversized(&[LayoutKind::Four], &big).is_empty());
    }
}
