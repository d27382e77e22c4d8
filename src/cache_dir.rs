//! The per-user cache folder (Python environment, built-in checkpoint,
//! signing tool): one place decides where it is and whether it is safe.
//! chunkforge runs Python from it, so a folder someone else can write to would
//! let them run code as the user; it is refused rather than used.
//! `scripts/setup-signing.sh` applies the same rules.

use std::ffi::OsString;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Problems with where the cache folder is or who can write to it.
#[derive(Debug, thiserror::Error)]
pub enum CacheDirError {
    #[error("cannot place the cache folder: {0}")]
    Location(String),
    #[error("{}: refusing to use this cache folder: {message}", path.display())]
    Unsafe { path: PathBuf, message: String },
}

const HOW_TO_SET: &str = "set CHUNKFORGE_CACHE to an absolute path of a folder only you can write";

/// The cache folder, created (mode 0700) if missing, and checked to be safe.
pub fn cache_dir() -> Result<PathBuf, CacheDirError> {
    let dir = locate(|name| std::env::var_os(name))?;
    ensure_safe(&dir)?;
    Ok(dir)
}

/// Where the cache folder is: `$CHUNKFORGE_CACHE` if set (it must then be an
/// absolute path), else `$XDG_CACHE_HOME/chunkforge` (ignored when empty or
/// relative, as the XDG Base Directory spec says), else `$HOME/.cache/chunkforge`
/// (HOME must be absolute). No fallback to a shared or current folder: a
/// relative path would give every working folder its own 5 GB environment, and
/// `/tmp` is writable by everyone.
pub fn locate(var: impl Fn(&str) -> Option<OsString>) -> Result<PathBuf, CacheDirError> {
    if let Some(v) = var("CHUNKFORGE_CACHE") {
        let p = PathBuf::from(&v);
        if !p.is_absolute() {
            return Err(CacheDirError::Location(format!(
                "CHUNKFORGE_CACHE is `{}`, not an absolute path; {HOW_TO_SET}",
                p.display()
            )));
        }
        return Ok(p);
    }
    if let Some(p) = var("XDG_CACHE_HOME").map(PathBuf::from) {
        if p.is_absolute() {
            return Ok(p.join("chunkforge"));
        }
    }
    match var("HOME").map(PathBuf::from) {
        Some(h) if h.is_absolute() => Ok(h.join(".cache").join("chunkforge")),
        home => {
            let home = match home {
                None => "unset".to_string(),
                Some(h) if h.as_os_str().is_empty() => "empty".to_string(),
                Some(h) => format!("`{}`, not an absolute path", h.display()),
            };
            Err(CacheDirError::Location(format!(
                "CHUNKFORGE_CACHE and XDG_CACHE_HOME are unset (or not absolute) and HOME is {home}; {HOW_TO_SET}"
            )))
        }
    }
}

