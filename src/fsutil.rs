//! Crash-safe output: everything is written under a staging folder inside the
//! output folder and renamed into place only when complete, so a failed or
//! killed run leaves the previous outputs as they were.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::pyenv::hex;

const STAGING_PREFIX: &str = ".chunkforge-staging-";

/// Staging folders of this process, removed by the Ctrl-C handler.
static LIVE_STAGING: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Held while a run moves its finished outputs into place; the interrupt
/// handler waits for it, so Ctrl-C never splits a set of packages.
pub static PUBLISH_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Installs the Ctrl-C / SIGTERM handler: wait for any publish in progress,
/// remove this run's staging folders, say so, exit 130.
pub fn install_interrupt_handler() {
    let _ = ctrlc::set_handler(|| {
        let _publishing = PUBLISH_LOCK.lock();
        let dirs = LIVE_STAGING.lock().map(|v| v.clone()).unwrap_or_default();
        for d in &dirs {
            // The main thread may still be writing into it: retry until it is gone.
            for _ in 0..20 {
                if fs::remove_dir_all(d).is_ok() || !d.exists() {
                    break;
                }
            }
        }
        eprintln!(
            "\ninterrupted: unfinished work removed; the output folder holds the previous result \
             (or the complete new one if it was already published)"
        );
        // _exit, not exit: no atexit handlers, so the embedded interpreter (busy
        // on the main thread) is not finalised under its own feet.
        // SAFETY: _exit only terminates the process.
        unsafe { libc::_exit(130) }
    });
}

/// A staging folder in `out`; removed on drop unless committed.
pub struct Staging {
    pub out: PathBuf,
    pub dir: PathBuf,
    committed: bool,
}

fn pid_alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

impl Staging {
    pub fn new(out: &Path) -> Result<Self> {
        if out.exists() && !out.is_dir() {
            bail!("{}: output path exists and is not a folder", out.display());
        }
        fs::create_dir_all(out)
            .with_context(|| format!("{}: cannot create the output folder", out.display()))?;
        clean_stale(out);
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = out.join(format!("{STAGING_PREFIX}{}-{stamp}", std::process::id()));
        fs::create_dir(&dir).with_context(|| {
            format!(
                "{}: cannot write into the output folder (read-only?)",
                out.display()
            )
        })?;
        if let Ok(mut live) = LIVE_STAGING.lock() {
            live.push(dir.clone());
        }
        Ok(Staging {
            out: out.to_path_buf(),
            dir,
            committed: false,
        })
    }

    /// Moves `name` from staging into `out`, replacing an existing entry of that name.
    pub fn publish(&self, name: &str) -> Result<()> {
        let from = self.dir.join(name);
        let to = self.out.join(name);
        replace(&from, &to)
    }

    pub fn finish(mut self) -> Result<()> {
        self.committed = true;
        fs::remove_dir_all(&self.dir).with_context(|| format!("removing {}", self.dir.display()))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.dir);
        }
        if let Ok(mut live) = LIVE_STAGING.lock() {
            live.retain(|d| d != &self.dir);
        }
    }
}

/// Removes staging folders left by runs that were killed.
pub fn clean_stale(out: &Path) {
    let Ok(entries) = fs::read_dir(out) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(rest) = name.strip_prefix(STAGING_PREFIX) {
            let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|p| p != std::process::id() && !pid_alive(p)) {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Renames `from` onto `to`. An existing `to` is first moved aside and deleted
/// only after the new one is in place.
pub fn replace(from: &Path, to: &Path) -> Result<()> {
    if to.exists() || to.is_symlink() {
        let aside = to.with_file_name(format!(
            "{STAGING_PREFIX}{}-old-{}",
            std::process::id(),
            to.file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default()
        ));
        fs::rename(to, &aside)
            .with_context(|| format!("moving the previous {} aside", to.display()))?;
        fs::rename(from, to).with_context(|| format!("moving {} into place", to.display()))?;
        if aside.is_dir() {
            let _ = fs::remove_dir_all(&aside);
        } else {
            let _ = fs::remove_file(&aside);
        }
    } else {
        fs::rename(from, to).with_context(|| format!("moving {} into place", to.display()))?;
    }
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file in the same folder.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        path.file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default(),
        std::process::id()
    ));
    let mut f =
        fs::File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("{}: write failed", tmp.display()))?;
    f.sync_all().ok();
    drop(f);
    fs::rename(&tmp, path).with_context(|| format!("{}: cannot move into place", path.display()))
}

/// SHA-256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("{}: read failed", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// SHA-256 of every regular file below `root`, by relative path.
pub fn file_digests(root: &Path) -> Result<std::collections::BTreeMap<String, String>> {
    let mut files = std::collections::BTreeMap::new();
    for e in walkdir::WalkDir::new(root) {
        let e = e.with_context(|| format!("walking {}", root.display()))?;
        if e.file_type().is_file() {
            let rel = e
                .path()
                .strip_prefix(root)
                .unwrap_or(e.path())
                .to_string_lossy()
                .to_string();
            files.insert(rel, sha256_file(e.path())?);
        }
    }
    Ok(files)
}

/// Digest of a folder tree: SHA-256 over `path\0sha256\n` lines of every file,
/// sorted by relative path.
pub fn tree_digest(root: &Path) -> Result<String> {
    let lines: String = file_digests(root)?
        .iter()
        .map(|(rel, h)| format!("{rel}\0{h}\n"))
        .collect();
    Ok(hex(&Sha256::digest(lines.as_bytes())))
}

/// Peak resident memory of this process (which embeds Python) in bytes.
pub fn peak_rss_bytes() -> u64 {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
