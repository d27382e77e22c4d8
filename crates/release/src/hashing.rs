//! SHA-256 of release files at the speed of the machine: files are hashed in
//! parallel (rayon), and a large file is read by its own thread into a ring of
//! buffers while the calling thread hashes (and, when packaging, writes) the
//! previous one, so disk reads overlap hashing. sha2 0.10 picks its SHA-NI
//! backend at run time where the CPU has it.
//!
//! Buffer size, measured here (warm page cache, SHA-NI, one 1 GiB file):
//! 256 KiB-1 MiB buffers hash at ~1.3 GiB/s, within 7 % of sha2's in-memory
//! speed; 8 MiB buffers drop to ~1.1 GiB/s because each buffer falls out of
//! the 4 MiB L2 between the read's copy and the hash; mmap was no faster.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use chunkforge_model::checkpoint::Checkpoint;
use chunkforge_model::records::WeightsDigest;
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::paths::check_rel_path;

/// Files at least this large are streamed through the reader thread.
const PIPELINE_MIN: u64 = 32 << 20;
/// Buffer size for large files: big enough that syscall overhead vanishes
/// (1 MiB = 256 reads per GiB), small enough that a buffer is still in cache
/// when it is hashed (see the measurements above).
const BIG_BUF: usize = 1 << 20;
/// Buffers in flight between the reader thread and the hasher.
const BUFFERS: usize = 4;
const SMALL_BUF: usize = 256 << 10;

/// Size and SHA-256 of one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileDigest {
    pub size: u64,
    pub sha256: [u8; 32],
}

impl FileDigest {
    pub fn hex(&self) -> String {
        hex(&self.sha256)
    }
}

pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Parses a 64-character lowercase or uppercase hex SHA-256.
pub fn parse_hex32(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A file that could not be read, listed or accepted. An empty `action`
/// says what is wrong with the entry itself (`source`'s text).
#[derive(Debug)]
pub struct HashError {
    pub path: PathBuf,
    pub action: &'static str,
    pub source: io::Error,
}

impl std::fmt::Display for HashError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.action.is_empty() {
            write!(f, "{}: {}", self.path.display(), self.source)
        } else {
            write!(
                f,
                "{}: could not {}: {}",
                self.path.display(),
                self.action,
                self.source
            )
        }
    }
}

impl std::error::Error for HashError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        if self.action.is_empty() {
            None
        } else {
            Some(&self.source)
        }
    }
}

fn err<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(io::Error) -> HashError + 'a {
    move |source| HashError {
        path: path.to_path_buf(),
        action,
        source,
    }
}

/// Reads `file` to the end, handing each filled buffer first to `on_read`
/// and then to `sink`, in order. Large files run `read + on_read` on a scoped
/// thread and `sink` on the caller's, so the two overlap: hashing uses
/// `sink` (disk reads overlap the hash); copying hashes in `on_read` and
/// writes in `sink` (the hash overlaps the write).
fn stream(
    file: &mut File,
    len_hint: u64,
    on_read: &mut (dyn FnMut(&[u8]) + Send),
    sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
) -> io::Result<u64> {
    if len_hint < PIPELINE_MIN {
        let mut buf = vec![0u8; SMALL_BUF.min(len_hint as usize + 1).max(4096)];
        let mut total = 0u64;
        loop {
            let n = read_full(file, &mut buf)?;
            if n == 0 {
                return Ok(total);
            }
            total += n as u64;
            on_read(&buf[..n]);
            sink(&buf[..n])?;
        }
    }
    let (full_tx, full_rx) = mpsc::sync_channel::<io::Result<(Vec<u8>, usize)>>(BUFFERS);
    let (free_tx, free_rx) = mpsc::sync_channel::<Vec<u8>>(BUFFERS);
    for _ in 0..BUFFERS {
        free_tx.send(vec![0u8; BIG_BUF]).expect("channel has room");
    }
    std::thread::scope(|s| {
        s.spawn(move || {
            while let Ok(mut buf) = free_rx.recv() {
                match read_full(file, &mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        on_read(&buf[..n]);
                        if full_tx.send(Ok((buf, n))).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = full_tx.send(Err(e));
                        break;
                    }
                }
            }
        });
        let mut total = 0u64;
        // The reader ends (dropping its sender) at end of file or on error.
        for item in full_rx.iter() {
            let (buf, n) = item?;
            total += n as u64;
            sink(&buf[..n])?;
            // The reader may already have stopped; a lost buffer is fine then.
            let _ = free_tx.send(buf);
        }
        Ok(total)
    })
}

