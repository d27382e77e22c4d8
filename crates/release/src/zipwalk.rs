//! A strict reader for release archives. Zip readers disagree on hostile
//! archives: one trusts the central directory, a streaming extractor walks
//! the local headers, some keep the first of two entries with one name and
//! some the last. So this walk reads both structures itself and accepts an
//! archive only when there is one reading of it:
//!
//! - the end record is the last 22 bytes (no archive comment, nothing after
//!   it), one disk, and the zip64 records exactly when a count or offset
//!   needs them, agreeing with it;
//! - local entries tile the file from byte 0 to the central directory in the
//!   central directory's order, nothing between, before or after them;
//! - every local header agrees byte for byte with its central record (name,
//!   flags, method, time, CRC, sizes, extra field);
//! - flags: only UTF-8 names (no encryption, no data descriptor); methods:
//!   stored or deflated; extra fields: only zip64; no comments;
//! - entries are regular files with unique, safe relative names (no
//!   directories, symlinks, `..`, absolute paths, backslashes; non-ASCII
//!   names only flagged as UTF-8);
//! - each entry's data decodes to exactly its declared size and CRC, and a
//!   deflate stream ends exactly at its declared compressed size.
//!
//! What `archive::write` produces always passes.

use std::collections::BTreeSet;
use std::io::{Read, Seek, SeekFrom};

use sha2::{Digest, Sha256};

use crate::paths::check_rel_path;

/// One file entry, decoded and hashed.
pub struct Entry {
    pub name: String,
    pub sha256: [u8; 32],
}

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const END_SIG: u32 = 0x0605_4b50;
const ZIP64_END_SIG: u32 = 0x0606_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const ZIP64_EXTRA: u16 = 0x0001;
const UTF8_FLAG: u16 = 1 << 11;
/// A 32-bit size or offset field with this value is in the zip64 extra field.
const SAT32: u32 = u32::MAX;
const SAT16: u16 = u16::MAX;
const LOCAL_LEN: u64 = 30;
const CENTRAL_LEN: usize = 46;
const END_LEN: u64 = 22;
const ZIP64_END_LEN: u64 = 56;
const ZIP64_LOCATOR_LEN: u64 = 20;
/// A release has hundreds of entries; a central directory this large is not one.
const MAX_CENTRAL: u64 = 64 << 20;

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}

/// `len` bytes at `at`, or an error saying what was being read.
fn read_at<R: Read + Seek>(r: &mut R, at: u64, len: u64, what: &str) -> Result<Vec<u8>, String> {
    let mut b = vec![0u8; len as usize];
    r.seek(SeekFrom::Start(at))
        .and_then(|_| r.read_exact(&mut b))
        .map_err(|e| format!("cannot read the {what} at offset {at} ({e})"))?;
    Ok(b)
}

/// Where the central directory is and how many entries it holds.
struct Directory {
    offset: u64,
    size: u64,
    entries: u64,
}

