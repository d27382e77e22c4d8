//! What the app's runtime does with the decode layouts of a model folder
//! (facts of the upstream Swift runtime, `ChunkedEngine.swift`): the packages
//! each layout decodes with, which files make the runtime pick it, and how its
//! log names it. `chunkforge run --layout auto`, the device run book and
//! `chunkforge device-report` all read this one table.

use chunkforge_model::plan::LayoutKind;

chunkforge_model::named! {
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

/// One decode layout as the runtime sees it.
#[derive(Debug)]
pub struct RuntimeLayout {
    pub kind: LayoutKind,
    /// The name the runtime's `[Load] Decode layout: NAME` line uses (and the
    /// device report).
    pub name: &'static str,
    /// The packages the runtime decodes with, in call order. The three-chunk
    /// decode starts with four's `chunk1` (same layers and contract as
    /// `chunk1_3way`, which the runtime never loads).
    pub decode: &'static [&'static str],
    /// The packages whose presence (all of them) makes the runtime pick this
    /// layout; empty for the fallback.
    pub selected_by: &'static [&'static str],
    /// The tag of the `[Profile…]` line the runtime prints while decoding
    /// with this layout.
    pub profile_tag: &'static str,
    /// The runtime builds that load it.
    pub runtimes: &'static [Runtime],
}

/// In the order the runtime tries them: the first whose `selected_by`
/// packages all exist wins. The upstream main branch prefers `chunk2_3way` +
/// `chunk3_3way` over chunk1..4; the merged-layout branch prefers
/// `merged_full` over `merged_chunk1` + `merged_chunk2` over chunk1..4. Each
/// ignores the other's files, so this order gives the same choice as either.
pub const RUNTIME_LAYOUTS: &[RuntimeLayout] = &[
    RuntimeLayout {
        kind: LayoutKind::Three,
        name: "three-chunk",
        decode: &["chunk1", "chunk2_3way", "chunk3_3way"],
        selected_by: &["chunk2_3way", "chunk3_3way"],
        profile_tag: "[Profile]",
        runtimes: &[Runtime::Main],
    },
    RuntimeLayout {
        kind: LayoutKind::One,
        name: "one-chunk",
        decode: &["merged_full"],
        selected_by: &["merged_full"],
        profile_tag: "[Profile-1chunk]",
        runtimes: &[Runtime::Merged],
    },
    RuntimeLayout {
        kind: LayoutKind::Two,
        name: "two-chunk",
        decode: &["merged_chunk1", "merged_chunk2"],
        selected_by: &["merged_chunk1", "merged_chunk2"],
        profile_tag: "[Profile-2chunk]",
        runtimes: &[Runtime::Merged],
    },
    RuntimeLayout {
        kind: LayoutKind::Four,
        name: "four-chunk",
        decode: &["chunk1", "chunk2", "chunk3", "chunk4"],
        selected_by: &[],
        profile_tag: "[Profile]",
        runtimes: &[Runtime::Merged, Runtime::Main],
    },
];

/// The runtime's view of decode layout `kind` (None: a layout the runtime
/// does not load, e.g. a custom `--split`).
pub fn runtime_layout(kind: LayoutKind) -> Option<&'static RuntimeLayout> {
    RUNTIME_LAYOUTS.iter().find(|l| l.kind == kind)
}

/// The layout the runtime picks in a folder where `has(package)` says which
/// packages exist.
pub fn pick(has: impl Fn(&str) -> bool) -> LayoutKind {
    RUNTIME_LAYOUTS
        .iter()
        .find(|l| l.selected_by.iter().all(|p| has(p)))
        .map_or(LayoutKind::Four, |l| l.kind)
}

/// The packages to move out of a folder holding `has(package)` so that the
/// runtime picks `kind`: every present package that selects a layout the
/// runtime would try first. Empty when it already picks `kind`.
pub fn move_aside(kind: LayoutKind, has: impl Fn(&str) -> bool) -> Vec<&'static str> {
    let mut out = Vec::new();
    for l in RUNTIME_LAYOUTS.iter().take_while(|l| l.kind != kind) {
        for p in l.selected_by {
            if has(p) && !out.contains(p) {
                out.push(*p);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_and_move_aside_follow_the_runtime_order() {
        let all = |_: &str| true;
        assert_eq!(pick(all), LayoutKind::Three);
        assert_eq!(
            move_aside(LayoutKind::Four, all),
            [
                "chunk2_3way",
                "chunk3_3way",
                "merged_full",
                "merged_chunk1",
                "merged_chunk2"
            ]
        );
        assert_eq!(
            move_aside(LayoutKind::Two, all),
            ["chunk2_3way", "chunk3_3way", "merged_full"]
        );
        assert!(move_aside(LayoutKind::Three, all).is_empty());
        // A two-chunk release: only the merged pair selects anything.
        let two = |p: &str| p.starts_with("merged_chunk") || p.starts_with("chunk");
        let two = |p: &str| two(p) && !p.ends_with("_3way");
        assert_eq!(pick(two), LayoutKind::Two);
        assert_eq!(
            move_aside(LayoutKind::Four, two),
            ["merged_chunk1", "merged_chunk2"]
        );
        // One of a pair is not enough to select its layout.
        assert_eq!(pick(|p| p == "merged_chunk1"), LayoutKind::Four);
        for kind in [
            LayoutKind::Four,
            LayoutKind::Three,
            LayoutKind::Two,
            LayoutKind::One,
        ] {
            let left = move_aside(kind, all);
            assert_eq!(pick(|p| !left.contains(&p)), kind, "{kind}");
        }
    }
}
