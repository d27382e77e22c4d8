//! One row per layout ([`spec`], [`LAYOUTS`]): its kind, how its chunk spans
//! follow from the config, how its packages are named, which functions they
//! hold, and how the app's runtime sees it (its name, which runtime builds
//! load it and with which `[Load]` line, how the runtime picks it by file
//! presence, its `[Profile…]` line and its device-bench target). The plan,
//! the release (manifest, run book, `run`'s folder reader), the device bench
//! and the CLI's help all read these rows; none of them names a package.
//!
//! A new layout is a [`LayoutKind`] variant and its row: [`spec`]'s match
//! does not compile without the row, and the tests below check that every
//! row is listed and consistent.

use std::fmt;
use std::str::FromStr;

crate::named! {
    /// The kind of one layout of a plan (one row of [`LAYOUTS`] each).
    pub enum LayoutKind {
        Four = "four",
        Three = "three",
        Two = "two",
        One = "one",
        Split = "split",
        /// prefill_chunk1..4: the four-chunk spans as batched prefill functions.
        Prefill = "prefill",
    }
}

crate::named! {
    /// The upstream runtime builds: each loads some of the layouts.
    pub enum Runtime {
        /// Branch `fix/2chunk-kv-prefill-transfer`: four-, two- and one-chunk
        /// decode; prints `[Load] Decode layout: NAME`.
        Merged = "merged-layout",
        /// The main branch: four- and three-chunk decode; prints
        /// `[Load] Topology II …` or `[Load] 4-chunk decode …`.
        Main = "main",
    }
}

crate::named! {
    /// How a runtime build commits a `verify_qK` call (ChunkedEngine.swift).
    pub enum VerifyCommit {
        /// Main: `commitAccepted` copies the accepted prefix of the `new_K/V_*`
        /// rows into its caches (`commitKVSlices`; 72178c6).
        AcceptedRows = "accepted-rows",
        /// The branch: `verifyCandidates` copies `K/V_*_out` back into its
        /// caches whole after every call (`copyBack`), all K rows written;
        /// `commitAccepted` only advances the position, so the rows of
        /// rejected drafts stay in the window caches (4cd6c6c).
        WriteThrough = "write-through",
    }
}

/// What a runtime does when an output it reads is missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missing {
    /// Read force-unwrapped (`!`): the app crashes.
    Crashes,
    /// Read as an optional (`?`): the commit is skipped without a word, and
    /// later steps attend to caches that lack the verified rows.
    SkipsCommit,
}

/// One output of `verify_qK` a runtime build reads: the reference chunk
/// (0-based, call order) and the output's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifyRead {
    pub chunk: usize,
    pub output: &'static str,
    pub missing: Missing,
}

/// A runtime build's side of `verify_qK`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifyContract {
    pub commit: VerifyCommit,
    pub reads: &'static [VerifyRead],
    /// Where the upstream Swift reads them, for messages.
    pub source: &'static str,
    /// When it loads `verify_qK` at all.
    pub loaded: &'static str,
}

const fn crash(chunk: usize, output: &'static str) -> VerifyRead {
    VerifyRead {
        chunk,
        output,
        missing: Missing::Crashes,
    }
}

const fn skips(chunk: usize, output: &'static str) -> VerifyRead {
    VerifyRead {
        chunk,
        output,
        missing: Missing::SkipsCommit,
    }
}

/// Main's `verifyCandidates` (ChunkedEngine.swift at 72178c6, near 1700-1740).
const VERIFY_MAIN: VerifyContract = VerifyContract {
    commit: VerifyCommit::AcceptedRows,
    reads: &[
        crash(0, "hidden_states_out"),
        crash(0, "per_layer_combined_out"),
        skips(0, "new_K_sliding"),
        skips(0, "new_V_sliding"),
        skips(0, "new_K_full"),
        skips(0, "new_V_full"),
        crash(1, "hidden_states_out"),
        skips(1, "new_K_sliding"),
        skips(1, "new_V_sliding"),
        skips(1, "new_K_full"),
        skips(1, "new_V_full"),
        crash(1, "kv13_k"),
        crash(1, "kv13_v"),
        crash(1, "kv14_k"),
        crash(1, "kv14_v"),
        crash(2, "hidden_states_out"),
        crash(3, "token_ids"),
    ],
    source: "ChunkedEngine.swift at main 72178c6, verifyCandidates",
    loaded: "only with LLM_EAGLE3_ENABLE=1 or SPECULATIVE_PROFILE set",
};

