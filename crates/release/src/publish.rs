//! Putting finished outputs in place. A publish moves one or more staged
//! entries onto their final names as one unit: every new file is fsynced
//! first, a journal listing the moves is written, each entry is swapped in
//! (an atomic exchange where the OS has one), and removing the journal is the
//! commit. A run killed before the commit leaves the journal; the next run
//! reads it and puts every previous entry back ([`recover`]), so a kill
//! yields the previous result or the new one, never a mix that stays.

use std::ffi::{CString, OsString};
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context, Result};

/// The journal of a publish in progress, inside the run's staging folder.
const JOURNAL: &str = ".chunkforge-journal";

static DURABLE: AtomicBool = AtomicBool::new(true);

/// Turns the fsyncs off (on by default). Only `bench hash` calls this, to
/// time the same publish with and without them.
pub fn set_durable(on: bool) {
    DURABLE.store(on, Ordering::Relaxed);
}

fn durable() -> bool {
    DURABLE.load(Ordering::Relaxed)
}

/// Test hooks (built with the `test-hooks` feature only, which the tests'
/// binary has and a release build has not), read once from the environment;
/// unset, they do nothing. `CHUNKFORGE_TEST_KILL_AT_STEP=N` makes the process
/// SIGKILL itself right before the Nth step of its publishes (each rename or
/// exchange, and the journal removal that commits), so the tests can cut a
/// publish at every point. `CHUNKFORGE_TEST_FAIL_AT_STEP=N` makes that step
/// fail with an I/O error instead. `CHUNKFORGE_TEST_NO_EXCHANGE=1` takes the
/// three-rename path used on file systems without an atomic exchange.
/// `CHUNKFORGE_TEST_PAUSE_AFTER=lock|recovery|copy` makes the run stop (say so on
/// stderr, then sleep) once it has taken its output's lock, once it has
/// undone what killed runs left, or (`client-check --materialize`) as it
/// copies its first file ([`test_pause`]), so a test can interrupt it
/// exactly there.
#[cfg(feature = "test-hooks")]
mod hooks {
    use std::io;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::OnceLock;

    struct Hooks {
        kill_at: Option<usize>,
        fail_at: Option<usize>,
        no_exchange: bool,
        pause_after: Option<String>,
    }

    fn hooks() -> &'static Hooks {
        static HOOKS: OnceLock<Hooks> = OnceLock::new();
        HOOKS.get_or_init(|| Hooks {
            kill_at: step_var("CHUNKFORGE_TEST_KILL_AT_STEP"),
            fail_at: step_var("CHUNKFORGE_TEST_FAIL_AT_STEP"),
            no_exchange: std::env::var_os("CHUNKFORGE_TEST_NO_EXCHANGE").is_some(),
            pause_after: std::env::var("CHUNKFORGE_TEST_PAUSE_AFTER").ok(),
        })
    }

    /// The `CHUNKFORGE_TEST_PAUSE_AFTER` hook at `point`.
    pub fn test_pause(point: &str) {
        if hooks().pause_after.as_deref() == Some(point) {
            eprintln!("test hook: paused after {point}");
            std::thread::sleep(std::time::Duration::from_secs(600));
        }
    }

    fn step_var(name: &str) -> Option<usize> {
        std::env::var(name).ok().and_then(|v| v.parse().ok())
    }

    /// Marks the next step of a publish.
    pub fn step() -> io::Result<()> {
        static STEPS: AtomicUsize = AtomicUsize::new(0);
        let h = hooks();
        if h.kill_at.is_none() && h.fail_at.is_none() {
            return Ok(());
        }
        let n = Some(STEPS.fetch_add(1, Ordering::SeqCst) + 1);
        if n == h.kill_at {
            // SAFETY: kill only sends a signal, here to this process.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        if n == h.fail_at {
            return Err(io::Error::other("CHUNKFORGE_TEST_FAIL_AT_STEP"));
        }
        Ok(())
    }

    /// Whether to take the three-rename path instead of an atomic exchange.
    pub fn no_exchange() -> bool {
        hooks().no_exchange
    }
}

/// Without the `test-hooks` feature: no hooks.
#[cfg(not(feature = "test-hooks"))]
mod hooks {
    pub fn step() -> std::io::Result<()> {
        Ok(())
    }

    pub fn no_exchange() -> bool {
        false
    }

    pub fn test_pause(_point: &str) {}
}

use hooks::step;
pub use hooks::test_pause;

