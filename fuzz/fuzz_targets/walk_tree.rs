//! Arbitrary folder trees through `hashing::walk` (what every command that
//! takes an input folder lists it with), `Tree::refuse_odd`, `hashing::entry_in`
//! and `package::copy_tree`. The input decodes into files, folders and
//! symlinks under arbitrary byte names (backslashes, `..\`, control
//! characters, non-UTF-8), and a few arbitrary relative paths. Invariants:
//!
//! - every path `walk` lists is made of plain components
//!   (`paths::check_rel_path`) and, joined to the root, names that very
//!   entry (a file is a regular file, a folder a folder, no symlink on the
//!   way): a name is never read as another path;
//! - every name that is not one plain component is in `bad_names`, or below
//!   one that is, and then `refuse_odd` refuses the tree;
//! - `entry_in` returns an entry only where no symlink is on the way;
//! - copying every listed file into a fresh folder creates nothing outside
//!   it, and the copies are the files' bytes.

#![no_main]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use chunkforge_fuzz::scratch;
use chunkforge_release::hashing;
use chunkforge_release::package::copy_tree;
use chunkforge_release::paths::{check_component, check_rel_path};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

/// One path component; the hostile names are offered directly.
#[derive(Arbitrary, Debug)]
enum Name {
    Escape,
    Backslashed,
    Newline,
    Plain,
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Kind {
    File(Vec<u8>),
    Dir,
    Symlink(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Node {
    path: Vec<Name>,
    kind: Kind,
}

#[derive(Arbitrary, Debug)]
struct Input {
    nodes: Vec<Node>,
    /// Paths asked of `entry_in`.
    asked: Vec<String>,
}

fn component(n: &Name) -> Vec<u8> {
    let c: &[u8] = match n {
        Name::Escape => b"..\\..\\..\\escaped",
        Name::Backslashed => b"swa\\cos_full.npy",
        Name::Newline => b"a\nb",
        Name::Plain => b"chunk1.mlpackage",
        Name::Raw(b) => b,
    };
    // What a file system can hold as one name.
    c.iter()
        .copied()
        .filter(|&b| b != b'/' && b != 0)
        .take(40)
        .collect()
}

/// The entry's path below the root (None: empty, or `.`/`..`, which the
/// file system does not let a name be).
fn rel_path(names: &[Name]) -> Option<PathBuf> {
    let mut p = PathBuf::new();
    for n in names.iter().take(4) {
        let c = component(n);
        if c.is_empty() || c == b"." || c == b".." {
            return None;
        }
        p.push(OsStr::from_bytes(&c));
    }
    (!p.as_os_str().is_empty()).then_some(p)
}

/// Whether `path` (absolute, below nothing but plain folders of `root`)
/// has a symlink or a non-folder on the way below `root`.
fn linked_on_the_way(root: &Path, rel: &Path) -> bool {
    let mut at = root.to_path_buf();
    let parts: Vec<_> = rel.components().collect();
    for (i, c) in parts.iter().enumerate() {
        at.push(c);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => return true,
            Ok(m) if i + 1 < parts.len() && !m.is_dir() => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
    false
}

fuzz_target!(|input: Input| {
    static N: AtomicU64 = AtomicU64::new(0);
    let case = scratch().join(format!("walk-{}", N.fetch_add(1, Ordering::Relaxed)));
    let root = case.join("root");
    std::fs::create_dir_all(&root).unwrap();
    let mut made: Vec<PathBuf> = Vec::new();
    for node in input.nodes.iter().take(24) {
        let Some(rel) = rel_path(&node.path) else {
            continue;
        };
        // Never write through something already made (a link, a file).
        if linked_on_the_way(&root, &rel) || root.join(&rel).symlink_metadata().is_ok() {
            continue;
        }
        let p = root.join(&rel);
        if let Some(parent) = p.parent() {
            if std::fs::create_dir_all(parent).is_err() {
                continue;
            }
        }
        let ok = match &node.kind {
            Kind::File(b) => std::fs::write(&p, b).is_ok(),
            Kind::Dir => std::fs::create_dir(&p).is_ok(),
            Kind::Symlink(t) => {
                let t: Vec<u8> = t.iter().copied().filter(|&b| b != 0).take(64).collect();
                !t.is_empty() && std::os::unix::fs::symlink(OsStr::from_bytes(&t), &p).is_ok()
            }
        };
        if ok {
            made.push(rel);
        }
    }

    let tree = hashing::walk(&root, &|_| false).expect("a folder this process made lists");
    let listed = tree
        .files
        .iter()
        .chain(&tree.dirs)
        .chain(&tree.symlinks)
        .chain(&tree.special);
    for rel in listed {
        assert_eq!(check_rel_path(rel), Ok(()), "walk listed {rel:?}");
        let p = root.join(rel);
        assert!(
            Path::new(rel)
                .components()
                .all(|c| matches!(c, Component::Normal(_))),
            "{rel:?}"
        );
        assert!(!linked_on_the_way(&root, Path::new(rel)) || tree.symlinks.contains(rel));
        let m = std::fs::symlink_metadata(&p).expect("a listed path names an entry");
        if tree.files.contains(rel) {
            assert!(m.file_type().is_file(), "{rel:?}");
        }
        if tree.dirs.contains(rel) {
            assert!(m.file_type().is_dir(), "{rel:?}");
        }
    }
    // Every made entry with a component that is not plain is named as bad
    // (itself or a folder above it), and nothing below one is listed.
    for rel in &made {
        // The walk holds the whole relative path to `check_rel_path`, so a
        // first component that reads as a drive letter (`i:`) is bad too.
        let bad_at = rel.components().enumerate().position(|(i, c)| {
            let s = c.as_os_str().to_str();
            s.is_none_or(|s| check_component(s).is_err() || (i == 0 && check_rel_path(s).is_err()))
        });
        if let Some(i) = bad_at {
            let prefix: PathBuf = rel.components().take(i + 1).collect();
            let shown = hashing::shown(&prefix.to_string_lossy());
            assert!(
                tree.bad_names.iter().any(|b| b.path == shown),
                "{prefix:?} not in bad_names {:?}",
                tree.bad_names
            );
        }
    }
    assert_eq!(
        tree.refuse_odd(&root).is_ok(),
        tree.bad_names.is_empty() && tree.symlinks.is_empty() && tree.special.is_empty()
    );

    for asked in input.asked.iter().take(8) {
        if let Ok(Some(_)) = hashing::entry_in(&root, asked) {
            assert_eq!(check_rel_path(asked), Ok(()));
            assert!(!linked_on_the_way(&root, Path::new(asked)), "{asked:?}");
        }
    }

    // The listed files copied: nothing outside the destination.
    let dest = case.join("copy");
    std::fs::create_dir(&dest).unwrap();
    let sources: Vec<(PathBuf, String)> = tree
        .files
        .iter()
        .map(|r| (root.join(r), r.clone()))
        .collect();
    if copy_tree(&dest, &sources, &tree.dirs).is_ok() {
        for (src, rel) in &sources {
            assert_eq!(
                std::fs::read(dest.join(rel)).ok(),
                std::fs::read(src).ok(),
                "{rel:?}"
            );
        }
    }
    let mut beside: Vec<_> = std::fs::read_dir(&case)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    beside.sort();
    assert_eq!(
        beside,
        ["copy", "root"],
        "a copy wrote beside its destination"
    );
    let _ = std::fs::remove_dir_all(&case);
});