/// Reads the end record (and the zip64 end records when the end record's
/// fields are saturated); the central directory must end where they begin.
fn directory<R: Read + Seek>(r: &mut R, len: u64) -> Result<Directory, String> {
    if len < END_LEN {
        return Err(format!(
            "{len} bytes is too short for a zip archive (no end record)"
        ));
    }
    let end_at = len - END_LEN;
    let e = read_at(r, end_at, END_LEN, "end record")?;
    if u32_at(&e, 0) != END_SIG || u16_at(&e, 20) != 0 {
        return Err(
            "the last 22 bytes are not an end record without comment (archives with a comment or data after the end record are refused)"
                .into(),
        );
    }
    let (disk, cd_disk) = (u16_at(&e, 4), u16_at(&e, 6));
    let (on_disk, total) = (u16_at(&e, 8), u16_at(&e, 10));
    let (size, offset) = (u32_at(&e, 12), u32_at(&e, 16));
    if disk != 0 || cd_disk != 0 || on_disk != total {
        return Err("the end record describes a multi-disk archive".into());
    }
    let zip64 = total == SAT16 || size == SAT32 || offset == SAT32;
    let (dir, dir_end) = if zip64 {
        let loc_at = end_at
            .checked_sub(ZIP64_LOCATOR_LEN)
            .ok_or("the end record needs zip64 records, but the archive is too short for them")?;
        let l = read_at(r, loc_at, ZIP64_LOCATOR_LEN, "zip64 end locator")?;
        if u32_at(&l, 0) != ZIP64_LOCATOR_SIG || u32_at(&l, 4) != 0 || u32_at(&l, 16) != 1 {
            return Err(format!(
                "the end record needs zip64 records, but no single-disk zip64 locator is at offset {loc_at}"
            ));
        }
        let z_at = u64_at(&l, 8);
        if z_at.checked_add(ZIP64_END_LEN) != Some(loc_at) {
            return Err(format!(
                "the zip64 end record at offset {z_at} does not end where its locator begins ({loc_at})"
            ));
        }
        let z = read_at(r, z_at, ZIP64_END_LEN, "zip64 end record")?;
        let dir = Directory {
            entries: u64_at(&z, 32),
            size: u64_at(&z, 40),
            offset: u64_at(&z, 48),
        };
        let agrees = u64::from(total) == dir.entries.min(u64::from(SAT16))
            && u64::from(size) == dir.size.min(u64::from(SAT32))
            && u64::from(offset) == dir.offset.min(u64::from(SAT32));
        if u32_at(&z, 0) != ZIP64_END_SIG
            || u64_at(&z, 4) != ZIP64_END_LEN - 12
            || u32_at(&z, 16) != 0
            || u32_at(&z, 20) != 0
            || u64_at(&z, 24) != dir.entries
            || !agrees
        {
            return Err(format!(
                "the zip64 end record at offset {z_at} is malformed or disagrees with the end record"
            ));
        }
        (dir, z_at)
    } else {
        let dir = Directory {
            entries: total.into(),
            size: size.into(),
            offset: offset.into(),
        };
        (dir, end_at)
    };
    if dir.offset.checked_add(dir.size) != Some(dir_end) {
        return Err(format!(
            "the central directory ({} bytes at offset {}) does not end where the end records begin ({dir_end})",
            dir.size, dir.offset
        ));
    }
    if dir.size > MAX_CENTRAL || dir.entries > dir.size / CENTRAL_LEN as u64 {
        return Err(format!(
            "the central directory ({} bytes) cannot hold {} entries",
            dir.size, dir.entries
        ));
    }
    Ok(dir)
}

/// One central directory record, its fields as stored.
struct Record<'a> {
    /// Bytes 6..30 of the central record (version needed to CRC and sizes);
    /// the local header's bytes 4..28 must equal them.
    common: &'a [u8],
    flags: u16,
    method: u16,
    crc: u32,
    compressed: u64,
    size: u64,
    offset: u64,
    name: &'a [u8],
    extra: &'a [u8],
    unix_mode: Option<u32>,
    dos_dir: bool,
}

/// The zip64 extra field's values, in the spec's order, for the fields whose
/// 32-bit value is saturated; it must hold exactly those and nothing else.
fn zip64_values(extra: &[u8], saturated: &[bool]) -> Result<Vec<u64>, String> {
    let mut values = Vec::new();
    let mut seen = false;
    let mut i = 0;
    while i < extra.len() {
        if extra.len() - i < 4 {
            return Err("has a truncated extra field".into());
        }
        let (id, n) = (u16_at(extra, i), u16_at(extra, i + 2) as usize);
        let body = extra
            .get(i + 4..i + 4 + n)
            .ok_or("has an extra field longer than its space")?;
        if id != ZIP64_EXTRA || seen {
            return Err(format!(
                "has extra field 0x{id:04x} (only one zip64 field is allowed)"
            ));
        }
        seen = true;
        if n % 8 != 0 {
            return Err("has a malformed zip64 field".into());
        }
        values = body.chunks(8).map(|c| u64_at(c, 0)).collect();
        i += 4 + n;
    }
    let want = saturated.iter().filter(|s| **s).count();
    if values.len() != want {
        return Err(format!(
            "has a zip64 field with {} values where its header needs {want}",
            values.len()
        ));
    }
    Ok(values)
}