fn c_path(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// Swaps two existing names in one step. `Ok(false)`: the OS or the file
/// system has no such operation (nothing was changed).
fn exchange(a: &Path, b: &Path) -> io::Result<bool> {
    if hooks::no_exchange() {
        return Ok(false);
    }
    let (ca, cb) = (c_path(a)?, c_path(b)?);
    #[cfg(target_os = "linux")]
    // SAFETY: both pointers are NUL-terminated paths that outlive the call.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    #[cfg(target_os = "macos")]
    // SAFETY: as above.
    let r = unsafe { libc::renamex_np(ca.as_ptr(), cb.as_ptr(), libc::RENAME_SWAP) };
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    let r = {
        let _ = (ca, cb);
        return Ok(false);
    };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    // Not supported here (older kernels, some network and FUSE file systems).
    let unsupported = [libc::EINVAL, libc::ENOSYS, libc::ENOTSUP, libc::EOPNOTSUPP];
    match e.raw_os_error() {
        Some(code) if unsupported.contains(&code) => Ok(false),
        _ => Err(e),
    }
}

/// (device, inode): which file a name points at. Renames keep it, so it tells
/// the new entry from the previous one wherever a kill left them.
type Id = (u64, u64);

fn id_of(p: &Path) -> Option<Id> {
    fs::symlink_metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

/// One move of a publish: the staged `from` onto `to`; `id` is the new entry's.
struct Entry {
    from: PathBuf,
    to: PathBuf,
    id: Id,
}

fn suffixed(p: &Path, suffix: &str) -> PathBuf {
    let mut name = p.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    p.with_file_name(name)
}

/// Where the three-rename path parks the previous entry while the new one moves in.
fn aside(from: &Path) -> PathBuf {
    suffixed(from, ".chunkforge-old")
}

/// Where a roll-back parks a new entry it takes out of place.
fn discard(from: &Path) -> PathBuf {
    suffixed(from, ".chunkforge-new")
}

/// Puts `e.from` in place of `e.to`. Afterwards `e.from` holds the previous
/// entry, if there was one.
fn swap_in(e: &Entry) -> io::Result<()> {
    match fs::symlink_metadata(&e.to) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            step()?;
            return fs::rename(&e.from, &e.to);
        }
        Err(err) => return Err(err),
        Ok(_) => {}
    }
    step()?;
    if exchange(&e.from, &e.to)? {
        return Ok(());
    }
    // No exchange: for the instant between the first two renames `to` is
    // missing; the journal lets the next run put the previous entry back.
    let parked = aside(&e.from);
    fs::rename(&e.to, &parked)?;
    step()?;
    fs::rename(&e.from, &e.to)?;
    step()?;
    fs::rename(&parked, &e.from)
}

/// What undoing one entry of an uncommitted publish did to its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Undone {
    /// The previous entry is back at this name.
    PutBack(PathBuf),
    /// The name had no previous entry: the new one was taken away.
    TookAway(PathBuf),
}

/// The previous entry of `e`, wherever a publish or a roll-back left it.
fn previous_of(e: &Entry) -> Option<PathBuf> {
    [e.from.clone(), aside(&e.from), discard(&e.from)]
        .into_iter()
        .find(|p| id_of(p).is_some_and(|id| id != e.id))
}

/// Puts the previous entry back at `e.to` (or, if there was none, takes the
/// new one away), from whatever state a kill left. Reads every name from the
/// file system, so a roll-back cut short is finished by the next one.
/// Returns what it did (None: the name already held its previous entry).
fn roll_back(e: &Entry) -> io::Result<Option<Undone>> {
    let to_is_new = id_of(&e.to) == Some(e.id);
    match (to_is_new, previous_of(e)) {
        (true, Some(prev)) => {
            if !exchange(&e.to, &prev)? {
                fs::rename(&e.to, discard(&e.from))?;
                fs::rename(&prev, &e.to)?;
            }
        }
        (true, None) => {
            fs::rename(&e.to, discard(&e.from))?;
            return Ok(Some(Undone::TookAway(e.to.clone())));
        }
        (false, Some(prev)) if id_of(&e.to).is_none() => fs::rename(&prev, &e.to)?,
        _ => return Ok(None),
    }
    Ok(Some(Undone::PutBack(e.to.clone())))
}

fn remove_any(p: &Path) {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            let _ = fs::remove_dir_all(p);
        }
        Ok(_) => {
            let _ = fs::remove_file(p);
        }
        Err(_) => {}
    }
}

