//! The crate's modules form no cycle (docs/architecture.md draws the graph):
//! read from the sources, so a new `use crate::…` that closes a loop fails
//! here, naming it. Test modules (`#[cfg(test)] mod tests`) may use anything.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// Module path (`manifest`, `bench::runbook`) → the crate modules it uses.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for entry in fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            files.extend(fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else {
            files.push(p);
        }
    }
    let mut g = BTreeMap::new();
    for f in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "rs"))
    {
        let rel = f.strip_prefix(&src).unwrap().with_extension("");
        let name = rel.to_string_lossy().replace('/', "::");
        let name = name.trim_end_matches("::mod").to_string();
        if name == "lib" {
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
                let path: String = code[i + prefix.len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                let mut parts = path.split("::").filter(|s| !s.is_empty());
                let Some(first) = parts.next() else { continue };
                let module = match base {
                    Some(b) => format!("{b}::{first}"),
                    None if first == "bench" => match parts.next() {
                        Some(second) => format!("bench::{second}"),
                        None => "bench".into(),
                    },
                    None => first.to_string(),
                };
                if module != name {
                    uses.insert(module);
                }
            }
        }
        g.insert(name, uses);
    }
    g
}

#[test]
fn the_modules_form_no_cycle() {
    let g = graph();
    assert!(
        g.contains_key("manifest") && g.contains_key("bench::runbook"),
        "{g:?}"
    );
    // Depth-first search; a back edge is a cycle.
    fn visit(
        g: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) {
        if let Some(i) = path.iter().position(|p| p == at) {
            panic!("module cycle: {} -> {at}", path[i..].join(" -> "));
        }
        if !done.insert(at.to_string()) {
            return;
        }
        path.push(at.to_string());
        for next in g.get(at).into_iter().flatten() {
            if g.contains_key(next) {
                visit(g, next, path, done);
            }
        }
        path.pop();
    }
    let mut done = BTreeSet::new();
    for m in g.keys() {
        visit(&g, m, &mut Vec::new(), &mut done);
    }
}
