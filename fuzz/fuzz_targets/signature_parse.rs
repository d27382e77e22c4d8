//! Arbitrary bytes through `sign::verify_bundle` with a fixed public key.
//! First byte even: the rest is `model.sig` as is (bundle, DSSE envelope,
//! base64, DER signature parsing). Odd: the rest is the DSSE payload, signed
//! with the fixed key, so the in-toto statement parser is reached too.

#![no_main]

use chunkforge_release::sign;
use chunkforge_fuzz::{scratch, signed_bundle, signing_key};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let path = scratch().join("model.sig");
    if mode & 1 == 0 {
        std::fs::write(&path, rest).unwrap();
    } else {
        std::fs::write(&path, signed_bundle(rest)).unwrap();
    }
    if let Ok(v) = sign::verify_bundle(&path, signing_key().verifying_key()) {
        // A verified statement's resources hash back to its subject digest.
        let _ = sign::root_digest(&v.resources);
    }
});