/// After a roll-back: removes the new entries, never committed, wherever
/// they were parked.
fn remove_new(entries: &[Entry]) {
    for e in entries {
        for p in [&e.from, &aside(&e.from), &discard(&e.from)] {
            remove_any(p);
        }
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    if durable() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// fsyncs every file and folder below `root` (or the file `root`).
fn sync_tree(root: &Path) -> io::Result<()> {
    if !durable() {
        return Ok(());
    }
    let mut paths = Vec::new();
    for e in walkdir::WalkDir::new(root) {
        let e = e.map_err(io::Error::other)?;
        if !e.file_type().is_symlink() {
            paths.push(e.into_path());
        }
    }
    // In parallel: the device takes several flushes at once.
    use rayon::prelude::*;
    paths.par_iter().try_for_each(|p| File::open(p)?.sync_all())
}

fn parent(p: &Path) -> &Path {
    p.parent().unwrap_or(Path::new("/"))
}

/// fsyncs the folders holding the entries' names, each once.
fn sync_parents(entries: &[Entry]) -> io::Result<()> {
    let mut dirs: Vec<&Path> = entries
        .iter()
        .flat_map(|e| [parent(&e.from), parent(&e.to)])
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs.into_iter().try_for_each(sync_dir)
}

/// Journal: per entry `from`, `to`, device and inode, each ended by a NUL
/// (paths are bytes, not necessarily UTF-8, and never contain a NUL).
fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in entries {
        for field in [
            e.from.as_os_str().as_bytes(),
            e.to.as_os_str().as_bytes(),
            e.id.0.to_string().as_bytes(),
            e.id.1.to_string().as_bytes(),
        ] {
            out.extend_from_slice(field);
            out.push(0);
        }
    }
    out
}

fn decode(bytes: &[u8]) -> Option<Vec<Entry>> {
    let fields: Vec<&[u8]> = bytes.strip_suffix(&[0])?.split(|b| *b == 0).collect();
    if !fields.len().is_multiple_of(4) {
        return None;
    }
    let number = |f: &[u8]| std::str::from_utf8(f).ok()?.parse::<u64>().ok();
    let path = |f: &[u8]| PathBuf::from(OsString::from_vec(f.to_vec()));
    fields
        .chunks(4)
        .map(|f| {
            Some(Entry {
                from: path(f[0]),
                to: path(f[1]),
                id: (number(f[2])?, number(f[3])?),
            })
        })
        .collect()
}

/// Writes the journal under a temporary name and renames it into place, so
/// a run killed while writing it leaves no journal at all (nothing has moved
/// yet), never a truncated one that recovery would have to refuse.
fn write_journal(journal: &Path, entries: &[Entry]) -> Result<()> {
    let partial = suffixed(journal, ".partial");
    let mut f =
        File::create(&partial).with_context(|| format!("{}: cannot create", partial.display()))?;
    f.write_all(&encode(entries))
        .and_then(|()| if durable() { f.sync_all() } else { Ok(()) })
        .with_context(|| format!("{}: cannot write", partial.display()))?;
    drop(f);
    fs::rename(&partial, journal)
        .and_then(|()| sync_dir(parent(journal)))
        .with_context(|| format!("{}: cannot write", journal.display()))
}

/// Moves every `(from, to)` into place as one unit, the journal kept in
/// `staging` (the run's staging folder). The previous entries are deleted
/// only after the commit. On an error the entries already moved are put back.
pub fn publish(staging: &Path, pairs: &[(PathBuf, PathBuf)]) -> Result<()> {
    let mut entries = Vec::new();
    for (from, to) in pairs {
        let from = std::path::absolute(from)
            .with_context(|| format!("{}: cannot resolve", from.display()))?;
        let to =
            std::path::absolute(to).with_context(|| format!("{}: cannot resolve", to.display()))?;
        let id = id_of(&from).with_context(|| format!("{}: missing", from.display()))?;
        sync_tree(&from).with_context(|| format!("{}: fsync failed", from.display()))?;
        entries.push(Entry { from, to, id });
    }
    sync_parents(&entries).context("fsync of the staging folders failed")?;
    let journal = staging.join(JOURNAL);
    write_journal(&journal, &entries)?;

    for e in &entries {
        if let Err(err) = swap_in(e) {
            let undone = entries
                .iter()
                .rev()
                .try_for_each(|e| roll_back(e).map(drop));
            let what = format!("moving {} into place: {err}", e.to.display());
            match undone {
                Ok(()) => {
                    remove_new(&entries);
                    let _ = fs::remove_file(&journal);
                    bail!("{what}; the previous outputs are back in place")
                }
                Err(u) => bail!(
                    "{what}; putting the previous outputs back also failed ({u}); \
                     the next run retries from {}",
                    journal.display()
                ),
            }
        }
    }
    // Past this point a failure keeps the journal: the next run puts the
    // previous outputs back.
    let uncommitted = || {
        format!(
            "{}: cannot commit the publish; the next run puts the previous outputs back",
            journal.display()
        )
    };
    sync_parents(&entries).with_context(uncommitted)?;
    step()
        .and_then(|()| fs::remove_file(&journal))
        .with_context(uncommitted)?;
    sync_dir(staging).with_context(|| {
        format!(
            "{}: fsync failed after the commit (the new outputs are in place)",
            staging.display()
        )
    })?;
    for e in &entries {
        remove_any(&e.from); // the previous entry, superseded
    }
    Ok(())
}

/// Whether `staging` holds the journal of a publish not committed: the
/// folder may then hold previous entries, and only [`recover`] may remove it.
pub fn has_journal(staging: &Path) -> bool {
    staging.join(JOURNAL).symlink_metadata().is_ok()
}

/// The entries of the journal in `staging`: None without a journal, an
/// error when it cannot be read or is not one.
fn journal_entries(staging: &Path) -> Result<Option<Vec<Entry>>> {
    let journal = staging.join(JOURNAL);
    let bytes = match fs::read(&journal) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => bail!("{}: cannot read: {e}", journal.display()),
    };
    match decode(&bytes) {
        Some(entries) => Ok(Some(entries)),
        None => bail!(
            "{}: not a chunkforge publish journal; left in place with its folder (remove it once \
             the outputs it names are checked)",
            journal.display()
        ),
    }
}