/// Parses the central record at the start of `b`; returns it and its length.
fn record(b: &[u8]) -> Result<(Record<'_>, usize), String> {
    if b.len() < CENTRAL_LEN || u32_at(b, 0) != CENTRAL_SIG {
        return Err("is not a central directory record".into());
    }
    let (name_len, extra_len, comment_len) = (
        u16_at(b, 28) as usize,
        u16_at(b, 30) as usize,
        u16_at(b, 32) as usize,
    );
    let total = CENTRAL_LEN + name_len + extra_len + comment_len;
    if b.len() < total {
        return Err("runs past the end of the central directory".into());
    }
    let name = &b[CENTRAL_LEN..CENTRAL_LEN + name_len];
    let extra = &b[CENTRAL_LEN + name_len..CENTRAL_LEN + name_len + extra_len];
    let at = |e: &str| format!("entry '{}' {e}", String::from_utf8_lossy(name));
    let (csize, usize_, offset) = (u32_at(b, 20), u32_at(b, 24), u32_at(b, 42));
    let fields = [usize_ == SAT32, csize == SAT32, offset == SAT32];
    let mut z = zip64_values(extra, &fields)
        .map_err(|e| at(&e))?
        .into_iter();
    let mut value = |v: u32| {
        if v == SAT32 {
            z.next().unwrap_or(0)
        } else {
            v.into()
        }
    };
    let (size, compressed, offset) = (value(usize_), value(csize), value(offset));
    if comment_len != 0 {
        return Err(at("has an entry comment"));
    }
    if u16_at(b, 34) != 0 {
        return Err(at("starts on another disk"));
    }
    let external = u32_at(b, 38);
    // Unix modes only mean something when the record says it was made on Unix.
    let unix_mode = (u16_at(b, 4) >> 8 == 3).then_some(external >> 16);
    let rec = Record {
        common: &b[6..30],
        flags: u16_at(b, 8),
        method: u16_at(b, 10),
        crc: u32_at(b, 16),
        compressed,
        size,
        offset,
        name,
        extra,
        unix_mode,
        dos_dir: external & 0x10 != 0,
    };
    Ok((rec, total))
}

/// The entry's name if it is one a release file can have, else why not.
fn entry_name(rec: &Record) -> Result<String, String> {
    let shown = String::from_utf8_lossy(rec.name).into_owned();
    let name =
        std::str::from_utf8(rec.name).map_err(|_| format!("entry '{shown}': name is not UTF-8"))?;
    // Without the UTF-8 flag, extractors read non-ASCII names as CP437 or
    // the local code page: each would write another file name.
    if !name.is_ascii() && rec.flags & UTF8_FLAG == 0 {
        return Err(format!(
            "entry '{name}': non-ASCII name without the UTF-8 flag (extractors would decode it differently)"
        ));
    }
    if name.ends_with('/') || rec.dos_dir {
        return Err(format!(
            "entry '{name}' is a directory entry (release archives hold only files)"
        ));
    }
    if let Err(why) = check_rel_path(name) {
        return Err(format!(
            "entry '{name}' would escape the target folder: its path {why}"
        ));
    }
    match rec.unix_mode.map(|m| m & 0o170000) {
        Some(0o120000) => Err(format!("entry '{name}' is a symlink")),
        Some(0) | Some(0o100000) | None => Ok(name.to_string()),
        Some(t) => Err(format!(
            "entry '{name}' is not a regular file (Unix file type 0o{t:o})"
        )),
    }
}