/// The branch's `verifyCandidates` and `verifyCandidatesWithLogits`
/// (ChunkedEngine.swift at 4cd6c6c, near 1205-1240 and 1340-1365).
const VERIFY_BRANCH: VerifyContract = VerifyContract {
    commit: VerifyCommit::WriteThrough,
    reads: &[
        crash(0, "hidden_states_out"),
        crash(0, "per_layer_combined_out"),
        crash(0, "K_sliding_out"),
        crash(0, "V_sliding_out"),
        crash(0, "K_full_out"),
        crash(0, "V_full_out"),
        crash(1, "hidden_states_out"),
        crash(1, "K_sliding_out"),
        crash(1, "V_sliding_out"),
        crash(1, "K_full_out"),
        crash(1, "V_full_out"),
        crash(1, "kv13_k"),
        crash(1, "kv13_v"),
        crash(1, "kv14_k"),
        crash(1, "kv14_v"),
        crash(2, "hidden_states_out"),
        crash(3, "token_ids"),
    ],
    source:
        "ChunkedEngine.swift at fix/2chunk-kv-prefill-transfer 4cd6c6c, verifyCandidates (copyBack)",
    loaded: "always, when chunk1..4 hold it",
};

impl Runtime {
    /// Its side of the reference's `verify_qK`: what it reads and how it commits.
    pub fn verify(self) -> &'static VerifyContract {
        match self {
            Runtime::Main => &VERIFY_MAIN,
            Runtime::Merged => &VERIFY_BRANCH,
        }
    }

    /// How the run book names the build.
    pub fn describe(self) -> &'static str {
        match self {
            Runtime::Merged => {
                "the merged-layout runtime (upstream branch `fix/2chunk-kv-prefill-transfer`)"
            }
            Runtime::Main => "the upstream main branch runtime",
        }
    }
}

/// The layout every other one is built, checked and benched against: the
/// one whose caches batched prefill fills (the others take its KV through
/// their slot maps), which carries `verify_qK`, which the runtime falls back
/// to, which parity uses as its reference, which every release ships and
/// which the device bench runs as its control.
pub const REFERENCE: LayoutKind = LayoutKind::Four;

/// What a layout's packages are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// Token-by-token decode.
    Decode,
    /// Batched prefill into the reference's caches.
    Prefill,
}

/// A contiguous range `first..=last` of the reference's chunks.
pub type Group = (usize, usize);

/// How a layout's chunk spans follow from the config.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SpansRule {
    /// The KV-owning layers in `owners` parts, then the KV-sharing layers in
    /// `sharers` parts, earlier parts taking the odd layer (2 + 2: E2B 0-7 /
    /// 8-14 / 15-24 / 25-34); with too few of either, every layer in
    /// `owners + sharers` parts of ⌈n / parts⌉ layers.
    OwnersSharers { owners: usize, sharers: usize },
    /// Every layer in one chunk.
    Whole,
    /// Groups of the reference's chunks, so that its packages' weights
    /// still pair up with the reference's.
    Groups(&'static [Group]),
    /// Given by `--split`.
    Given,
}

impl SpansRule {
    /// Chunks of the layout; None when `--split` decides.
    pub fn count(self) -> Option<usize> {
        match self {
            SpansRule::OwnersSharers { owners, sharers } => Some(owners + sharers),
            SpansRule::Whole => Some(1),
            SpansRule::Groups(g) => Some(g.len()),
            SpansRule::Given => None,
        }
    }
}

