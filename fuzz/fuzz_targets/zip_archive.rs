//! Archives through the strict walker (`zipwalk::walk`, what `verify
//! --archive` uses). An input whose first byte is even is the archive itself
//! (seeded with a real release zip); odd, it is decoded into files that are
//! zipped the way `archive::write` zips a release, and then the walker must
//! accept them whenever their names are safe. The walker must report, never
//! panic or hang; and whenever it accepts an archive, two independent readers
//! must see exactly what it saw: the `zip` crate's central-directory reader
//! (what most extractors do) and its streaming reader, which walks local
//! headers from byte 0 (what a streaming extractor writes). A disagreement is
//! an archive that verifies but unpacks into something else: a finding.

#![no_main]

use std::io::{Cursor, Read};

use chunkforge_release::{archive, paths, zipwalk};
use libfuzzer_sys::arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

/// (name, SHA-256 of the contents) of one entry another reader opened.
fn read_one<R: Read>(mut f: zip::read::ZipFile<'_, R>) -> (String, [u8; 32]) {
    let mut data = Vec::new();
    f.read_to_end(&mut data)
        .unwrap_or_else(|e| panic!("accepted entry '{}' unreadable: {e}", f.name()));
    (f.name().to_string(), Sha256::digest(&data).into())
}

/// Files zipped as `archive::write` does; also whether the walker must
/// accept them (every name a safe, unique relative path).
fn zip_files(bytes: &[u8]) -> Option<(Vec<u8>, bool)> {
    let files = Vec::<(String, Vec<u8>)>::arbitrary(&mut Unstructured::new(bytes)).ok()?;
    let mut z = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let mut names = std::collections::BTreeSet::new();
    let mut safe = true;
    for (name, data) in files.iter().take(8) {
        // The writer itself refuses some names (duplicates, for one).
        z.start_file(
            name.as_str(),
            archive::entry_options(data.len() as u64),
        )
        .ok()?;
        std::io::Write::write_all(&mut z, data).ok()?;
        safe &= paths::check_rel_path(name).is_ok() && !name.ends_with('/');
        safe &= names.insert(name.clone());
    }
    Some((z.finish().ok()?.into_inner(), safe))
}

fuzz_target!(|input: &[u8]| {
    let Some((&mode, rest)) = input.split_first() else {
        return;
    };
    let (data, must_pass) = if mode % 2 == 0 {
        (input.to_vec(), false)
    } else {
        match zip_files(rest) {
            Some(z) => z,
            None => return,
        }
    };
    let data = data.as_slice();
    let (entries, problems) = zipwalk::walk(&mut Cursor::new(data), data.len() as u64);
    assert!(
        !must_pass || problems.is_empty(),
        "an archive as written is refused: {problems:?}"
    );
    if !problems.is_empty() {
        return;
    }
    let walked: Vec<(String, [u8; 32])> = entries.into_iter().map(|e| (e.name, e.sha256)).collect();

    let mut ar = zip::ZipArchive::new(Cursor::new(data)).expect("accepted archive opens");
    let central: Vec<_> = (0..ar.len())
        .map(|i| read_one(ar.by_index(i).expect("accepted entry opens")))
        .collect();
    assert_eq!(central, walked, "central-directory reader disagrees");

    // The streaming reader stops at the first central record; an archive
    // without entries has none, only the end record, which it cannot read.
    if walked.is_empty() {
        return;
    }
    let mut stream = Cursor::new(data);
    let mut streamed = Vec::new();
    while let Some(f) =
        zip::read::read_zipfile_from_stream(&mut stream).expect("accepted archive streams")
    {
        streamed.push(read_one(f));
    }
    assert_eq!(streamed, walked, "streaming reader disagrees");
});
