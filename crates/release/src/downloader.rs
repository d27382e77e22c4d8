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
}

/// A 404 on a local path ending so does not abort any entry's download
/// (`isOptionalMlmodelcFile`, main and the branch).
pub const OPTIONAL_404_SUFFIXES: &[&str] = &[
    ".mlmodelc/metadata.json",
    ".mlmodelc/analytics/coremldata.bin",
];

/// Main's optional 3-way files (`optionalMlmodelcPrefixes`).
const OPTIONAL_3WAY: &[&str] = &["chunk2_3way.mlmodelc/", "chunk3_3way.mlmodelc/"];

/// The text decoder's side files every entry requests, (remote path, local
/// path), in the app's order: main's `coreFiles`, the head of the branch's
/// `extraFiles` (the same list).
pub const CORE_FILES: &[(&str, &str)] = &[
    ("model_config.json", "model_config.json"),
    ("hf_model/tokenizer.json", "hf_model/tokenizer.json"),
    (
        "hf_model/tokenizer_config.json",
        "hf_model/tokenizer_config.json",
    ),
    ("hf_model/config.json", "hf_model/config.json"),
    ("embed_tokens_q8.bin", "embed_tokens_q8.bin"),
    ("embed_tokens_scales.bin", "embed_tokens_scales.bin"),
    (
        "embed_tokens_per_layer_q8.bin",
        "embed_tokens_per_layer_q8.bin",
    ),
    (
        "embed_tokens_per_layer_scales.bin",
        "embed_tokens_per_layer_scales.bin",
    ),
    ("per_layer_projection.bin", "per_layer_projection.bin"),
    ("per_layer_norm_weight.bin", "per_layer_norm_weight.bin"),
    ("swa/cos_sliding.npy", "cos_sliding.npy"),
    ("swa/sin_sliding.npy", "sin_sliding.npy"),
    ("swa/cos_full.npy", "cos_full.npy"),
    ("swa/sin_full.npy", "sin_full.npy"),
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

const fn enc(path: &'static str, role: EncoderRole) -> EncoderFile {
    EncoderFile { path, role }
}

/// Main's `multimodalFiles` (ModelDownloader.swift at main 72178c6,
/// `buildHuggingFaceFileList`, after `coreFiles`), in its order.
const MULTIMODAL_MAIN: &[EncoderFile] = &[
    enc("vision.mlmodelc", EncoderRole::Vision),
    // The video encoder (64 tokens a frame); only main fetches it.
    enc("vision_video.mlmodelc", EncoderRole::Vision),
    enc("audio.mlmodelc", EncoderRole::Audio),
    enc("mel_filterbank.bin", EncoderRole::Audio),
    enc("audio_config.json", EncoderRole::Audio),
    // "Audio projection weights (Swift-side float32 computation)".
    enc("output_proj_weight.npy", EncoderRole::Audio),
    enc("output_proj_bias.npy", EncoderRole::Audio),
    enc("embed_proj_weight.npy", EncoderRole::Audio),
];

/// The branch's (ModelDownloader.swift at fix/2chunk-kv-prefill-transfer
/// 4cd6c6c, `buildHuggingFaceFileList`, the tail of `extraFiles`): main's
/// without `vision_video.mlmodelc`, not toggleable.
const MULTIMODAL_BRANCH: &[EncoderFile] = &[
    enc("vision.mlmodelc", EncoderRole::Vision),
    enc("audio.mlmodelc", EncoderRole::Audio),
    enc("mel_filterbank.bin", EncoderRole::Audio),
    enc("audio_config.json", EncoderRole::Audio),
    enc("output_proj_weight.npy", EncoderRole::Audio),
    enc("output_proj_bias.npy", EncoderRole::Audio),
    enc("embed_proj_weight.npy", EncoderRole::Audio),
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
            for f in MODELC_FILES.iter().skip(usize::from(!with_blob)) {
                out.push(Request {
                    remote: format!("{remote}/{f}"),
                    local: format!("{package}.mlmodelc/{f}"),
                    package: Some(package),
                    encoder: None,
                });
            }
        }
        for (remote, local) in CORE_FILES {
            out.push(Request {
                remote: remote.to_string(),
                local: local.to_string(),
                package: None,
                encoder: None,
            });
        }
        if multimodal || !self.multimodal_toggle {
            for e in self.multimodal {
                for r in e.requests() {
                    out.push(Request {
                        remote: r.clone(),
                        local: r,
                        package: None,
                        encoder: Some(*e),
                    });
                }
            }
        }
        out
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
}
