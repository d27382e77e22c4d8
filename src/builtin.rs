//! The built-in default checkpoint, used when neither `--hf-dir` nor
//! `GEMMA4_HF_DIR` is given: a small *trained* Gemma 4 with E2B's layer
//! structure, shipped in the repository (`checkpoints/default/`, made by
//! `python/chunkforge_py/train.py`). Its folder holds
//! `checkpoint-manifest.json`, which names every file with its SHA-256 and
//! says how the weights were trained; a folder whose files are not exactly
//! those (a file changed, missing, added, or a Git LFS pointer in place of
//! the weights) is refused before anything reads it.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::hashing;

/// The checkpoint's folder in the repository.
pub const DIR: &str = "checkpoints/default";
/// The manifest in that folder.
pub const MANIFEST: &str = "checkpoint-manifest.json";

/// `checkpoint-manifest.json`: every other file of the folder by name, with
/// its SHA-256 (hex), and the training record (train.py `write_manifest`).
#[derive(Debug, Deserialize)]
pub struct CheckpointManifest {
    pub files: BTreeMap<String, String>,
    pub training: serde_json::Value,
}

/// Where the built-in checkpoint lives: the repository this binary was
/// built from (as `python/`, [`crate::py::env::python_dir`]).
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(DIR)
}

/// The built-in checkpoint's folder, its files checked against its manifest.
pub fn checkpoint() -> Result<PathBuf> {
    let d = dir();
    check(&d)?;
    Ok(d)
}

/// Reads `dir`'s manifest and holds every file of the folder to it: each
/// named file present with the named SHA-256, no other file. Returns the
/// manifest.
pub fn check(dir: &Path) -> Result<CheckpointManifest> {
    let path = dir.join(MANIFEST);
    let text = fs::read(&path).with_context(|| {
        format!(
            "{}: cannot read the built-in checkpoint's manifest",
            path.display()
        )
    })?;
    let manifest: CheckpointManifest = serde_json::from_slice(&text)
        .with_context(|| format!("{}: not a checkpoint manifest", path.display()))?;
    let again = "check the folder out again (`git checkout -- checkpoints/default`; with Git LFS, `git lfs pull`)";
    for (name, want) in &manifest.files {
        let file = dir.join(name);
        if !file.is_file() {
            bail!(
                "{}: missing from the built-in checkpoint ({} names it); {again}",
                file.display(),
                path.display()
            );
        }
        let got = hashing::sha256_file(&file)?;
        if &got != want {
            bail!(
                "{}: sha256 {got}, but {} names {want}: not the built-in checkpoint's file; {again}",
                file.display(),
                path.display()
            );
        }
    }
    for entry in fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name != MANIFEST && !manifest.files.contains_key(&name) {
            bail!(
                "{}: not a file of the built-in checkpoint ({} does not name it); remove it",
                dir.join(&name).display(),
                path.display()
            );
        }
    }
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy_of(tag: &str) -> PathBuf {
        let to =
            std::env::temp_dir().join(format!("chunkforge-builtin-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&to);
        fs::create_dir_all(&to).unwrap();
        for e in fs::read_dir(dir()).unwrap() {
            let e = e.unwrap();
            fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
        to
    }

    /// The shipped files are the ones the manifest names, and it names the
    /// weights, config and tokenizer.
    #[test]
    fn shipped_files_are_the_ones_the_manifest_names() {
        let m = check(&dir()).unwrap();
        for f in ["model.safetensors", "config.json", "tokenizer.json"] {
            assert!(m.files.contains_key(f), "{f}: {:?}", m.files.keys());
        }
        assert!(m.training["steps"].as_u64().unwrap() > 0, "{}", m.training);
    }

    /// A changed byte, a missing file and an extra file are each refused,
    /// naming the file.
    #[test]
    fn a_changed_missing_or_extra_file_is_refused_by_name() {
        let d = copy_of("changed");
        let weights = d.join("model.safetensors");
        let mut bytes = fs::read(&weights).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        fs::write(&weights, &bytes).unwrap();
        let e = format!("{:#}", check(&d).unwrap_err());
        assert!(
            e.contains("model.safetensors: sha256") && e.contains("names"),
            "{e}"
        );
        fs::remove_file(&weights).unwrap();
        let e = format!("{:#}", check(&d).unwrap_err());
        assert!(e.contains("model.safetensors: missing"), "{e}");
        fs::remove_dir_all(&d).unwrap();

        let d = copy_of("extra");
        fs::write(d.join("notes.txt"), "x").unwrap();
        let e = format!("{:#}", check(&d).unwrap_err());
        assert!(
            e.contains("notes.txt: not a file of the built-in checkpoint"),
            "{e}"
        );
        fs::remove_dir_all(&d).unwrap();
    }
}
