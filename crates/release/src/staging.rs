//! Crash-safe output: everything is written under a staging folder inside the
//! output folder and published (see [`crate::publish`]) only when complete,
//! so a failed or killed run leaves the previous outputs as they were.
//! [`OutputLock`] keeps two runs from writing one output at the same time.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::io::{self, Read, Seek};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sha2::Digest;

use crate::publish::{self, Undone};

const STAGING_PREFIX: &str = ".chunkforge-staging-";

/// Staging folders of this process, removed by the Ctrl-C handler.
static LIVE_STAGING: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Set by the Ctrl-C handler before it removes the staging folders: every
/// copy loop checks it before it starts a file ([`stop_if_interrupted`]).
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Called before a copy starts a file: once Ctrl-C (or SIGTERM) is being
/// handled, it never returns (the handler removes the staging folders and
/// ends the process), so no file is started, and no error races the
/// handler's exit status and message.
pub fn stop_if_interrupted() {
    if INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
    }
}

/// Temporary files this process writes beside their final names (an
/// archive and its digest file), removed by the Ctrl-C handler.
static LIVE_TEMPS: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// A temporary file beside its final name: removed when dropped (a failed
/// run leaves nothing) and by the Ctrl-C handler, until [`TempFile::publishing`]
/// hands it to a publish (which moves it, or after a failure keeps what the
/// next run needs to put the previous outputs back).
pub struct TempFile {
    pub path: PathBuf,
    armed: bool,
}

impl TempFile {
    /// Registers `path` before anything creates it.
    pub fn new(path: PathBuf) -> Self {
        if let Ok(mut v) = LIVE_TEMPS.lock() {
            v.push(path.clone());
        }
        TempFile { path, armed: true }
    }

    /// The path, now the publish's to move or keep.
    pub fn publishing(mut self) -> PathBuf {
        self.armed = false;
        self.forget();
        std::mem::take(&mut self.path)
    }

    fn forget(&self) {
        if let Ok(mut v) = LIVE_TEMPS.lock() {
            v.retain(|p| p != &self.path);
        }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.armed {
            let _ = fs::remove_file(&self.path);
            self.forget();
        }
    }
}

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

/// Held while a run moves its finished outputs into place, or undoes what a
/// killed run left half published; the interrupt handler waits for it, so
/// Ctrl-C never splits a set of packages, and its message describes a folder
/// no move is under way in.
pub static PUBLISH_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What this run has done to the folders it writes, for the interrupt
/// handler's message: it says what happened, never what usually happens.
#[derive(Default)]
struct RunLog {
    /// Folders this run writes into, and the folders holding them: where a
    /// killed run's unfinished publish would be waiting.
    homes: Vec<PathBuf>,
    /// What this run undid of publishes that killed runs left uncommitted.
    undone: Vec<String>,
    /// Names this run's own publishes committed.
    published: Vec<PathBuf>,
}

static RUN_LOG: std::sync::Mutex<RunLog> = std::sync::Mutex::new(RunLog {
    homes: Vec::new(),
    undone: Vec::new(),
    published: Vec::new(),
});

fn run_log() -> std::sync::MutexGuard<'static, RunLog> {
    RUN_LOG.lock().unwrap_or_else(|e| e.into_inner())
}

/// This run writes `output` (a build or release folder): a Ctrl-C message
/// then says whether a killed run's publish into it is still waiting to be
/// undone.
pub fn note_output(output: &Path) {
    let abs = std::path::absolute(output).unwrap_or_else(|_| output.to_path_buf());
    let parent = abs.parent().map(Path::to_path_buf);
    let mut log = run_log();
    for dir in std::iter::once(abs).chain(parent) {
        if !log.homes.contains(&dir) {
            log.homes.push(dir);
        }
    }
}