/// Decodes `rec`'s data at `at` (stored or raw deflate), requiring exactly
/// its declared sizes and CRC; returns the content's SHA-256.
fn content<R: Read + Seek>(r: &mut R, at: u64, rec: &Record) -> Result<[u8; 32], String> {
    r.seek(SeekFrom::Start(at))
        .map_err(|e| format!("cannot seek to its data ({e})"))?;
    let mut input = r.take(rec.compressed);
    let mut sha = Sha256::new();
    let mut crc = crc32fast::Hasher::new();
    let mut out_len = 0u64;
    let mut buf = vec![0u8; 1 << 16];
    let mut inflate = flate2::Decompress::new(false);
    let mut out = vec![0u8; 1 << 16];
    let mut ended = false;
    loop {
        let n = input
            .read(&mut buf)
            .map_err(|e| format!("cannot read its data ({e})"))?;
        if n == 0 {
            break;
        }
        if rec.method == 0 {
            out_len += n as u64;
            sha.update(&buf[..n]);
            crc.update(&buf[..n]);
            continue;
        }
        let mut chunk = &buf[..n];
        while !chunk.is_empty() || !ended {
            if ended {
                return Err("has bytes after the end of its deflate stream".into());
            }
            let (before_in, before_out) = (inflate.total_in(), inflate.total_out());
            let status = inflate
                .decompress(chunk, &mut out, flate2::FlushDecompress::None)
                .map_err(|e| format!("has a corrupt deflate stream ({e})"))?;
            let used = (inflate.total_in() - before_in) as usize;
            let made = (inflate.total_out() - before_out) as usize;
            chunk = &chunk[used..];
            out_len += made as u64;
            if out_len > rec.size {
                return Err(format!(
                    "inflates to more than its declared {} bytes",
                    rec.size
                ));
            }
            sha.update(&out[..made]);
            crc.update(&out[..made]);
            ended = status == flate2::Status::StreamEnd;
            if used == 0 && made == 0 {
                break; // needs more input
            }
        }
    }
    if input.limit() != 0 {
        return Err("its data runs past the end of the file".into());
    }
    if rec.method != 0 && !ended {
        return Err("its deflate stream is cut short".into());
    }
    if out_len != rec.size {
        return Err(format!(
            "holds {out_len} bytes, but its headers declare {}",
            rec.size
        ));
    }
    let got = crc.finalize();
    if got != rec.crc {
        return Err(format!(
            "has CRC-32 {got:08x}, but its headers declare {:08x}",
            rec.crc
        ));
    }
    Ok(sha.finalize().into())
}

/// Walks the archive `r` of `len` bytes: every local header and the central
/// directory, checked against each other (see the module doc). Returns the
/// file entries (hashed) and every problem, each naming its entry; a problem
/// with the archive's structure ends the walk.
pub fn walk<R: Read + Seek>(r: &mut R, len: u64) -> (Vec<Entry>, Vec<String>) {
    let mut entries = Vec::new();
    let mut problems = Vec::new();
    if let Err(e) = walk_into(r, len, true, &mut entries, &mut problems) {
        problems.push(e);
    }
    (entries, problems)
}

/// The entry names, if the archive's structure passes the walk (contents
/// are not decoded, so this costs a few reads however large the archive);
/// else the first problem.
pub fn names<R: Read + Seek>(r: &mut R, len: u64) -> Result<Vec<String>, String> {
    let mut entries = Vec::new();
    let mut problems = Vec::new();
    walk_into(r, len, false, &mut entries, &mut problems)?;
    match problems.into_iter().next() {
        Some(p) => Err(p),
        None => Ok(entries.into_iter().map(|e| e.name).collect()),
    }
}