/// How a layout's packages are named (`<name>.mlpackage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameRule {
    /// `{prefix}{i}{suffix}`, i from 1.
    Numbered {
        prefix: &'static str,
        suffix: &'static str,
    },
    /// One package.
    Single(&'static str),
    /// `layers_{first}-{last}`, zero-padded to the widest layer number.
    LayerRange,
}

/// The functions a layout's packages hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FunctionSet {
    /// `main`: decode only.
    Decode,
    /// `decode_q1` + `verify_qK` when the build asks for verify, else `main`.
    DecodeVerify,
    /// One `prefill_bN` per prefill length, the longest first.
    Prefill,
}

/// The line a runtime build prints when it has loaded a layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadLine {
    /// The merged-layout runtime's `[Load] Decode layout: NAME` with the
    /// layout's runtime name.
    Merged,
    /// The main runtime's own line for the layout (a template: `{}` is text).
    Main(&'static str),
}

impl LoadLine {
    pub fn runtime(self) -> Runtime {
        match self {
            LoadLine::Merged => Runtime::Merged,
            LoadLine::Main(_) => Runtime::Main,
        }
    }
}

/// How the runtime picks a layout by the packages in the model folder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// When every package it decodes with that is its own is present.
    OwnPackages,
    /// When no other layout is picked.
    Fallback,
}

/// What the device bench requires of a layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bench {
    /// The baseline the others are measured against: no target of its own.
    Control,
    /// Decode tok/s to pass (the consolidation did not hurt) and to ship
    /// (the gain justifies the extra download).
    Target { pass: f64, ship: f64 },
    /// Measured against the control, with no target.
    Measured,
}

/// A decode layout as the app's runtime sees it (facts of the upstream Swift
/// runtime, `ChunkedEngine.swift`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RuntimeRow {
    /// The name its `[Load] Decode layout: NAME` line and the device report use.
    pub name: &'static str,
    /// The runtime builds that load it, with the line each prints.
    pub load_lines: &'static [LoadLine],
    pub selection: Selection,
    /// Its place in the order the runtime tries layouts (lower first): main
    /// prefers the three-chunk layout over four, the merged-layout branch
    /// one over two over four; each ignores the other's files, so one order
    /// gives either's choice.
    pub pick_rank: u8,
    /// The `[Profile…]` line the runtime prints every 10 decode steps with
    /// it (a template: `{n}` is a number; the last one the running tok/s).
    pub profile_line: &'static str,
    pub bench: Bench,
}

/// One layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayoutSpec {
    pub kind: LayoutKind,
    pub purpose: Purpose,
    pub spans: SpansRule,
    pub names: NameRule,
    pub functions: FunctionSet,
    /// For `--help`, after its packages.
    pub about: &'static str,
    /// Its first chunk is the reference's first package (same layers and
    /// contract), not a package of its own: the runtime decodes with
    /// `chunk1` there and nothing loads a copy (upstream's `chunk1_3way`),
    /// so none is built or shipped.
    pub borrows_first: bool,
    /// Where its packages sit in the app's model repository.
    pub place: Place,
    /// None: a layout the runtime does not load.
    pub runtime: Option<RuntimeRow>,
}

/// Where a layout's packages sit in the app's model repository, which a
/// release folder is (uploaded as it is): upstream's `ModelDownloader.swift`
/// fetches each package from its remote path and saves it under the package
/// name, so the app's model folder (and a build folder) has the package
/// names at its root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// `dir/NAME`, with `strip` taken off the front of the package name
    /// (`prefill_chunk1` is fetched from `prefill/chunk1`).
    Under {
        dir: &'static str,
        strip: &'static str,
    },
    /// At the root, under the package name: no download list fetches it;
    /// it is copied into the app's model folder by hand (sideloaded).
    Sideloaded,
}

