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

/// Why a relative path in a manifest, signature or archive is unsafe, if it is.
pub fn check_rel_path(p: &str) -> Result<(), &'static str> {
    if p.is_empty() {
        return Err("is empty");
    }
    if p.starts_with('/') {
        return Err("is absolute");
    }
    if p.contains('\\') {
        return Err("contains a backslash");
    }
    if p.contains('\0') {
        return Err("contains a NUL byte");
    }
    let b = p.as_bytes();
    if b.len() >= 2 && b[1] == b':' && b[0].is_ascii_alphabetic() {
        return Err("starts with a drive letter");
    }
    for c in p.split('/') {
        match c {
            ".." => return Err("contains '..'"),
            "." | "" => return Err("has an empty or '.' component"),
            _ => {}
        }
    }
    Ok(())
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
            "C:x",
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
