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