/// The main runtime's `[Profile]` line, shared by the four- and three-chunk decode.
const PROFILE_MAIN: &str = "[Profile] emb={n}ms mask={n}ms | c1={n} c2={n} c3={n} c4={n} (sum={n}ms) | predict={n}ms total={n}ms ({n} tok/s)";

const FOUR: LayoutSpec = LayoutSpec {
    kind: LayoutKind::Four,
    purpose: Purpose::Decode,
    spans: SpansRule::OwnersSharers {
        owners: 2,
        sharers: 2,
    },
    names: NameRule::Numbered {
        prefix: "chunk",
        suffix: "",
    },
    functions: FunctionSet::DecodeVerify,
    about: "the four-chunk reference (decode_q1 + verify_qK with --verify-k)",
    borrows_first: false,
    place: Place::Under {
        dir: "swa",
        strip: "",
    },
    runtime: Some(RuntimeRow {
        name: "four-chunk",
        load_lines: &[
            LoadLine::Merged,
            LoadLine::Main("[Load] 4-chunk decode ({})"),
        ],
        selection: Selection::Fallback,
        pick_rank: 3,
        profile_line: PROFILE_MAIN,
        bench: Bench::Control,
    }),
};

const THREE: LayoutSpec = LayoutSpec {
    kind: LayoutKind::Three,
    purpose: Purpose::Decode,
    spans: SpansRule::Groups(&[(0, 0), (1, 2), (3, 3)]),
    names: NameRule::Numbered {
        prefix: "chunk",
        suffix: "_3way",
    },
    functions: FunctionSet::Decode,
    about: "the reference's chunk1 itself, its two middle chunks merged, its last",
    borrows_first: true,
    place: Place::Under {
        dir: "swa",
        strip: "",
    },
    runtime: Some(RuntimeRow {
        name: "three-chunk",
        load_lines: &[LoadLine::Main("[Load] Topology II — 3-chunk default ({})")],
        selection: Selection::OwnPackages,
        pick_rank: 0,
        profile_line: PROFILE_MAIN,
        bench: Bench::Measured,
    }),
};

const TWO: LayoutSpec = LayoutSpec {
    kind: LayoutKind::Two,
    purpose: Purpose::Decode,
    spans: SpansRule::OwnersSharers {
        owners: 1,
        sharers: 1,
    },
    names: NameRule::Numbered {
        prefix: "merged_chunk",
        suffix: "",
    },
    functions: FunctionSet::Decode,
    about: "the KV-owning layers, then the KV-sharing ones",
    borrows_first: false,
    place: Place::Sideloaded,
    runtime: Some(RuntimeRow {
        name: "two-chunk",
        load_lines: &[LoadLine::Merged],
        selection: Selection::OwnPackages,
        pick_rank: 2,
        profile_line: "[Profile-2chunk] emb={n}ms mask={n}ms | m1={n} m2={n} (sum={n}ms) | predict={n}ms ({n} tok/s)",
        bench: Bench::Target {
            pass: 36.0,
            ship: 40.0,
        },
    }),
};

const ONE: LayoutSpec = LayoutSpec {
    kind: LayoutKind::One,
    purpose: Purpose::Decode,
    spans: SpansRule::Whole,
    names: NameRule::Single("merged_full"),
    functions: FunctionSet::Decode,
    about: "every layer in one function",
    borrows_first: false,
    place: Place::Sideloaded,
    runtime: Some(RuntimeRow {
        name: "one-chunk",
        load_lines: &[LoadLine::Merged],
        selection: Selection::OwnPackages,
        pick_rank: 1,
        profile_line:
            "[Profile-1chunk] emb={n}ms mask={n}ms | full={n} | predict={n}ms ({n} tok/s)",
        bench: Bench::Target {
            pass: 40.0,
            ship: 48.0,
        },
    }),
};

const SPLIT: LayoutSpec = LayoutSpec {
    kind: LayoutKind::Split,
    purpose: Purpose::Decode,
    spans: SpansRule::Given,
    names: NameRule::LayerRange,
    functions: FunctionSet::Decode,
    about: "the layer ranges of --split",
    borrows_first: false,
    place: Place::Sideloaded,
    runtime: None,
};

