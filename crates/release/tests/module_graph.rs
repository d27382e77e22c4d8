//! No module graph of the workspace has a cycle (docs/architecture.md draws
//! them): the binary's `src/` and the two pure crates, read from the sources,
//! so a new `use crate::…` that closes a loop fails here, naming it. Test
//! modules (`#[cfg(test)] mod tests`, `palette/tests.rs`) may use anything,
//! and a module's use of its parent (`super::`) is not an edge (a module and
//! its submodules are one unit). The only cycles allowed are named in
//! [`ALLOWED`].

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Cycles allowed, each with why: a group of modules (of the crate named
/// as `crate_`) any cycle may lie within.
const ALLOWED: &[(&str, &[&str], &str)] = &[(
    "src",
    &["palette::prefix", "palette::search", "palette::simd"],
    "the INT4 kernel's three parts share constants and one another's row \
     searches; one algorithm split into files by size, not three layers",
)];

/// Every `.rs` file under `dir`, at any depth.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Module path (`manifest`, `bench::runbook`, `py::calls`) → the crate
/// modules it uses, of the crate whose sources are `src`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let name_of = |f: &Path| {
        let rel = f.strip_prefix(src).unwrap().with_extension("");
        let name = rel.to_string_lossy().replace('/', "::");
        name.trim_end_matches("::mod").to_string()
    };
    let modules: BTreeSet<String> = files.iter().map(|f| name_of(f)).collect();
    let mut g = BTreeMap::new();
    for f in &files {
        let name = name_of(f);
        if ["lib", "main"].contains(&name.as_str()) || name.ends_with("::tests") {
            continue;
        }
        let parent = name.rsplit_once("::").map(|(p, _)| p.to_string());
        let text = fs::read_to_string(f).unwrap();
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
        let code: String = code
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let mut uses = BTreeSet::new();
        for (prefix, base) in [("crate::", None), ("super::", parent.as_deref())] {
            for (i, _) in code.match_indices(prefix) {
                // `crate::` inside `super::…::crate` or an identifier ending in it.
                if code[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
                    continue;
                }
                let path: String = code[i + prefix.len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                let parts: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
                // The longest prefix of the path that is a module of the crate.
                let full = |n: usize| {
                    let tail = parts[..n].join("::");
                    match base {
                        Some(b) => format!("{b}::{tail}"),
                        None => tail,
                    }
                };
                let Some(module) = (1..=parts.len())
                    .rev()
                    .map(full)
                    .find(|m| modules.contains(m))
                else {
                    continue;
                };
                let ancestor = name.starts_with(&format!("{module}::"));
                if module != name && !ancestor {
                    uses.insert(module);
                }
            }
        }
        g.insert(name, uses);
    }
    g
}

/// Every cycle of `g` found by a depth-first search (a back edge closes one),
/// each as its modules sorted.
fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<Vec<String>> {
    fn visit(
        g: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut BTreeSet<Vec<String>>,
    ) {
        if let Some(i) = path.iter().position(|p| p == at) {
            let mut cycle = path[i..].to_vec();
            cycle.sort();
            found.insert(cycle);
            return;
        }
        if done.contains(at) {
            return;
        }
        path.push(at.to_string());
        for next in g.get(at).into_iter().flatten() {
            if g.contains_key(next) {
                visit(g, next, path, done, found);
            }
        }
        path.pop();
        done.insert(at.to_string());
    }
    let mut done = BTreeSet::new();
    let mut found = BTreeSet::new();
    for m in g.keys() {
        visit(g, m, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

/// The cycles of the crate at `root` (relative to this crate) not in [`ALLOWED`].
fn unexplained(root: &str, expect: &[&str]) -> Vec<Vec<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(root).join("src");
    let g = graph(&src);
    for m in expect {
        assert!(g.contains_key(*m), "{root}: no module {m}: {g:?}");
    }
    let label = if root == "../.." { "src" } else { root };
    cycles(&g)
        .into_iter()
        .filter(|c| {
            !ALLOWED.iter().any(|(crate_, group, _)| {
                *crate_ == label && c.iter().all(|m| group.contains(&m.as_str()))
            })
        })
        .collect()
}

#[test]
fn the_release_crate_has_no_cycle() {
    let found = unexplained(".", &["manifest", "bench::runbook"]);
    assert!(found.is_empty(), "module cycles: {found:?}");
}

#[test]
fn the_model_crate_has_no_cycle() {
    let found = unexplained("../model", &["plan", "records"]);
    assert!(found.is_empty(), "module cycles: {found:?}");
}

#[test]
fn the_binary_has_no_cycle_but_the_named_ones() {
    let found = unexplained(
        "../..",
        &["py::calls", "py::contract", "commands::build", "cli"],
    );
    assert!(
        found.is_empty(),
        "module cycles in src/ (break them, or name one in ALLOWED with why): {found:#?}"
    );
}

/// The guard itself: a cycle is found and named, a module's use of its
/// parent is not one.
#[test]
fn a_cycle_is_found() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(
        cycles(&g),
        BTreeSet::from([vec!["a".to_string(), "b".into(), "c".into()]])
    );
}