/// Installs the Ctrl-C / SIGTERM handler: wait for any publish (or undo) in
/// progress, remove this run's staging folders, say what this run did and
/// what state it leaves, exit with `exit_code` (the binary's
/// `ExitStatus::Interrupted`, 130).
pub fn install_interrupt_handler(exit_code: i32) {
    let _ = ctrlc::set_handler(move || {
        // Copies stop starting files first; a publish under way finishes.
        INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
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
            // A copy may still be finishing a file in it (none starts
            // another, and none makes a folder): retry until it is gone.
            for _ in 0..100 {
                if fs::remove_dir_all(d).is_ok() && !d.exists() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        let temps = LIVE_TEMPS.lock().map(|v| v.clone()).unwrap_or_default();
        for t in temps {
            let _ = fs::remove_file(t);
        }
        release_held_locks();
        eprintln!("\n{}", interrupt_report(&dirs));
        // _exit, not exit: no atexit handlers, so the embedded interpreter (busy
        // on the main thread) is not finalised under its own feet.
        // SAFETY: _exit only terminates the process.
        unsafe { libc::_exit(exit_code) }
    });
}

/// The interrupt handler's message: what this run had put back, whether it
/// had published, and what is left for the next run (`own`: this run's
/// staging folders; those holding a journal are kept for the next run).
fn interrupt_report(own: &[PathBuf]) -> String {
    let log = run_log();
    if log.homes.is_empty() && own.is_empty() {
        return "interrupted".into();
    }
    let mut lines = vec!["interrupted: this run's unfinished work is removed".to_string()];
    for u in &log.undone {
        lines.push(format!("  before that, this run {u}"));
    }
    if log.published.is_empty() {
        lines.push("  this run published nothing".into());
    } else {
        let names: Vec<String> = log
            .published
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        lines.push(format!(
            "  this run had already published, whole: {}",
            names.join(", ")
        ));
    }
    for d in own.iter().filter(|d| publish::has_journal(d)) {
        lines.push(format!(
            "  {}: this run's publish failed and could not put everything back; \
             the next run writing into {} does",
            d.display(),
            parent_of(d).display()
        ));
    }
    let mut seen = Vec::new();
    for home in &log.homes {
        for (dir, pid) in staging_folders(home) {
            if own.contains(&dir) || seen.contains(&dir) || !publish::has_journal(&dir) {
                continue;
            }
            seen.push(dir.clone());
            if stale(&dir, pid).is_none() {
                continue; // a live run's publish, under way
            }
            let names = publish::uncommitted(&dir);
            let run = pid.map_or("a run".to_string(), |p| format!("the run with pid {p}"));
            if names.is_empty() {
                lines.push(format!(
                    "  {}: {run} ended before committing a publish, having moved nothing into place; \
                     the next run writing into {home} removes it",
                    dir.display(),
                    home = home.display()
                ));
            }
            for name in names {
                lines.push(format!(
                    "  {}: holds the uncommitted new version from {run}, which ended before committing; \
                     the previous version waits in {}, and the next run writing into {} puts it back",
                    name.display(),
                    dir.display(),
                    home.display()
                ));
            }
        }
    }
    lines.join("\n")
}

fn parent_of(p: &Path) -> &Path {
    p.parent().unwrap_or(Path::new("/"))
}

/// The staging folders in `dir` (not the legacy `-old-` entries), with the
/// pid of the run that made each.
fn staging_folders(dir: &Path) -> Vec<(PathBuf, Option<u32>)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let rest = name.strip_prefix(STAGING_PREFIX)?;
            if rest.contains("-old-") {
                return None;
            }
            let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
            Some((e.path(), pid))
        })
        .collect()
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
        note_output(out);
        clean_stale(out)?;
        publish::test_pause("recovery");
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
        // Registered before it exists, so that a Ctrl-C between its creation
        // and its registration cannot leave it behind.
        if let Ok(mut live) = LIVE_STAGING.lock() {
            live.push(dir.clone());
        }
        let forget = || {
            if let Ok(mut live) = LIVE_STAGING.lock() {
                live.retain(|d| d != &dir);
            }
        };
        if let Err(e) = fs::create_dir(&dir) {
            forget();
            return Err(e).with_context(cannot);
        }
        let owner = match FileLock::try_take(&dir.join(OWNER)) {
            Ok(Some(owner)) => owner,
            taken => {
                let _ = fs::remove_dir_all(&dir);
                forget();
                taken.with_context(cannot)?;
                bail!("{}: locked by another process", dir.join(OWNER).display());
            }
        };
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
        publish::publish(&self.dir, pairs)?;
        run_log()
            .published
            .extend(pairs.iter().map(|(_, to)| to.clone()));
        Ok(())
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
/// previous entries put back), then their staging folders are removed. Runs
/// under [`PUBLISH_LOCK`], so Ctrl-C waits for it and then says what it did.
pub fn clean_stale(out: &Path) -> Result<()> {
    let _undoing = PUBLISH_LOCK.lock();
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
                    say_undone(format!(
                        "restored {} (left aside by a killed run)",
                        target.display()
                    ));
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
        let run = pid.map_or("a run".to_string(), |p| format!("the run with pid {p}"));
        for undone in publish::recover(&e.path())? {
            say_undone(match undone {
                Undone::PutBack(name) => format!(
                    "restored the previous {}: {run} had begun replacing it and ended before committing",
                    name.display()
                ),
                Undone::TookAway(name) => format!(
                    "removed {}: {run} had published it and ended before committing; there was no \
                     previous version to put back",
                    name.display()
                ),
            });
        }
        let _ = fs::remove_dir_all(e.path());
    }
    Ok(())
}