const PREFILL: LayoutSpec = LayoutSpec {
    kind: LayoutKind::Prefill,
    purpose: Purpose::Prefill,
    spans: SpansRule::Groups(&[(0, 0), (1, 1), (2, 2), (3, 3)]),
    names: NameRule::Numbered {
        prefix: "prefill_chunk",
        suffix: "",
    },
    functions: FunctionSet::Prefill,
    about: "the reference's spans as batched prefill functions",
    borrows_first: false,
    place: Place::Under {
        dir: "prefill",
        strip: "prefill_",
    },
    runtime: None,
};

/// Every layout, in plan order: a plan lists its layouts (and a release its
/// packages) in this order.
pub const LAYOUTS: &[LayoutSpec] = &[FOUR, THREE, TWO, ONE, SPLIT, PREFILL];

/// The row of `kind`.
pub fn spec(kind: LayoutKind) -> &'static LayoutSpec {
    match kind {
        LayoutKind::Four => &FOUR,
        LayoutKind::Three => &THREE,
        LayoutKind::Two => &TWO,
        LayoutKind::One => &ONE,
        LayoutKind::Split => &SPLIT,
        LayoutKind::Prefill => &PREFILL,
    }
}

/// The layout of `package` (a package name without `.mlpackage`) by its
/// name alone, for packages no plan describes.
pub fn kind_of_package(package: &str) -> Option<LayoutKind> {
    LAYOUTS
        .iter()
        .find(|l| l.package_names().iter().any(|p| p == package))
        .map(|l| l.kind)
}

impl LayoutSpec {
    /// The package names of its chunks for `spans` of a model of `layers`
    /// layers: a borrowed first chunk is named as the reference's.
    pub fn names_for(&self, spans: &[(usize, usize)], layers: usize) -> Vec<String> {
        let width = layers.saturating_sub(1).to_string().len();
        spans
            .iter()
            .enumerate()
            .map(|(i, &(a, b))| match self.names {
                _ if i == 0 && self.borrows_first => {
                    spec(REFERENCE).names_for(&[(a, b)], layers)[0].clone()
                }
                NameRule::Numbered { prefix, suffix } => format!("{prefix}{}{suffix}", i + 1),
                NameRule::Single(name) => name.to_string(),
                NameRule::LayerRange => format!("layers_{a:0width$}-{b:0width$}"),
            })
            .collect()
    }

    /// The packages it decodes with when its chunk count is fixed, in call
    /// order, a borrowed first one included (empty for a `--split` layout,
    /// whose names follow its ranges).
    fn chunk_names(&self) -> Vec<String> {
        match (self.spans.count(), self.names) {
            (_, NameRule::LayerRange) | (None, _) => Vec::new(),
            (Some(n), _) => self.names_for(&vec![(0, 0); n], 1),
        }
    }

    /// Its own packages (a borrowed first package is the reference's), when
    /// its chunk count is fixed.
    pub fn package_names(&self) -> Vec<String> {
        let skip = usize::from(self.borrows_first);
        self.chunk_names().into_iter().skip(skip).collect()
    }

    /// Its packages in brief: `chunk1..chunk4`, `merged_chunk1 +
    /// merged_chunk2`, `chunk1 + chunk2_3way + chunk3_3way`, `merged_full`.
    pub fn summary(&self) -> String {
        match self.chunk_names().as_slice() {
            [] => "layers_A-B per --split range".into(),
            [one] => one.clone(),
            [a, b] => format!("{a} + {b}"),
            [a, b, c] => format!("{a} + {b} + {c}"),
            [a, .., z] => format!("{a}..{z}"),
        }
    }

    /// Its packages as a number range: `chunk1..4`, `prefill_chunk1..4`.
    pub fn range(&self) -> String {
        match (self.names, self.spans.count()) {
            (NameRule::Numbered { prefix, suffix }, Some(n)) if n > 1 && !self.borrows_first => {
                format!("{prefix}1{suffix}..{n}")
            }
            _ => self.summary(),
        }
    }