/// The walk; `decode` false skips decoding contents (their SHA-256 is then zero).
fn walk_into<R: Read + Seek>(
    r: &mut R,
    len: u64,
    decode: bool,
    entries: &mut Vec<Entry>,
    problems: &mut Vec<String>,
) -> Result<(), String> {
    let dir = directory(r, len)?;
    let cd = read_at(r, dir.offset, dir.size, "central directory")?;
    let mut names = BTreeSet::new();
    // Where the next local header must begin: right after the previous entry.
    let mut next = 0u64;
    let mut i = 0usize;
    for n in 0..dir.entries {
        let (rec, rec_len) = record(&cd[i..]).map_err(|e| {
            format!(
                "central directory record #{n} (at offset {}): {e}",
                dir.offset + i as u64
            )
        })?;
        i += rec_len;
        let shown = String::from_utf8_lossy(rec.name).into_owned();
        let at = |e: String| format!("entry '{shown}': {e}");
        if rec.flags & !UTF8_FLAG != 0 {
            return Err(at(format!(
                "general-purpose flags 0x{:04x}: only the UTF-8 flag is allowed (no encryption, no data descriptor)",
                rec.flags
            )));
        }
        if rec.method != 0 && rec.method != 8 {
            return Err(at(format!(
                "compression method {} (only stored and deflated are allowed)",
                rec.method
            )));
        }
        if rec.method == 0 && rec.compressed != rec.size {
            return Err(at(format!(
                "stored, but declares {} compressed and {} uncompressed bytes",
                rec.compressed, rec.size
            )));
        }
        if rec.offset != next {
            return Err(at(format!(
                "its local header is at offset {}, but the previous entry ends at {next} (entries must follow each other with nothing between, before or hidden among them)",
                rec.offset
            )));
        }
        let fixed = read_at(r, rec.offset, LOCAL_LEN, "local header").map_err(at)?;
        let (name_len, extra_len) = (u16_at(&fixed, 26) as u64, u16_at(&fixed, 28) as u64);
        let var = read_at(
            r,
            rec.offset + LOCAL_LEN,
            name_len + extra_len,
            "local header",
        )
        .map_err(at)?;
        let (local_name, local_extra) = var.split_at(name_len as usize);
        if u32_at(&fixed, 0) != LOCAL_SIG {
            return Err(at(format!("no local header at offset {}", rec.offset)));
        }
        if local_name != rec.name {
            return Err(at(format!(
                "its local header names '{}' (an extractor reading local headers would write that file)",
                String::from_utf8_lossy(local_name)
            )));
        }
        if fixed[4..28] != *rec.common || local_extra != rec.extra {
            return Err(at(
                "its local header disagrees with the central directory (version, flags, method, time, CRC, sizes or extra field)".into(),
            ));
        }
        let data_at = rec.offset + LOCAL_LEN + name_len + extra_len;
        next = data_at
            .checked_add(rec.compressed)
            .filter(|end| *end <= dir.offset)
            .ok_or_else(|| {
                at(format!(
                    "its {} bytes of data run into the central directory",
                    rec.compressed
                ))
            })?;
        let name = match entry_name(&rec) {
            Ok(name) => name,
            Err(e) => {
                problems.push(e);
                continue;
            }
        };
        if !names.insert(name.clone()) {
            problems.push(format!(
                "entry '{name}' appears more than once (extractors differ on which copy they keep)"
            ));
            continue;
        }
        let sha256 = if decode {
            content(r, data_at, &rec).map_err(at)?
        } else {
            [0; 32]
        };
        entries.push(Entry { name, sha256 });
    }
    if i != cd.len() {
        return Err(format!(
            "the central directory holds {} bytes after its {} records",
            cd.len() - i,
            dir.entries
        ));
    }
    if next != dir.offset {
        return Err(format!(
            "{} bytes between the last entry (ends at {next}) and the central directory are not part of any entry (a streaming extractor could read them as more files)",
            dir.offset - next
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::io::{self, Cursor, Write};

    use zip::ZipWriter;

    use super::*;
    use crate::archive::entry_options;

    /// An archive written the way `archive::write` writes one.
    fn archive_of(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut z = ZipWriter::new(Cursor::new(Vec::new()));
        for (name, data) in files {
            z.start_file(*name, entry_options(data.len() as u64))
                .unwrap();
            z.write_all(data).unwrap();
        }
        z.finish().unwrap().into_inner()
    }

    /// An archive as `archive::write` wrote one before every entry was
    /// stored: text files deflated (verify still reads those archives).
    fn deflated_archive_of(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut z = ZipWriter::new(Cursor::new(Vec::new()));
        for (name, data) in files {
            let options = entry_options(data.len() as u64);
            let options = if name.ends_with(".bin") {
                options
            } else {
                options.compression_method(zip::CompressionMethod::Deflated)
            };
            z.start_file(*name, options).unwrap();
            z.write_all(data).unwrap();
        }
        z.finish().unwrap().into_inner()
    }

    fn problems(b: &[u8]) -> Vec<String> {
        walk(&mut Cursor::new(b), b.len() as u64).1
    }

    fn refused(b: &[u8], want: &str) {
        let p = problems(b);
        assert!(
            p.iter().any(|p| p.contains(want)),
            "expected {want:?} in {p:#?}"
        );
    }

    /// Offset of the `nth` occurrence of `what` in `b`.
    fn find(b: &[u8], what: &[u8], nth: usize) -> usize {
        (0..b.len())
            .filter(|&i| b[i..].starts_with(what))
            .nth(nth)
            .expect("pattern present")
    }

    const FILES: &[(&str, &[u8])] = &[
        ("manifest.json", b"{\"format\": \"chunkforge-release/1\"}\n"),
        ("p.mlpackage/weights/weight.bin", &[7u8; 300]),
    ];

    #[test]
    fn our_archives_pass_and_read_back() {
        let b = archive_of(FILES);
        let (entries, problems) = walk(&mut Cursor::new(&b), b.len() as u64);
        assert!(problems.is_empty(), "{problems:?}");
        let got: Vec<_> = entries
            .iter()
            .map(|e| (e.name.as_str(), e.sha256))
            .collect();
        let want: Vec<_> = FILES
            .iter()
            .map(|(n, d)| (*n, <[u8; 32]>::from(Sha256::digest(d))))
            .collect();
        assert_eq!(got, want);
        let names = names(&mut Cursor::new(&b), b.len() as u64).unwrap();
        assert_eq!(names, ["manifest.json", "p.mlpackage/weights/weight.bin"]);
    }

    #[test]
    fn flags_methods_and_extras_other_than_ours_are_refused() {
        let b = archive_of(FILES);
        let local = find(&b, &LOCAL_SIG.to_le_bytes(), 0);
        let central = find(&b, &CENTRAL_SIG.to_le_bytes(), 0);
        // Data descriptor flag (bit 3), in both headers so they still agree.
        let mut d = b.clone();
        d[local + 6] |= 8;
        d[central + 8] |= 8;
        refused(&d, "entry 'manifest.json': general-purpose flags 0x0008");
        // bzip2 instead of deflate.
        let mut m = b.clone();
        m[local + 8] = 12;
        m[central + 10] = 12;
        refused(&m, "entry 'manifest.json': compression method 12");
        // Only the central record changed: the local header no longer agrees.
        let mut t = b.clone();
        t[central + 12] ^= 1;
        refused(&t, "entry 'manifest.json': its local header disagrees");
        // A Unicode-path extra field (0x7075): Info-ZIP and 7-Zip write the
        // file under the name in it, not under the header's name.
        let mut z = ZipWriter::new(Cursor::new(Vec::new()));
        let mut opts = zip::write::FullFileOptions::default();
        let mut upath = vec![1];
        // (The writer checks this CRC before it knows the name: that of "".)
        upath.extend_from_slice(&crc32fast::hash(b"").to_le_bytes());
        upath.extend_from_slice(b"../evil");
        opts.add_extra_data(0x7075, upath.into_boxed_slice(), false)
            .unwrap();
        z.start_file("a", opts).unwrap();
        z.write_all(b"x").unwrap();
        let x = z.finish().unwrap().into_inner();
        refused(&x, "entry 'a' has extra field 0x7075");
    }

    #[test]
    fn names_extractors_would_read_differently_are_refused() {
        // A name byte above 0x7f without the UTF-8 flag: CP437 to one
        // extractor, UTF-8 or the local code page to others.
        let b = archive_of(&[("caf\u{e9}", b"x")]);
        let mut n = b.clone();
        for sig in [LOCAL_SIG, CENTRAL_SIG] {
            let at = find(&n, &sig.to_le_bytes(), 0);
            let flag = if sig == LOCAL_SIG { at + 6 } else { at + 8 };
            n[flag + 1] &= !((UTF8_FLAG >> 8) as u8);
        }
        refused(&n, "non-ASCII name without the UTF-8 flag");
        assert!(problems(&b).is_empty(), "{:?}", problems(&b));
    }

    #[test]
    fn comments_and_trailing_bytes_are_refused() {
        let mut z = ZipWriter::new(Cursor::new(Vec::new()));
        z.set_comment("PK\u{5}\u{6} a fake end record");
        z.start_file("a", entry_options(1)).unwrap();
        z.write_all(b"x").unwrap();
        refused(
            &z.finish().unwrap().into_inner(),
            "not an end record without comment",
        );
        let mut b = archive_of(FILES);
        b.extend_from_slice(b"tail");
        refused(&b, "not an end record without comment");
        let mut front = b"MZ".to_vec();
        front.extend_from_slice(&archive_of(FILES));
        refused(&front, "does not end where the end records begin");
        refused(&b"PK\x05\x06"[..], "too short");
    }

    #[test]
    fn deflate_streams_must_match_their_declared_sizes() {
        let b = deflated_archive_of(FILES);
        let local = find(&b, &LOCAL_SIG.to_le_bytes(), 0);
        let central = find(&b, &CENTRAL_SIG.to_le_bytes(), 0);
        let size = u32_at(&b, local + 22);
        for (declared, want) in [(size - 1, "inflates to more than"), (size + 1, "holds")] {
            let mut s = b.clone();
            s[local + 22..local + 26].copy_from_slice(&declared.to_le_bytes());
            s[central + 24..central + 28].copy_from_slice(&declared.to_le_bytes());
            refused(&s, &format!("entry 'manifest.json': {want}"));
        }
        let mut c = b.clone();
        c[local + 14] ^= 1;
        c[central + 16] ^= 1;
        refused(&c, "entry 'manifest.json': has CRC-32");
    }

    /// A file that keeps only the 4 KiB pages holding something other than
    /// zeros, so an archive past 4 GiB (zip64) fits in memory.
    #[derive(Default)]
    struct Sparse {
        pages: BTreeMap<u64, Box<[u8; 4096]>>,
        len: u64,
        pos: u64,
    }

    impl Write for Sparse {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            let (page, at) = (self.pos / 4096, (self.pos % 4096) as usize);
            let n = b.len().min(4096 - at);
            if self.pages.contains_key(&page) || b[..n].iter().any(|&x| x != 0) {
                let p = self
                    .pages
                    .entry(page)
                    .or_insert_with(|| Box::new([0; 4096]));
                p[at..at + n].copy_from_slice(&b[..n]);
            }
            self.pos += n as u64;
            self.len = self.len.max(self.pos);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Read for Sparse {
        fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
            let (page, at) = (self.pos / 4096, (self.pos % 4096) as usize);
            let n = b
                .len()
                .min(4096 - at)
                .min((self.len - self.pos.min(self.len)) as usize);
            match self.pages.get(&page) {
                Some(p) => b[..n].copy_from_slice(&p[at..at + n]),
                None => b[..n].fill(0),
            }
            self.pos += n as u64;
            Ok(n)
        }
    }

    impl Seek for Sparse {
        fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
            self.pos = match to {
                SeekFrom::Start(p) => p,
                SeekFrom::End(d) => self.len.saturating_add_signed(d),
                SeekFrom::Current(d) => self.pos.saturating_add_signed(d),
            };
            Ok(self.pos)
        }
    }

    /// A weight file of 4 GiB: zip64 sizes for it, a zip64 offset for the
    /// entry after it, zip64 end records. All must pass as written.
    #[test]
    fn zip64_archives_as_written_pass() {
        let big = u64::from(u32::MAX) + 2;
        let mut z = ZipWriter::new(Sparse::default());
        z.start_file("a/weights/w.bin", entry_options(big)).unwrap();
        io::copy(&mut io::repeat(0).take(big), &mut z).unwrap();
        z.start_file("manifest.json", entry_options(3)).unwrap();
        z.write_all(b"{}\n").unwrap();
        let mut f = z.finish().unwrap();
        let len = f.len;
        let names = names(&mut f, len).unwrap();
        assert_eq!(names, ["a/weights/w.bin", "manifest.json"]);
        let (entries, problems) = walk(&mut f, len);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(entries[1].sha256, <[u8; 32]>::from(Sha256::digest(b"{}\n")));
    }
}