/// Says (and logs for a Ctrl-C message) what undoing a killed run's publish did.
fn say_undone(what: String) {
    eprintln!("{what}");
    run_log().undone.push(what);
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

// Output locks.

fn flock(f: &File, op: libc::c_int) -> io::Result<bool> {
    // SAFETY: flock on a file descriptor this File owns.
    if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::WouldBlock {
        Ok(false)
    } else {
        Err(e)
    }
}

/// An exclusive `flock` on a file, released when dropped or when the process
/// dies (SIGKILL included), so a lock can never outlive its holder.
pub struct FileLock(File);

impl FileLock {
    /// Takes the lock of `path` (created if missing) if it is free.
    pub fn try_take(path: &Path) -> io::Result<Option<FileLock>> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        Ok(flock(&f, libc::LOCK_EX | libc::LOCK_NB)?.then_some(FileLock(f)))
    }
}

/// What a run does when another run holds its output's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnLocked {
    Wait,
    /// `--no-wait`.
    Refuse,
}

impl OnLocked {
    /// From a command's `--no-wait` flag.
    pub fn from_no_wait(no_wait: bool) -> OnLocked {
        if no_wait {
            OnLocked::Refuse
        } else {
            OnLocked::Wait
        }
    }
}

/// The lock of one output (a build folder, a release folder): a file
/// `.NAME.chunkforge-lock` beside it (inside a build folder whose parent is
/// not writable: `.chunkforge-lock`), holding the pid and command line of the
/// run that holds it (emptied on release, so a non-empty file found free was
/// left by a run that was killed). A run that created its output and ends
/// without a result (refused, failed, interrupted) removes the empty output
/// folder and the lock file with it, so it leaves nothing behind.
pub struct OutputLock {
    lock: FileLock,
    path: PathBuf,
    /// The output, when this run created it.
    created: Option<PathBuf>,
}

/// Whether `f` is the file at `path` (not one removed from it meanwhile).
fn is_at(f: &File, path: &Path) -> bool {
    let id = |m: &fs::Metadata| (m.dev(), m.ino());
    matches!((f.metadata(), fs::metadata(path)), (Ok(a), Ok(b)) if id(&a) == id(&b))
}

impl OutputLock {
    /// Takes the lock of `output`, waiting for the run holding it or
    /// refusing. Creates the folder `output` is in.
    pub fn take(output: &Path, on_locked: OnLocked) -> Result<OutputLock> {
        note_output(output);
        let created = output.symlink_metadata().is_err();
        let (lock, path) = loop {
            let (lock, path) = acquire(output, on_locked)?;
            // A run that removed the lock file (see `release`) leaves its
            // waiters a lock on a file nobody else sees: take the new one.
            if is_at(&lock.0, &path) {
                break (lock, path);
            }
        };
        // Our line is written and the lock registered for the interrupt
        // handler in one step under HELD: an interrupted run never leaves its
        // line behind (which the next run would report as killed).
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        let left = holder_text(&lock.0);
        let mut me = &lock.0;
        let args: Vec<String> = std::env::args_os()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        me.set_len(0)
            .and_then(|()| me.rewind())
            .and_then(|()| writeln!(me, "{}\t{since}\t{}", std::process::id(), args.join(" ")))
            .with_context(|| format!("{}: cannot write", path.display()))?;
        let created = created.then(|| output.to_path_buf());
        held.push(Held {
            path: path.clone(),
            file: lock.0.try_clone().ok(),
            created: created.clone(),
        });
        drop(held);
        if !left.is_empty() {
            eprintln!(
                "note: {}: the run that held it ({}) ended without releasing it (killed or crashed)",
                path.display(),
                describe(&left)
            );
        }
        publish::test_pause("lock");
        Ok(OutputLock {
            lock,
            path,
            created,
        })
    }
}