    /// Its line in `--help`.
    pub fn help(&self) -> String {
        format!("{}: {}", self.summary(), self.about)
    }

    /// The packages the runtime decodes with, in call order (empty for a
    /// layout the runtime does not load).
    pub fn decode_packages(&self) -> Vec<String> {
        match self.runtime {
            Some(_) => self.chunk_names(),
            None => Vec::new(),
        }
    }

    /// The packages whose presence (all of them) makes the runtime pick it;
    /// empty for the fallback and for a layout the runtime does not load.
    pub fn selected_by(&self) -> Vec<String> {
        match self.runtime {
            Some(rt) if rt.selection == Selection::OwnPackages => self.package_names(),
            _ => Vec::new(),
        }
    }

    /// The runtime builds that load it.
    pub fn runtimes(&self) -> Vec<Runtime> {
        self.runtime
            .iter()
            .flat_map(|r| r.load_lines.iter().map(|l| l.runtime()))
            .collect()
    }

    /// Whether `--mode NAME` and `package --layout NAME` can ask for it by name.
    pub fn buildable(&self) -> bool {
        self.purpose == Purpose::Decode && self.spans.count().is_some()
    }

    /// The path of its package `name` (no extension) in the app's repository.
    pub fn repository_path(&self, name: &str) -> String {
        match self.place {
            Place::Under { dir, strip } => {
                format!("{dir}/{}", name.strip_prefix(strip).unwrap_or(name))
            }
            Place::Sideloaded => name.to_string(),
        }
    }
}

/// The path of package `name` (no extension) in the app's repository, by
/// the row of its layout (None: a package no row names, e.g. a `--split`
/// one, which no release ships).
pub fn repository_path(name: &str) -> Option<String> {
    kind_of_package(name).map(|k| spec(k).repository_path(name))
}

/// The decode layouts the runtime loads, in the order it tries them.
pub fn runtime_order() -> Vec<&'static LayoutSpec> {
    let mut v: Vec<&LayoutSpec> = LAYOUTS.iter().filter(|l| l.runtime.is_some()).collect();
    v.sort_by_key(|l| l.runtime.map(|r| r.pick_rank));
    v
}

/// A layout named on the command line or in a record, or one of a few words
/// (`--mode both`, `package --layout all`, `run --layout auto`).
pub trait Choice: Copy + FromStr + fmt::Display + 'static {
    /// Every accepted name with its `--help` line.
    fn choices() -> Vec<(&'static str, String)>;
}

/// A selector type: a layout of [`LAYOUTS`] that `$allowed` admits, or one
/// of the words.
macro_rules! selector {
    ($(#[$meta:meta])* $name:ident, $allowed:expr, { $($(#[doc = $doc:literal])* $word:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            /// One layout.
            Only(LayoutKind),
            $($(#[doc = $doc])* $word),+
        }

        impl $name {
            /// Whether the selector can name `l`.
            pub fn admits(l: &LayoutSpec) -> bool {
                let f: fn(&LayoutSpec) -> bool = $allowed;
                f(l)
            }

            pub fn as_str(self) -> &'static str {
                match self {
                    $name::Only(k) => k.as_str(),
                    $($name::$word => $text),+
                }
            }

            /// The one layout it names, if it names one.
            pub fn kind(self) -> Option<LayoutKind> {
                match self {
                    $name::Only(k) => Some(k),
                    _ => None,
                }
            }
        }

        impl Choice for $name {
            fn choices() -> Vec<(&'static str, String)> {
                let mut v: Vec<(&'static str, String)> = LAYOUTS
                    .iter()
                    .filter(|l| $name::admits(l))
                    .map(|l| (l.kind.as_str(), l.help()))
                    .collect();
                $(v.push(($text, concat!("" $(, $doc)*).trim().trim_end_matches('.').to_string()));)+
                v
            }
        }

        crate::by_name!($name);

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text => Ok($name::$word),)+
                    _ => match s.parse::<LayoutKind>() {
                        Ok(k) if $name::admits(spec(k)) => Ok($name::Only(k)),
                        _ => Err(format!(
                            "`{s}` is not one of {}",
                            <$name as Choice>::choices()
                                .iter()
                                .map(|c| c.0)
                                .collect::<Vec<_>>()
                                .join(", ")
                        )),
                    },
                }
            }
        }

        impl schemars::JsonSchema for $name {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }

            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                let names: Vec<&str> = <$name as Choice>::choices().iter().map(|c| c.0).collect();
                schemars::json_schema!({ "type": "string", "enum": names })
            }
        }
    };
}

