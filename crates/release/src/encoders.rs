//! `package --encoders-from DIR`: the app's multimodal encoder files,
//! carried from an existing bundle (chunkforge converts no encoders). DIR is
//! an upstream bundle in its repository or local layout (the encoders sit at
//! the root in both) or a chunkforge release that carries them. Only the
//! files the app requests are taken ([`downloader::all_encoder_files`]), and
//! each is checked against its list before anything is written:
//!
//! - every file that every entry requires (the branch's list, which cannot
//!   be turned off) is there, non-empty;
//! - a compiled encoder's `model.mil` is text MIL (the iPhone rejects the
//!   binary kind);
//! - a file only some entry requires (main's `vision_video.mlmodelc`) is
//!   carried when present, and its absence is reported, not refused.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::downloader::{self, EncoderFile, ENTRIES};
use crate::hashing;

/// The encoder files of one bundle, ready to copy.
pub struct EncoderSources {
    /// (source file, path in the release), in the app's order.
    pub files: Vec<(PathBuf, String)>,
    /// The folders to create in the release.
    pub dirs: Vec<String>,
    /// Encoders some entry requests that the bundle lacks, with the entries.
    pub absent: Vec<(EncoderFile, Vec<String>)>,
}

/// Whether `local` may 404 in every entry's download.
fn optional_everywhere(local: &str) -> bool {
    ENTRIES.iter().all(|e| e.optional_404(local))
}

/// Reads and checks the encoder files of `dir`.
pub fn encoder_sources(dir: &Path) -> Result<EncoderSources> {
    if !dir.is_dir() {
        bail!(
            "{}: --encoders-from: not a folder (an upstream bundle or release holding vision.mlmodelc, audio.mlmodelc, …)",
            dir.display()
        );
    }
    let mut out = EncoderSources {
        files: Vec::new(),
        dirs: Vec::new(),
        absent: Vec::new(),
    };
    for enc in downloader::all_encoder_files() {
        let needed_by: Vec<String> = ENTRIES
            .iter()
            .filter(|e| e.multimodal.contains(&enc))
            .map(|e| e.client.to_string())
            .collect();
        let everyone = needed_by.len() == ENTRIES.len();
        let present = hashing::entry_in(dir, enc.path)?.is_some();
        if !present && !everyone {
            out.absent.push((enc, needed_by));
            continue;
        }
        for rel in enc.requests() {
            let src = dir.join(&rel);
            // No symlink anywhere on the way: a linked encoder folder or
            // file would carry a file from outside DIR into the release.
            let meta = match hashing::entry_in(dir, &rel)? {
                Some(m) => m,
                None if optional_everywhere(&rel) => continue,
                None => bail!(
                    "{}: --encoders-from: missing; the app requests it ({} encoder{}) and aborts the download without it",
                    src.display(),
                    enc.role,
                    if everyone {
                        ", on every entry".to_string()
                    } else {
                        format!(", on {}", needed_by.join(", "))
                    }
                ),
            };
            if !meta.is_file() {
                bail!("{}: --encoders-from: not a regular file", src.display());
            }
            if meta.len() == 0 && !optional_everywhere(&rel) {
                bail!("{}: --encoders-from: empty", src.display());
            }
            if rel.ends_with(".mlmodelc/model.mil") {
                let text =
                    fs::read(&src).with_context(|| format!("{}: cannot read", src.display()))?;
                if std::str::from_utf8(&text).is_err() {
                    bail!(
                        "{}: --encoders-from: a binary model.mil (as `xcrun coremlcompiler` writes); the iPhone rejects it: recompile with coremltools' get_compiled_model_path()",
                        src.display()
                    );
                }
            }
            if let Some((parent, _)) = rel.rsplit_once('/') {
                if !out.dirs.iter().any(|d| d == parent) {
                    out.dirs.push(parent.to_string());
                }
            }
            out.files.push((src, rel));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, rel: &str, bytes: &[u8]) {
        let p = dir.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, bytes).unwrap();
    }

    #[test]
    fn encoders_are_checked_against_the_apps_list() {
        let dir = std::env::temp_dir().join(format!("cf-encoders-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        for e in downloader::entry(downloader::Client::Branch).multimodal {
            for r in e.requests() {
                // The descriptive files may be absent (404-optional).
                if !r.ends_with("metadata.json") {
                    write(&dir, &r, b"program(1.3)\n");
                }
            }
        }
        let s = encoder_sources(&dir).unwrap();
        // 2 models x 4 files + 5 plain files; vision_video (main only) absent.
        assert_eq!(s.files.len(), 2 * 4 + 5);
        assert_eq!(s.absent.len(), 1);
        assert_eq!(s.absent[0].0.path, "vision_video.mlmodelc");
        assert!(s.dirs.contains(&"audio.mlmodelc/analytics".to_string()));
        // A binary model.mil, a missing required file: refused, named.
        write(&dir, "audio.mlmodelc/model.mil", &[0xff, 0xfe, 0x00]);
        let e = encoder_sources(&dir).err().unwrap().to_string();
        assert!(
            e.contains("audio.mlmodelc/model.mil") && e.contains("binary"),
            "{e}"
        );
        write(&dir, "audio.mlmodelc/model.mil", b"program(1.3)\n");
        fs::remove_file(dir.join("mel_filterbank.bin")).unwrap();
        let e = encoder_sources(&dir).err().unwrap().to_string();
        assert!(
            e.contains("mel_filterbank.bin: --encoders-from: missing"),
            "{e}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
