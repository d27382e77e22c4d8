//! A release folder's fixed names, and the rule every relative path in a
//! manifest, signature or archive must meet. It depends on nothing in the
//! crate, so that the manifest, the archive reader and `package` can all
//! use it without importing one another.

/// The checkpoint files `hf_model/` ships when the checkpoint has them (what
/// swift-transformers' `AutoTokenizer.from(modelFolder:)` reads, and the
/// config it dispatches on).
pub const HF_MODEL_FILES: &[&str] = &[
    "config.json",
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "chat_template.jinja",
];
pub const HF_MODEL_DIR: &str = "hf_model";
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The device bench's run book, at the release root.
pub const RUNBOOK_FILE: &str = "DEVICE_RUNBOOK.md";

/// Upstream's per-file distribution manifest, at the release root.
pub const DISTRIBUTION_FILE: &str = "distribution.json";

/// Why one file name is not a plain path component, if it is not: what
/// every name met while walking a folder, and every component of a relative
/// path, must be. A backslash is an ordinary character on Linux, but a path
/// separator to Windows, to some unzip tools and URL parsers, and to any
/// code that turns it into `/`; a control character (a newline above all)
/// breaks every line-oriented listing (`sha256sum`, logs).
pub fn check_component(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("has an empty component");
    }
    if name == ".." {
        return Err("contains '..'");
    }
    if name == "." {
        return Err("has a '.' component");
    }
    if name.contains('/') {
        return Err("contains a slash");
    }
    if name.contains('\\') {
        return Err("contains a backslash");
    }
    if name.contains('\0') {
        return Err("contains a NUL byte");
    }
    if name.chars().any(char::is_control) {
        return Err("contains a control character");
    }
    Ok(())
}

/// Why a relative path in a manifest, signature or archive is unsafe, if it is:
/// empty, absolute, a drive letter, or a component that is not plain
/// ([`check_component`]: `..`, `.`, empty, a backslash, NUL, a control
/// character).
pub fn check_rel_path(p: &str) -> Result<(), &'static str> {
    if p.is_empty() {
        return Err("is empty");
    }
    if p.starts_with('/') {
        return Err("is absolute");
    }
    let b = p.as_bytes();
    if b.len() >= 2 && b[1] == b':' && b[0].is_ascii_alphabetic() {
        return Err("starts with a drive letter");
    }
    for c in p.split('/') {
        check_component(c)?;
    }
    Ok(())
}

/// Where `path` is or will be once its missing folders are created: the
/// longest existing ancestor resolved (symlinks, `..`), the rest appended
/// (a `..` there undoes the folder before it, which will be created real).
/// What two paths are compared by when one must not be inside the other.
pub fn canonical_target(path: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
    let abs = std::path::absolute(path)?;
    let (mut base, rest) = abs
        .ancestors()
        .find_map(|a| {
            let c = a.canonicalize().ok()?;
            Some((c, abs.strip_prefix(a).ok()?.to_path_buf()))
        })
        .ok_or_else(|| std::io::Error::other("no ancestor of the path exists"))?;
    for c in rest.components() {
        match c {
            std::path::Component::ParentDir => {
                base.pop();
            }
            std::path::Component::Normal(n) => base.push(n),
            _ => {}
        }
    }
    Ok(base)
}

/// Whether `inner` is `outer` or lies inside it, once both are resolved
/// ([`canonical_target`]); false when either cannot be resolved.
pub fn inside(inner: &std::path::Path, outer: &std::path::Path) -> bool {
    match (canonical_target(inner), canonical_target(outer)) {
        (Ok(i), Ok(o)) => i.starts_with(o),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_paths() {
        for bad in [
            "",
            "/etc/passwd",
            "a/../b",
            "..",
            "a//b",
            "./a",
            "a\\b",
            "..\\..\\x",
            "swa\\cos_full.npy",
            "C:x",
            "a/b\nc",
            "a/\u{7f}",
        ] {
            assert!(check_rel_path(bad).is_err(), "{bad}");
        }
        for good in [
            "a",
            "a/b.c",
            "merged_full.mlpackage/Manifest.json",
            "..a",
            "a..",
        ] {
            assert!(check_rel_path(good).is_ok(), "{good}");
        }
    }
}