/// Creates `dir` (mode 0700) if missing, then refuses it unless it is a folder
/// owned by this user that neither group nor others can write, inside folders
/// owned by this user or root that others cannot write to (unless sticky, like
/// `/tmp`: there no one else can rename or replace the entries this user owns).
/// Group-writable parents are allowed: with per-user groups (umask 002) a home
/// folder is often group-writable by its owner's own group.
pub fn ensure_safe(dir: &Path) -> Result<(), CacheDirError> {
    let unsafe_dir = |path: &Path, message: String| CacheDirError::Unsafe {
        path: path.to_path_buf(),
        message,
    };
    if !dir.exists() {
        // The folders it would be made in are checked first: a cache folder
        // refused is not created, nor are its parents.
        if let Some(existing) = dir.ancestors().skip(1).find(|a| a.exists()) {
            check_parents(dir, existing)?;
        }
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| unsafe_dir(dir, format!("cannot create its parent folder ({e})")))?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(unsafe_dir(dir, format!("cannot create it ({e})")));
            }
            _ => {}
        }
    }
    let me = unsafe { libc::geteuid() };
    let meta =
        std::fs::metadata(dir).map_err(|e| unsafe_dir(dir, format!("cannot stat it ({e})")))?;
    if !meta.is_dir() {
        return Err(unsafe_dir(dir, "it is not a folder".into()));
    }
    if meta.uid() != me {
        return Err(unsafe_dir(
            dir,
            format!(
                "it belongs to uid {}, not to you (uid {me}); {HOW_TO_SET}",
                meta.uid()
            ),
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(unsafe_dir(
            dir,
            format!(
                "it is writable by {} (mode {mode:04o}); run `chmod go-w {}` or {HOW_TO_SET}",
                if mode & 0o002 != 0 {
                    "others"
                } else {
                    "its group"
                },
                dir.display()
            ),
        ));
    }
    let real = dir
        .canonicalize()
        .map_err(|e| unsafe_dir(dir, format!("cannot resolve it ({e})")))?;
    match real.parent() {
        Some(parent) => check_parents(dir, parent),
        None => Ok(()),
    }
}

/// `from` and every folder above it (resolved) are owned by this user or
/// root, and none is writable by everyone unless sticky: else someone else
/// could replace the cache folder `dir`.
fn check_parents(dir: &Path, from: &Path) -> Result<(), CacheDirError> {
    let unsafe_dir = |path: &Path, message: String| CacheDirError::Unsafe {
        path: path.to_path_buf(),
        message,
    };
    let me = unsafe { libc::geteuid() };
    let real = from
        .canonicalize()
        .map_err(|e| unsafe_dir(dir, format!("cannot resolve {} ({e})", from.display())))?;
    for parent in real.ancestors() {
        let m = std::fs::metadata(parent)
            .map_err(|e| unsafe_dir(dir, format!("cannot stat {} ({e})", parent.display())))?;
        let pmode = m.mode() & 0o7777;
        if m.uid() != me && m.uid() != 0 {
            return Err(unsafe_dir(
                dir,
                format!(
                    "the folder above it, {}, belongs to uid {}, who could replace the cache folder; {HOW_TO_SET}",
                    parent.display(),
                    m.uid()
                ),
            ));
        }
        if pmode & 0o002 != 0 && pmode & 0o1000 == 0 {
            return Err(unsafe_dir(
                dir,
                format!(
                    "the folder above it, {}, is writable by everyone (mode {pmode:04o}) and not sticky, so anyone could replace the cache folder; {HOW_TO_SET}",
                    parent.display()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn chunkforge_cache_then_xdg_then_home() {
        let all = [
            ("CHUNKFORGE_CACHE", "/c"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ];
        assert_eq!(locate(env(&all)).unwrap(), Path::new("/c"));
        assert_eq!(locate(env(&all[1..])).unwrap(), Path::new("/x/chunkforge"));
        assert_eq!(
            locate(env(&all[2..])).unwrap(),
            Path::new("/h/.cache/chunkforge")
        );
        // An empty or relative XDG_CACHE_HOME is ignored (XDG Base Directory spec).
        for xdg in ["", "rel"] {
            let v = [("XDG_CACHE_HOME", xdg), ("HOME", "/h")];
            assert_eq!(locate(env(&v)).unwrap(), Path::new("/h/.cache/chunkforge"));
        }
    }

    #[test]
    fn no_usable_variable_is_refused_never_tmp_or_the_current_folder() {
        for (vars, says) in [
            (&[][..], "HOME is unset"),
            (&[("HOME", "")][..], "HOME is empty"),
            (
                &[("HOME", "rel")][..],
                "HOME is `rel`, not an absolute path",
            ),
            (&[("XDG_CACHE_HOME", ""), ("HOME", "")][..], "HOME is empty"),
            (
                &[("CHUNKFORGE_CACHE", ""), ("HOME", "/h")][..],
                "CHUNKFORGE_CACHE is ``, not an absolute path",
            ),
            (
                &[("CHUNKFORGE_CACHE", "cache"), ("HOME", "/h")][..],
                "CHUNKFORGE_CACHE is `cache`, not an absolute path",
            ),
        ] {
            let e = locate(env(vars)).unwrap_err().to_string();
            assert!(e.contains(says), "{vars:?}: {e}");
            assert!(e.contains("set CHUNKFORGE_CACHE"), "{e}");
        }
    }

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cf-cachedir-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        d
    }

    #[test]
    fn a_new_cache_folder_is_private_and_an_open_one_is_refused() {
        let root = scratch("mode");
        let dir = root.join("a/b/chunkforge");
        ensure_safe(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
        for (m, who) in [
            (0o777, "writable by others"),
            (0o770, "writable by its group"),
        ] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(m)).unwrap();
            let e = ensure_safe(&dir).unwrap_err().to_string();
            assert!(e.contains(who) && e.contains("chmod go-w"), "{e}");
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        ensure_safe(&dir).unwrap();
        // A world-writable, non-sticky folder above it: anyone could swap the cache.
        let above = root.join("a");
        std::fs::set_permissions(&above, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = ensure_safe(&dir).unwrap_err().to_string();
        assert!(e.contains("writable by everyone"), "{e}");
        std::fs::set_permissions(&above, std::fs::Permissions::from_mode(0o1777)).unwrap();
        ensure_safe(&dir).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_cache_folder_of_another_user_is_refused() {
        let root = scratch("owner");
        let dir = root.join("chunkforge");
        std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        ensure_safe(&dir).unwrap();
        let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
        // Only root can give a folder away (the tests run as root); elsewhere skip.
        if unsafe { libc::chown(path.as_ptr(), 4242, 4242) } != 0 {
            eprintln!("skipped: cannot chown (not root)");
            return;
        }
        let e = ensure_safe(&dir).unwrap_err().to_string();
        assert!(e.contains("belongs to uid 4242"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
