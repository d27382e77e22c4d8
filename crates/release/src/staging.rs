//! Crash-safe output: everything is written under a staging folder inside the
//! output folder and published (see [`crate::publish`]) only when complete,
//! so a failed or killed run leaves the previous outputs as they were.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::publish::{self, FileLock};

const STAGING_PREFIX: &str = ".chunkforge-staging-";

/// Staging folders of this process, removed by the Ctrl-C handler.
static LIVE_STAGING: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Child processes writing into this process's staging folders (a build's
/// conversion workers): the Ctrl-C handler kills and reaps them first, so
/// nothing writes into a staging folder after it is removed.
static LIVE_CHILDREN: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// `pid` writes into this run's staging folders until `forget_child(pid)`.
pub fn register_child(pid: u32) {
    if let Ok(mut v) = LIVE_CHILDREN.lock() {
        v.push(pid);
    }
}

pub fn forget_child(pid: u32) {
    if let Ok(mut v) = LIVE_CHILDREN.lock() {
        v.retain(|p| *p != pid);
    }
}

/// Held while a run moves its finished outputs into place; the interrupt
/// handler waits for it, so Ctrl-C never splits a set of packages.
pub static PUBLISH_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Installs the Ctrl-C / SIGTERM handler: wait for any publish in progress,
/// remove this run's staging folders, say so, exit with `exit_code` (the
/// binary's `ExitStatus::Interrupted`, 130).
pub fn install_interrupt_handler(exit_code: i32) {
    let _ = ctrlc::set_handler(move || {
        let _publishing = PUBLISH_LOCK.lock();
        let children = LIVE_CHILDREN.lock().map(|v| v.clone()).unwrap_or_default();
        for pid in children {
            // SAFETY: our own child, not yet reaped (forget_child runs before
            // the build waits for it).
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
                libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0);
            }
        }
        let dirs = LIVE_STAGING.lock().map(|v| v.clone()).unwrap_or_default();
        // A folder with a journal holds previous entries a failed publish
        // could not put back: left for the next run to recover.
        for d in dirs.iter().filter(|d| !publish::has_journal(d)) {
            // The main thread may still be writing into it: retry until it is gone.
            for _ in 0..20 {
                if fs::remove_dir_all(d).is_ok() || !d.exists() {
                    break;
                }
            }
        }
        publish::clear_held_locks();
        eprintln!(
            "\ninterrupted: unfinished work removed; the output folder holds the previous result \
             (or the complete new one if it was already published)"
        );
        // _exit, not exit: no atexit handlers, so the embedded interpreter (busy
        // on the main thread) is not finalised under its own feet.
        // SAFETY: _exit only terminates the process.
        unsafe { libc::_exit(exit_code) }
    });
}

/// Creates the output folder `out` if missing (refusing a file of that name).
pub fn output_folder(out: &Path) -> Result<()> {
    if out.exists() && !out.is_dir() {
        bail!("{}: output path exists and is not a folder", out.display());
    }
    fs::create_dir_all(out)
        .with_context(|| format!("{}: cannot create the output folder", out.display()))
}

/// A staging folder in `out`; removed on drop unless committed.
pub struct Staging {
    pub out: PathBuf,
    pub dir: PathBuf,
    committed: bool,
    // Held while this run lives: a staging folder whose owner lock is free
    // belongs to a run that ended, however it ended.
    _owner: FileLock,
}

/// Inside every staging folder; see [`Staging`].
const OWNER: &str = ".chunkforge-owner";

fn pid_alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

impl Staging {
    pub fn new(out: &Path) -> Result<Self> {
        output_folder(out)?;
        clean_stale(out)?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = out.join(format!("{STAGING_PREFIX}{}-{stamp}", std::process::id()));
        let cannot = || {
            format!(
                "{}: cannot write into the output folder (read-only?)",
                out.display()
            )
        };
        fs::create_dir(&dir).with_context(cannot)?;
        let owner = match FileLock::try_take(&dir.join(OWNER)) {
            Ok(Some(owner)) => owner,
            taken => {
                let _ = fs::remove_dir_all(&dir);
                taken.with_context(cannot)?;
                bail!("{}: locked by another process", dir.join(OWNER).display());
            }
        };
        if let Ok(mut live) = LIVE_STAGING.lock() {
            live.push(dir.clone());
        }
        Ok(Staging {
            out: out.to_path_buf(),
            dir,
            committed: false,
            _owner: owner,
        })
    }

    /// Moves every staged `(from, to)` into place as one unit (see
    /// [`publish::publish`]); Ctrl-C waits until it is done.
    pub fn publish(&self, pairs: &[(PathBuf, PathBuf)]) -> Result<()> {
        let _publishing = PUBLISH_LOCK.lock();
        publish::publish(&self.dir, pairs)
    }

    /// Publishes the staged entries `names` into `out` under the same names.
    pub fn publish_names(&self, names: &[&str]) -> Result<()> {
        let pairs: Vec<(PathBuf, PathBuf)> = names
            .iter()
            .map(|n| (self.dir.join(n), self.out.join(n)))
            .collect();
        self.publish(&pairs)
    }

    pub fn finish(mut self) -> Result<()> {
        self.committed = true;
        fs::remove_dir_all(&self.dir).with_context(|| format!("removing {}", self.dir.display()))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // A journal left by a failed publish: the next run recovers the folder.
        if !self.committed && !publish::has_journal(&self.dir) {
            let _ = fs::remove_dir_all(&self.dir);
        }
        if let Ok(mut live) = LIVE_STAGING.lock() {
            live.retain(|d| d != &self.dir);
        }
    }
}

/// Whether the staging folder `dir` (named after the pid of its run) belongs
/// to a run that has ended; if so, its owner lock, held while it is cleaned.
fn stale(dir: &Path, pid: Option<u32>) -> Option<Option<FileLock>> {
    if dir.join(OWNER).exists() {
        return FileLock::try_take(&dir.join(OWNER))
            .ok()
            .flatten()
            .map(Some);
    }
    // No owner file: made by an older chunkforge, or its run is creating it.
    pid.is_some_and(|p| p != std::process::id() && !pid_alive(p))
        .then_some(None)
}

/// Cleans up after runs that were killed: a publish cut short is undone (the
/// previous entries put back), then their staging folders are removed.
pub fn clean_stale(out: &Path) -> Result<()> {
    let Ok(entries) = fs::read_dir(out) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix(STAGING_PREFIX) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        // An older chunkforge moved the previous entry aside as
        // `<prefix><pid>-old-<name>`; a kill could leave it the only copy.
        if let Some((_, entry)) = rest.split_once("-old-") {
            if pid.is_some_and(|p| p != std::process::id() && !pid_alive(p)) {
                let target = out.join(entry);
                if target.symlink_metadata().is_err() {
                    fs::rename(e.path(), &target).with_context(|| {
                        format!(
                            "{}: cannot put the previous {entry} back",
                            e.path().display()
                        )
                    })?;
                    eprintln!("restored {} (left aside by a killed run)", target.display());
                } else if e.path().is_dir() {
                    let _ = fs::remove_dir_all(e.path());
                } else {
                    let _ = fs::remove_file(e.path());
                }
            }
            continue;
        }
        let Some(_owner) = stale(&e.path(), pid) else {
            continue;
        };
        for restored in publish::recover(&e.path())? {
            eprintln!(
                "restored the previous {} (a killed run had begun replacing it)",
                restored.display()
            );
        }
        let _ = fs::remove_dir_all(e.path());
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