/// Takes the lock file of `output` (see [`OutputLock::take`]); returns it and its path.
fn acquire(output: &Path, on_locked: OnLocked) -> Result<(FileLock, PathBuf)> {
    let mut path = lock_path(output)?;
    let mut first = FileLock::try_take(&path);
    if first.as_ref().is_err_and(|e| {
        matches!(
            e.kind(),
            io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem
        )
    }) && output.is_dir()
    {
        // A folder we may not write into holds a build folder we may:
        // the lock goes inside it instead.
        path = output.join(".chunkforge-lock");
        first = FileLock::try_take(&path);
    }
    let cannot = || format!("{}: cannot create or lock", path.display());
    let lock = match first.with_context(cannot)? {
        Some(l) => l,
        None => {
            let holder = holder(&path);
            if on_locked == OnLocked::Refuse {
                bail!(
                    "{}: another chunkforge run is writing it ({holder}; lock {}); \
                     not waiting (--no-wait): run again when it has finished",
                    output.display(),
                    path.display()
                );
            }
            eprintln!(
                "waiting: {} is being written by another chunkforge run ({holder}); \
                 this run continues when it finishes (Ctrl-C to stop, --no-wait to refuse)",
                output.display()
            );
            let f = OpenOptions::new().read(true).write(true).open(&path);
            let f = f.with_context(cannot)?;
            flock(&f, libc::LOCK_EX).with_context(cannot)?;
            FileLock(f)
        }
    };
    Ok((lock, path))
}

/// An [`OutputLock`] this process holds, for the interrupt handler.
struct Held {
    path: PathBuf,
    file: Option<File>,
    created: Option<PathBuf>,
}

/// The [`OutputLock`]s this process holds.
static HELD: std::sync::Mutex<Vec<Held>> = std::sync::Mutex::new(Vec::new());

/// Releases a lock as its run ends: empties its file, or removes it together
/// with the output this run created when that output is an empty folder or
/// was never made (the run ends without a result). Called with the lock held,
/// so a run waiting for it sees the file go and takes the next one.
fn release(path: &Path, file: Option<&File>, created: Option<&Path>) {
    if let Some(out) = created {
        if fs::remove_dir(out).is_ok() || out.symlink_metadata().is_err() {
            let _ = fs::remove_file(path);
            return;
        }
    }
    // Emptied before the unlock: a released lock names nobody.
    if let Some(f) = file {
        let _ = f.set_len(0);
    }
}

/// Releases the locks this process holds, as dropping them does: for the
/// interrupt handler, which exits without running destructors (the locks
/// themselves go with the process). Call it after the run's staging folders
/// are removed. No lock is taken after this: a run that takes one at this
/// moment waits until the process exits rather than write its line into a
/// lock the process is about to leave.
pub fn release_held_locks() {
    let held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    for h in held.iter() {
        release(&h.path, h.file.as_ref(), h.created.as_deref());
    }
    std::mem::forget(held);
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        if let Ok(mut held) = HELD.lock() {
            held.retain(|h| h.path != self.path);
        }
        release(&self.path, Some(&self.lock.0), self.created.as_deref());
    }
}

/// `.NAME.chunkforge-lock` in the (canonical) folder holding `output`; beside
/// rather than inside, since a release folder is itself replaced.
fn lock_path(output: &Path) -> Result<PathBuf> {
    let abs = std::path::absolute(output)
        .with_context(|| format!("{}: cannot resolve", output.display()))?;
    let (Some(dir), Some(name)) = (abs.parent(), abs.file_name()) else {
        bail!(
            "{}: needs a folder name (cannot lock the root)",
            output.display()
        );
    };
    fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let dir = dir
        .canonicalize()
        .with_context(|| format!("{}: cannot resolve", dir.display()))?;
    let mut file = OsString::from(".");
    // File names have at most 255 bytes; a longer one is named by its digest.
    if name.len() + 17 <= 255 {
        file.push(name);
    } else {
        let digest = sha2::Sha256::digest(name.as_bytes());
        file.push(crate::hashing::hex(&digest[..8]));
    }
    file.push(".chunkforge-lock");
    Ok(dir.join(file))
}

fn holder_text(mut f: &File) -> String {
    let mut s = String::new();
    let _ = f.rewind().and_then(|()| f.read_to_string(&mut s));
    s.trim().to_string()
}

/// Who holds the lock at `path`, for a message.
fn holder(path: &Path) -> String {
    match File::open(path) {
        Ok(f) => {
            let text = holder_text(&f);
            if text.is_empty() {
                "starting up".into()
            } else {
                describe(&text)
            }
        }
        Err(_) => "unknown".into(),
    }
}

/// `pid 123, started 40 s ago: chunkforge build ...` from a lock file's line.
fn describe(line: &str) -> String {
    let mut f = line.splitn(3, '\t');
    let (pid, since, cmd) = (f.next(), f.next(), f.next());
    let age = since.and_then(|s| s.parse::<u64>().ok()).and_then(|s| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()
            .map(|now| now.as_secs().saturating_sub(s))
    });
    match (pid, age, cmd) {
        (Some(pid), Some(age), Some(cmd)) => format!("pid {pid}, started {age} s ago: {cmd}"),
        _ => line.to_string(),
    }
}
