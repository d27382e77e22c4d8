//! `distribution.json`: upstream's per-file distribution manifest, the
//! format `conversion/build_hf_release.py` writes (RUNTIME.md, "The
//! downloader"): `{version, model_id, mode: "per-file", repo, branch,
//! total_size, files: [{path, url, size_bytes, sha256}]}`, each file at its
//! path in the app's repository with the URL it is served from
//! (`--base-url`). `model_id` is the repository's name, as upstream
//! writes it, when `--base-url` is a Hugging Face `resolve/BRANCH` URL, and
//! the release's model id otherwise (there is no repository name then).
//!
//! It is written beside `manifest.json` when `--base-url` is given, listed
//! in `manifest.json` and signed with the rest, so it lists every file of
//! the release but `manifest.json`, `model.sig` and itself (a file cannot
//! carry the digest of a file that carries its own); those two are served
//! beside it, at `BASE/manifest.json` and `BASE/model.sig`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::hashing::FileDigest;

/// `distribution.json`. Members are written in this order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(
    deny_unknown_fields,
    title = "per-file distribution manifest (distribution.json)",
    description = "The format of upstream CoreML-LLM's conversion/build_hf_release.py (mode per-file): every file of the release at its repository path with its URL, size and SHA-256, except manifest.json, model.sig and distribution.json itself."
)]
pub struct Distribution {
    pub version: String,
    pub model_id: String,
    #[schemars(extend("const" = "per-file"))]
    pub mode: String,
    /// The Hugging Face repository (`owner/name`) when `--base-url` is one's `resolve/BRANCH` URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<String>,
    /// The sum of `files[].size_bytes`.
    pub total_size: u64,
    pub files: Vec<DistributionFile>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct DistributionFile {
    pub path: String,
    #[schemars(pattern("^https?://"))]
    pub url: String,
    pub size_bytes: u64,
    #[schemars(pattern("^[0-9a-f]{64}$"))]
    pub sha256: String,
}

/// Why `--base-url` cannot serve the release's files, if it cannot. Each
/// file's URL is the base, `/`, and its path, so the base must be a plain
/// `http(s)://HOST[:PORT][/PATH]`: ASCII only (no control character, no
/// zero-width or other invisible character), a host of letters, digits,
/// `-` and `.` (no user info: `user@`, or `\@` that URL parsers read in
/// different ways), a path of unreserved characters, `/` and `%XX` escapes,
/// and no `?query` or `#fragment` (each file's path would land inside it).
pub fn check_base_url(url: &str) -> Result<(), String> {
    if let Some(c) = url.chars().find(|c| !c.is_ascii() || c.is_ascii_control()) {
        return Err(format!(
            "holds {}: a URL is printable ASCII (escape others as %XX)",
            if c.is_control() || !c.is_ascii() {
                format!("the character U+{:04X}", c as u32)
            } else {
                format!("'{c}'")
            }
        ));
    }
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or("is not an http(s) URL (http:// or https://)")?;
    if let Some(c) = rest.chars().find(|c| matches!(c, '?' | '#')) {
        return Err(format!(
            "has a {}: each file's URL is the base, '/' and its path, which would land inside it",
            if c == '?' { "?query" } else { "#fragment" }
        ));
    }
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (authority, None),
    };
    if host.is_empty() {
        return Err("has no host".into());
    }
    if let Some(c) = host
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '.')))
    {
        return Err(format!(
            "has '{c}' in its host '{authority}': a host is letters, digits, '-' and '.' (no user info, no backslash)"
        ));
    }
    if host.starts_with(['.', '-']) || host.ends_with('-') || host.contains("..") {
        return Err(format!("has no valid host name ('{host}')"));
    }
    if let Some(p) = port {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) || p.parse::<u16>().is_err() {
            return Err(format!("has the port '{p}', not a number up to 65535"));
        }
    }
    let bytes = path.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let hex = bytes.get(i + 1..i + 3);
            if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
                return Err("has a '%' not followed by two hex digits in its path".into());
            }
            i += 3;
            continue;
        }
        if !(b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/' | b'+')) {
            return Err(format!(
                "has '{}' in its path: use letters, digits, '-', '.', '_', '~', '+', '/' and %XX escapes",
                b as char
            ));
        }
        i += 1;
    }
    if path.split('/').any(|c| c == "." || c == "..") {
        return Err("has a '.' or '..' segment in its path".into());
    }
    Ok(())
}