/// The names a publish left uncommitted in `staging` still holds wrongly:
/// each holds the new entry, or nothing where its previous entry waits in
/// the staging folder. Empty without a journal, or when nothing had moved.
pub fn uncommitted(staging: &Path) -> Vec<PathBuf> {
    let Ok(Some(entries)) = journal_entries(staging) else {
        return Vec::new();
    };
    entries
        .iter()
        .filter(|e| match id_of(&e.to) {
            Some(id) => id == e.id,
            None => previous_of(e).is_some(),
        })
        .map(|e| e.to.clone())
        .collect()
}

/// Undoes the publish a killed run left in its staging folder `staging`, if
/// any: every previous entry goes back in place, the new ones are deleted.
/// Returns what was undone, name by name. Nothing is deleted before its
/// previous entry is back, and an unreadable journal is left alone for a
/// person to look at.
pub fn recover(staging: &Path) -> Result<Vec<Undone>> {
    let journal = staging.join(JOURNAL);
    let Some(entries) = journal_entries(staging)? else {
        return Ok(Vec::new());
    };
    let mut restored = Vec::new();
    for e in entries.iter().rev() {
        let undone = roll_back(e).with_context(|| {
            format!(
                "putting the previous {} back (journal {})",
                e.to.display(),
                journal.display()
            )
        })?;
        restored.extend(undone);
    }
    sync_parents(&entries).context("fsync after the roll-back failed")?;
    remove_new(&entries);
    fs::remove_file(&journal).with_context(|| format!("{}: cannot remove", journal.display()))?;
    Ok(restored)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journal_round_trips_non_utf8_paths() {
        let e = Entry {
            from: PathBuf::from(OsString::from_vec(b"/a/\xffb".to_vec())),
            to: PathBuf::from("/c/d e\nf"),
            id: (7, u64::MAX),
        };
        let back = decode(&encode(&[e])).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].from.as_os_str().as_bytes(), b"/a/\xffb");
        assert_eq!(back[0].to, Path::new("/c/d e\nf"));
        assert_eq!(back[0].id, (7, u64::MAX));
        assert!(decode(b"/a\0/b\0x\x001\0").is_none());
        assert!(decode(b"/a\0/b\0").is_none());
    }

    /// A kill while the journal is written leaves only its `.partial`: no
    /// journal, so recovery finds nothing to undo and does not refuse.
    #[test]
    fn journal_appears_whole_or_not_at_all() {
        let dir = std::env::temp_dir().join(format!("cf-journal-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("new")).unwrap();
        let journal = dir.join(JOURNAL);
        let entries = [Entry {
            from: dir.join("new"),
            to: dir.join("out"),
            id: id_of(&dir.join("new")).unwrap(),
        }];
        let bytes = encode(&entries);
        fs::write(suffixed(&journal, ".partial"), &bytes[..bytes.len() / 2]).unwrap();
        assert!(!has_journal(&dir));
        assert_eq!(recover(&dir).unwrap(), Vec::<Undone>::new());
        write_journal(&journal, &entries).unwrap();
        assert!(!suffixed(&journal, ".partial").exists());
        assert_eq!(decode(&fs::read(&journal).unwrap()).unwrap().len(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