selector! {
    /// `--mode`: the layouts a build or parity run asks for.
    Mode, |l| l.buildable(), {
        /// two and one.
        Both = "both",
        /// Every layout above (the reference with verify_qK), and the prefill packages.
        All = "all",
    }
}

impl Mode {
    /// The decode layouts this mode builds, in build order.
    pub fn kinds(self) -> Vec<LayoutKind> {
        match self {
            Mode::Only(k) => vec![k],
            Mode::Both => vec![LayoutKind::Two, LayoutKind::One],
            Mode::All => LAYOUTS
                .iter()
                .filter(|l| l.buildable())
                .map(|l| l.kind)
                .collect(),
        }
    }
}

selector! {
    /// `package --layout`: which decode layouts a release carries (the
    /// reference's packages and the prefill packages ship with every one).
    ReleaseLayout, |l| l.runtime.is_some(), {
        /// Every layout in the build.
        All = "all",
        /// Every layout in the build whose functions all stay within the
        /// Neural Engine layer ceiling (all but one, today), so that no
        /// runtime picks one that fails to compile on the phone.
        App = "app",
    }
}

selector! {
    /// `run --layout`: which decode layout to run.
    RunLayout, |l| l.runtime.is_some(), {
        /// By file presence, as the runtime picks.
        Auto = "auto",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_row_once_and_rows_agree() {
        for k in LayoutKind::ALL {
            assert_eq!(spec(*k).kind, *k);
            assert_eq!(
                LAYOUTS.iter().filter(|l| l.kind == *k).count(),
                1,
                "{k} must be listed in LAYOUTS once"
            );
        }
        assert_eq!(LAYOUTS.len(), LayoutKind::ALL.len());
        let reference = spec(REFERENCE);
        assert_eq!(reference.functions, FunctionSet::DecodeVerify);
        for l in LAYOUTS {
            if let SpansRule::Groups(g) = l.spans {
                // Contiguous groups covering the reference's chunks once.
                let mut next = 0;
                for &(a, b) in g {
                    assert!(a == next && b >= a, "{}: {g:?}", l.kind);
                    next = b + 1;
                }
                assert_eq!(Some(next), reference.spans.count(), "{}", l.kind);
            }
            // A borrowed first chunk is the reference's first chunk.
            if l.borrows_first {
                assert!(
                    matches!(l.spans, SpansRule::Groups([(0, 0), ..])),
                    "{}",
                    l.kind
                );
            }
            let Some(rt) = l.runtime else { continue };
            // The runtime loads only layouts with fixed package names.
            assert!(l.buildable(), "{}", l.kind);
            assert!(!rt.load_lines.is_empty(), "{}", l.kind);
            assert!(rt.profile_line.starts_with("[Profile"), "{}", l.kind);
            assert_eq!(
                rt.selection == Selection::Fallback,
                l.kind == REFERENCE,
                "the reference is the fallback, and only it"
            );
            assert_eq!(
                rt.bench == Bench::Control,
                l.kind == REFERENCE,
                "the reference is the control, and only it"
            );
            // Names and pick ranks tell the layouts apart.
            for m in LAYOUTS.iter().filter(|m| m.kind != l.kind) {
                if let Some(o) = m.runtime {
                    assert_ne!(o.name, rt.name);
                    assert_ne!(o.pick_rank, rt.pick_rank);
                }
                for p in l.package_names() {
                    assert!(!m.package_names().contains(&p), "{p}");
                }
            }
        }
        assert_eq!(runtime_order().last().map(|l| l.kind), Some(REFERENCE));
    }

    #[test]
    fn names_and_runtime_packages() {
        assert_eq!(
            spec(LayoutKind::Four).package_names(),
            ["chunk1", "chunk2", "chunk3", "chunk4"]
        );
        assert_eq!(
            spec(LayoutKind::Three).decode_packages(),
            ["chunk1", "chunk2_3way", "chunk3_3way"]
        );
        assert_eq!(
            spec(LayoutKind::Three).selected_by(),
            ["chunk2_3way", "chunk3_3way"]
        );
        assert!(spec(LayoutKind::Four).selected_by().is_empty());
        assert_eq!(
            spec(LayoutKind::Two).summary(),
            "merged_chunk1 + merged_chunk2"
        );
        assert_eq!(spec(LayoutKind::Prefill).range(), "prefill_chunk1..4");
        assert_eq!(
            spec(LayoutKind::Split).names_for(&[(0, 11), (12, 34)], 35),
            ["layers_00-11", "layers_12-34"]
        );
        // The three-chunk decode runs chunk1 itself: no package of its own.
        assert_eq!(
            spec(LayoutKind::Three).package_names(),
            ["chunk2_3way", "chunk3_3way"]
        );
        assert_eq!(
            spec(LayoutKind::Three).summary(),
            "chunk1 + chunk2_3way + chunk3_3way"
        );
        assert_eq!(
            spec(LayoutKind::Three).names_for(&[(0, 7), (8, 24), (25, 34)], 35),
            ["chunk1", "chunk2_3way", "chunk3_3way"]
        );
        assert_eq!(kind_of_package("chunk1"), Some(LayoutKind::Four));
        // The app's remote paths (ModelDownloader.swift); merged packages are sideloaded.
        for (name, path) in [
            ("chunk1", "swa/chunk1"),
            ("chunk2_3way", "swa/chunk2_3way"),
            ("prefill_chunk4", "prefill/chunk4"),
            ("merged_chunk1", "merged_chunk1"),
            ("merged_full", "merged_full"),
        ] {
            assert_eq!(repository_path(name).as_deref(), Some(path), "{name}");
        }
        assert_eq!(repository_path("layers_00-11"), None);
        assert_eq!(kind_of_package("merged_full"), Some(LayoutKind::One));
        assert_eq!(kind_of_package("layers_00-11"), None);
    }

    #[test]
    fn selectors_read_and_write_their_names() {
        assert_eq!("all".parse::<Mode>(), Ok(Mode::All));
        assert_eq!("two".parse::<Mode>(), Ok(Mode::Only(LayoutKind::Two)));
        assert!("split".parse::<Mode>().is_err());
        assert!("prefill".parse::<ReleaseLayout>().is_err());
        assert_eq!("auto".parse::<RunLayout>(), Ok(RunLayout::Auto));
        let all = Mode::All.kinds();
        assert_eq!(
            all,
            [
                LayoutKind::Four,
                LayoutKind::Three,
                LayoutKind::Two,
                LayoutKind::One
            ]
        );
        // Every layout the runtime loads can be built, released and run by name.
        for l in runtime_order() {
            let name = l.kind.as_str();
            assert!(all.contains(&l.kind), "{name}");
            assert_eq!(
                name.parse::<ReleaseLayout>(),
                Ok(ReleaseLayout::Only(l.kind))
            );
            assert_eq!(name.parse::<RunLayout>(), Ok(RunLayout::Only(l.kind)));
        }
        let j = serde_json::to_string(&ReleaseLayout::All).unwrap();
        assert_eq!(j, "\"all\"");
        assert_eq!(
            serde_json::from_str::<Mode>("\"both\"").unwrap(),
            Mode::Both
        );
    }
}
