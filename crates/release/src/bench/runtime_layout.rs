//! What the app's runtime does with the decode layouts of a model folder
//! (facts of the upstream Swift runtime, `ChunkedEngine.swift`): the packages
//! each layout decodes with, which files make the runtime pick it, and how its
//! log names it, read from the layout table. `chunkforge run --layout auto`,
//! the device run book and `chunkforge device-report` all read it.

use std::sync::LazyLock;

pub use chunkforge_model::layouts::Runtime;
use chunkforge_model::layouts::{runtime_order, REFERENCE};
use chunkforge_model::plan::LayoutKind;

/// One decode layout as the runtime sees it: its row of the layout table
/// (`chunkforge_model::layouts`) with the package names spelled out.
#[derive(Debug)]
pub struct RuntimeLayout {
    pub kind: LayoutKind,
    /// The name the runtime's `[Load] Decode layout: NAME` line uses (and the
    /// device report).
    pub name: &'static str,
    /// The packages the runtime decodes with, in call order. The three-chunk
    /// decode starts with four's `chunk1` (it has no first package of its own).
    pub decode: Vec<String>,
    /// The packages whose presence (all of them) makes the runtime pick this
    /// layout; empty for the fallback.
    pub selected_by: Vec<String>,
    /// The tag of the `[Profile…]` line the runtime prints while decoding
    /// with this layout.
    pub profile_tag: &'static str,
    /// The runtime builds that load it.
    pub runtimes: Vec<Runtime>,
}

/// In the order the runtime tries them: the first whose `selected_by`
/// packages all exist wins. The upstream main branch prefers `chunk2_3way` +
/// `chunk3_3way` over chunk1..4; the merged-layout branch prefers
/// `merged_full` over `merged_chunk1` + `merged_chunk2` over chunk1..4. Each
/// ignores the other's files, so this order gives the same choice as either.
pub static RUNTIME_LAYOUTS: LazyLock<Vec<RuntimeLayout>> = LazyLock::new(|| {
    runtime_order()
        .into_iter()
        .filter_map(|l| {
            let rt = l.runtime?;
            Some(RuntimeLayout {
                kind: l.kind,
                name: rt.name,
                decode: l.decode_packages(),
                selected_by: l.selected_by(),
                profile_tag: profile_tag(rt.profile_line),
                runtimes: l.runtimes(),
            })
        })
        .collect()
});

/// The tag of a `[Profile…]` line template: its text up to the first space.
pub fn profile_tag(line: &'static str) -> &'static str {
    line.split(' ').next().unwrap_or(line)
}

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
        .map_or(REFERENCE, |l| l.kind)
}

/// The layout runtime build `rt` picks in a folder where `has(package)`
/// says which packages exist: the first of its own layouts, in its order,
/// whose packages are all there (main: three > four; the branch: one > two >
/// four), ignoring what only the other build loads.
pub fn pick_for(rt: Runtime, has: impl Fn(&str) -> bool) -> LayoutKind {
    RUNTIME_LAYOUTS
        .iter()
        .filter(|l| l.runtimes.contains(&rt))
        .find(|l| l.selected_by.iter().all(|p| has(p)))
        .map_or(REFERENCE, |l| l.kind)
}

/// The layouts runtime build `rt` loads, in its order, by name.
pub fn loaded_by(rt: Runtime) -> Vec<&'static str> {
    RUNTIME_LAYOUTS
        .iter()
        .filter(|l| l.runtimes.contains(&rt))
        .map(|l| l.kind.as_str())
        .collect()
}

/// The packages to move out of a folder holding `has(package)` so that the
/// runtime picks `kind`: every present package that selects a layout the
/// runtime would try first. Empty when it already picks `kind`.
pub fn move_aside(kind: LayoutKind, has: impl Fn(&str) -> bool) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for l in RUNTIME_LAYOUTS.iter().take_while(|l| l.kind != kind) {
        for p in &l.selected_by {
            if has(p) && !out.contains(&p.as_str()) {
                out.push(p);
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
        // Each build by its own rules: main ignores merged packages, the
        // branch the three-chunk pair.
        assert_eq!(pick_for(Runtime::Main, all), LayoutKind::Three);
        assert_eq!(pick_for(Runtime::Merged, all), LayoutKind::One);
        assert_eq!(pick_for(Runtime::Main, two), LayoutKind::Four);
        assert_eq!(pick_for(Runtime::Merged, two), LayoutKind::Two);
        assert_eq!(loaded_by(Runtime::Main), ["three", "four"]);
        assert_eq!(loaded_by(Runtime::Merged), ["one", "two", "four"]);
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