/// (repo, branch) of a Hugging Face `https://huggingface.co/OWNER/NAME/resolve/BRANCH` URL.
fn hf_repo(base_url: &str) -> Option<(String, String)> {
    let rest = base_url
        .trim_end_matches('/')
        .strip_prefix("https://huggingface.co/")?;
    let parts: Vec<&str> = rest.split('/').collect();
    match parts.as_slice() {
        [owner, name, "resolve", branch] => Some((format!("{owner}/{name}"), branch.to_string())),
        _ => None,
    }
}

impl Distribution {
    /// The distribution manifest of `files` (release path, digest; sorted)
    /// served from `base_url`. `model_id` is the repository's name when
    /// `base_url` is a Hugging Face repository's, as upstream writes it
    /// (`Path(repo).name`); elsewhere there is no repository name, and the
    /// release's model id (`release_model_id`) stands in.
    pub fn of(
        files: &[(String, FileDigest)],
        base_url: &str,
        version: &str,
        release_model_id: &str,
    ) -> Self {
        let (repo, branch) = hf_repo(base_url).unzip();
        let model_id = repo
            .as_deref()
            .and_then(|r| r.rsplit('/').next())
            .unwrap_or(release_model_id);
        Distribution {
            version: version.into(),
            model_id: model_id.into(),
            mode: "per-file".into(),
            repo,
            branch,
            total_size: files.iter().map(|(_, d)| d.size).sum(),
            files: files
                .iter()
                .map(|(p, d)| DistributionFile {
                    path: p.clone(),
                    url: crate::manifest::file_url(base_url, p),
                    size_bytes: d.size,
                    sha256: d.hex(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_that_cannot_serve_the_files_are_refused() {
        for good in [
            "https://huggingface.co/me/model/resolve/main",
            "https://huggingface.co/me/model/resolve/main/",
            "http://localhost:8080",
            "https://cdn.example.com/a%20b/v1.0_x~y+z",
        ] {
            assert_eq!(check_base_url(good), Ok(()), "{good}");
        }
        for (bad, says) in [
            ("https://h/x#frag", "#fragment"),
            ("https://h/x?a=b", "?query"),
            ("https://", "no host"),
            ("https:///path", "no host"),
            ("https://h/\"x\"", "'\"'"),
            ("https://h/<script>", "'<'"),
            ("https://h\\@evil.com/x", "'\\'"),
            ("https://user@h/x", "'@'"),
            ("https://h/x\ny", "U+000A"),
            ("https://h/a\u{200b}b", "U+200B"),
            ("https://h/a b", "' '"),
            ("https://h:99999/x", "port"),
            ("https://h/%zz", "hex digits"),
            ("https://h/../x", "'..'"),
            ("ftp://h/x", "not an http"),
        ] {
            let e = check_base_url(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn hugging_face_urls_name_their_repository_and_branch() {
        assert_eq!(
            hf_repo("https://huggingface.co/org/gemma-coreml/resolve/main/"),
            Some(("org/gemma-coreml".into(), "main".into()))
        );
        assert_eq!(hf_repo("https://example.com/models/x"), None);
        assert_eq!(hf_repo("https://huggingface.co/org/x/blob/main"), None);
    }

    /// Upstream's build_hf_release.py: `"model_id": Path(repo).name`.
    #[test]
    fn model_id_is_the_repository_name_as_upstream_writes_it() {
        let d = Distribution::of(
            &[],
            "https://huggingface.co/org/gemma-4-E2B-coreml/resolve/n1024",
            "1.0.0",
            "e2b",
        );
        assert_eq!(d.model_id, "gemma-4-E2B-coreml");
        assert_eq!(d.branch.as_deref(), Some("n1024"));
        let d = Distribution::of(&[], "https://models.example.com/e2b/1.0.0", "1.0.0", "e2b");
        assert_eq!((d.model_id.as_str(), d.repo.as_deref()), ("e2b", None));
    }
}