/// Fills `buf` as far as the file allows (short reads only at end of file).
fn read_full(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// SHA-256 and size of one file.
pub fn hash_file(path: &Path) -> Result<FileDigest, HashError> {
    let mut f = File::open(path).map_err(err(path, "open for hashing"))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut h = Sha256::new();
    let size = stream(&mut f, len, &mut |_| {}, &mut |b| {
        h.update(b);
        Ok(())
    })
    .map_err(err(path, "read"))?;
    Ok(FileDigest {
        size,
        sha256: h.finalize().into(),
    })
}

/// Copies `src` to a new file `dst` (which must not exist) and returns the
/// digest of the bytes written, read once.
pub fn copy_hashed(src: &Path, dst: &Path) -> Result<FileDigest, HashError> {
    let mut f = File::open(src).map_err(err(src, "open for copying"))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut out = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)
        .map_err(err(dst, "create"))?;
    let mut h = Sha256::new();
    let mut write_failed = None;
    let size = stream(&mut f, len, &mut |b| h.update(b), &mut |b| {
        out.write_all(b).inspect_err(|e| {
            write_failed = Some(io::Error::new(e.kind(), e.to_string()));
        })
    });
    if let Some(e) = write_failed {
        return Err(err(dst, "write")(e));
    }
    let size = size.map_err(err(src, "read"))?;
    Ok(FileDigest {
        size,
        sha256: h.finalize().into(),
    })
}

/// Hashes `root/<rel>` for every `rel`, in parallel; results in input order.
pub fn hash_all(root: &Path, rels: &[String]) -> Vec<Result<FileDigest, HashError>> {
    rels.par_iter().map(|r| hash_file(&root.join(r))).collect()
}

/// The digest of the weights `ckpt` reads ([`WeightsDigest`]): every
/// safetensors file it opened, and the shard index when there is one, hashed
/// in parallel. Exact and stable (another seed or a fine-tune with the same
/// config.json differs, which shard headers alone would not show), at the
/// cost of reading the weights once more: 9-14 GB take about 5-25 s here
/// (README, `package`: `bench hash` numbers), against minutes of conversion
/// or parity, which read them anyway.
pub fn weights_digest(ckpt: &Checkpoint) -> Result<WeightsDigest, HashError> {
    let mut names: Vec<String> = ckpt
        .weight_files
        .iter()
        .filter_map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    if ckpt.dir.join(SHARD_INDEX).is_file() {
        names.push(SHARD_INDEX.to_string());
    }
    names.sort();
    let mut files = BTreeMap::new();
    for (name, d) in names.iter().zip(hash_all(&ckpt.dir, &names)) {
        files.insert(name.clone(), d?.hex());
    }
    Ok(WeightsDigest {
        sha256: lines_digest(files.iter().map(|(n, d)| (n.as_str(), d.clone()))),
        files,
    })
}

/// The shard index of a sharded checkpoint.
const SHARD_INDEX: &str = "model.safetensors.index.json";

/// Orders relative POSIX paths by their components, the order the OpenSSF
/// model signing format lists resources in (Python sorts `PurePosixPath`s
/// that way): `a/b` comes before `a.b`, although `.` < `/` as bytes.
pub fn cmp_components(a: &str, b: &str) -> Ordering {
    a.split('/').cmp(b.split('/'))
}

/// What a walk of a folder found, as relative POSIX paths. Every path in
/// `files`, `dirs`, `symlinks` and `special` is made of plain components
/// ([`check_rel_path`]): a name that is not one is in `bad_names` instead,
/// and nothing below a folder of such a name is listed.
#[derive(Debug, Default)]
pub struct Tree {
    /// Regular files, sorted by components.
    pub files: Vec<String>,
    /// Folders, parents before their children.
    pub dirs: Vec<String>,
    /// Symbolic links (never followed).
    pub symlinks: Vec<String>,
    /// Sockets, pipes, devices.
    pub special: Vec<String>,
    /// Names that are not one plain path component (a backslash, a control
    /// character) or not valid UTF-8: they cannot be listed in a signature,
    /// and a path joined from them could mean another file.
    pub bad_names: Vec<BadName>,
}

/// A name a walk refused: its path as far as it can be shown, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadName {
    /// The relative path, non-UTF-8 bytes replaced, control characters
    /// escaped (`\n`), so that a message shows it on one line.
    pub path: String,
    pub why: &'static str,
}

impl std::fmt::Display for BadName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "file name '{}' {}: not one plain path component",
            self.path, self.why
        )
    }
}

/// `name` with control characters escaped, for a message.
pub fn shown(name: &str) -> String {
    name.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

impl Tree {
    /// The first entry that is not a regular file or folder with a plain
    /// name, as an error naming it: what every input folder chunkforge
    /// copies or reads must be (a symlink could lead out of it, a FIFO
    /// would block the read, a name that is not plain could mean another
    /// path).
    pub fn refuse_odd(&self, root: &Path) -> Result<(), HashError> {
        let odd = |rel: &str, why: String| HashError {
            path: root.join(rel),
            action: "",
            source: io::Error::other(why),
        };
        if let Some(b) = self.bad_names.first() {
            return Err(odd(
                &b.path,
                format!(
                    "file name {}, so it is not one plain path component; rename it",
                    b.why
                ),
            ));
        }
        if let Some(l) = self.symlinks.first() {
            return Err(odd(
                l,
                "is a symlink; chunkforge reads no symlink in a build, release or bundle folder (one could lead out of it): copy the file in".into(),
            ));
        }
        if let Some(s) = self.special.first() {
            return Err(odd(
                s,
                "is not a regular file or folder (a FIFO, socket or device)".into(),
            ));
        }
        Ok(())
    }
}

/// Walks `root` without following symlinks. Entries for which `skip` returns
/// true (given the relative path) are left out, with everything below them.
/// A name that is not one plain path component is listed in `bad_names`
/// (never turned into another path: `a\b` is not `a/b`), and nothing below
/// it is read.
pub fn walk(root: &Path, skip: &dyn Fn(&str) -> bool) -> Result<Tree, HashError> {
    let mut tree = Tree::default();
    let mut it = walkdir::WalkDir::new(root)
        .follow_links(false)
        .min_depth(1)
        .into_iter();
    while let Some(entry) = it.next() {
        let entry = entry.map_err(|e| {
            let path = e.path().unwrap_or(root).to_path_buf();
            HashError {
                path,
                action: "list",
                source: e
                    .into_io_error()
                    .unwrap_or_else(|| io::Error::other("filesystem loop")),
            }
        })?;
        let ft = entry.file_type();
        let rel_path = entry.path().strip_prefix(root).unwrap_or(entry.path());
        let checked = match rel_path.to_str() {
            None => Err("is not valid UTF-8"),
            Some(rel) => check_rel_path(rel).map(|()| rel.to_string()),
        };
        let rel = match checked {
            Ok(rel) => rel,
            Err(why) => {
                tree.bad_names.push(BadName {
                    path: shown(&rel_path.to_string_lossy()),
                    why,
                });
                if ft.is_dir() {
                    it.skip_current_dir();
                }
                continue;
            }
        };
        if skip(&rel) {
            if ft.is_dir() {
                it.skip_current_dir();
            }
            continue;
        }
        if ft.is_symlink() {
            tree.symlinks.push(rel);
        } else if ft.is_file() {
            tree.files.push(rel);
        } else if ft.is_dir() {
            tree.dirs.push(rel);
        } else {
            tree.special.push(rel);
        }
    }
    tree.files.sort_by(|a, b| cmp_components(a, b));
    tree.symlinks.sort();
    tree.special.sort();
    Ok(tree)
}

/// The entry `root/rel` without following a symlink anywhere below `root`:
/// its metadata (None: missing), or an error naming the first component of
/// `rel` that is a symlink or whose name is not plain. What a reader of an
/// input folder uses for a file it opens by name (a link in any folder on
/// the way could lead out of `root`).
pub fn entry_in(root: &Path, rel: &str) -> Result<Option<fs::Metadata>, HashError> {
    let refuse = |at: PathBuf, why: String| HashError {
        path: at,
        action: "",
        source: io::Error::other(why),
    };
    check_rel_path(rel).map_err(|why| refuse(root.join(rel), format!("the path {why}")))?;
    let mut at = root.to_path_buf();
    let parts: Vec<&str> = rel.split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        at.push(part);
        let meta = match fs::symlink_metadata(&at) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(err(&at, "inspect")(e)),
        };
        if meta.file_type().is_symlink() {
            return Err(refuse(
                at,
                "is a symlink; chunkforge reads no symlink in a build, release or bundle folder (one could lead out of it): copy the file in".into(),
            ));
        }
        if i + 1 == parts.len() {
            return Ok(Some(meta));
        }
        if !meta.is_dir() {
            return Ok(None);
        }
    }
    Ok(None)
}

/// SHA-256 over `name\0sha256\n` lines, in the order given: the digest of a
/// folder tree (`build.json`'s `sha256_tree`, lines sorted by path) and of a
/// build (`tree_sha256`, one line per package).
pub fn lines_digest<'a>(lines: impl IntoIterator<Item = (&'a str, String)>) -> String {
    let mut h = Sha256::new();
    for (name, digest) in lines {
        h.update(name.as_bytes());
        h.update(b"\0");
        h.update(digest.as_bytes());
        h.update(b"\n");
    }
    hex(&h.finalize())
}

/// The digest of a tree from its files' digests (paths relative to the tree).
pub fn tree_sha256(files: &BTreeMap<String, FileDigest>) -> String {
    lines_digest(files.iter().map(|(rel, d)| (rel.as_str(), d.hex())))
}

/// Size and SHA-256 of every regular file below `root`, by relative path
/// (`/`-separated), hashed in parallel. A symlink, special file or name
/// that is not plain is an error ([`Tree::refuse_odd`]): a package is plain files.
pub fn file_digests(root: &Path) -> Result<BTreeMap<String, FileDigest>, HashError> {
    let tree = walk(root, &|_| false)?;
    tree.refuse_odd(root)?;
    let digests = hash_all(root, &tree.files);
    tree.files
        .into_iter()
        .zip(digests)
        .map(|(rel, d)| d.map(|d| (rel, d)))
        .collect()
}

/// [`tree_sha256`] of the folder `root`.
pub fn tree_digest(root: &Path) -> Result<String, HashError> {
    Ok(tree_sha256(&file_digests(root)?))
}

/// SHA-256 of one file, as hex.
pub fn sha256_file(path: &Path) -> Result<String, HashError> {
    Ok(hash_file(path)?.hex())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_order_differs_from_byte_order() {
        let mut v = vec!["a.b", "a/b", "a-c/x", "a"];
        v.sort_by(|a, b| cmp_components(a, b));
        assert_eq!(v, ["a", "a/b", "a-c/x", "a.b"]);
    }

    #[test]
    fn pipelined_and_small_paths_agree_with_one_shot() {
        let dir = std::env::temp_dir().join(format!("cf-hash-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        for len in [0usize, 1, 4096, (PIPELINE_MIN as usize) + BIG_BUF + 17] {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let p = dir.join(format!("f{len}"));
            fs::write(&p, &data).unwrap();
            let want: [u8; 32] = Sha256::digest(&data).into();
            let d = hash_file(&p).unwrap();
            assert_eq!((d.size, d.sha256), (len as u64, want), "len {len}");
            let q = dir.join(format!("g{len}"));
            let c = copy_hashed(&p, &q).unwrap();
            assert_eq!(c, d);
            assert_eq!(fs::read(&q).unwrap(), data);
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hex_round_trip() {
        let d: [u8; 32] = Sha256::digest(b"x").into();
        assert_eq!(parse_hex32(&hex(&d)), Some(d));
        assert_eq!(parse_hex32("zz"), None);
    }
}
