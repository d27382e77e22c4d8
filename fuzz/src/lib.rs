//! Helpers shared by the fuzz targets: a fixed signing key, a scratch folder
//! per process, and a validly signed bundle around arbitrary payload bytes
//! (so the fuzzer gets past the ECDSA check into the statement parser).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use chunkforge_release::sign;
use p256::ecdsa::signature::Signer as _;
use p256::ecdsa::{Signature, SigningKey};
use p256::pkcs8::{EncodePublicKey, LineEnding};

/// A real release's `manifest.json` (a synthetic build of the tiny E2B
/// fixture, layout two) cut to two packages and a few files: what
/// `Manifest::load` accepts, for the targets to edit.
pub const RELEASE_MANIFEST: &str = include_str!("release_manifest.json");

/// The fixed key every target signs and verifies with.
pub fn signing_key() -> &'static SigningKey {
    static KEY: OnceLock<SigningKey> = OnceLock::new();
    KEY.get_or_init(|| SigningKey::from_bytes(&[7u8; 32].into()).expect("valid scalar"))
}

/// This process's scratch folder (under `$TMPDIR`; scripts/fuzz.sh points it
/// at a folder it removes afterwards).
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("chunkforge-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("create the fuzz scratch folder");
        d
    })
}

/// `scratch()/key.pub`: the fixed key's public half in SubjectPublicKeyInfo PEM.
pub fn public_key_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let p = scratch().join("key.pub");
        let pem = signing_key()
            .verifying_key()
            .to_public_key_pem(LineEnding::LF)
            .expect("P-256 public keys encode");
        std::fs::write(&p, pem).expect("write the fuzz public key");
        p
    })
}

/// A Sigstore bundle whose DSSE envelope carries `payload` verbatim, signed
/// with `signing_key()` (as `sign::sign_bundle` does for a statement).
pub fn signed_bundle(payload: &[u8]) -> String {
    let key = signing_key();
    let sig: Signature = key.sign(&sign::pae(payload));
    serde_json::json!({
        "mediaType": sign::BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {
            "publicKey": {"hint": sign::key_hint(key.verifying_key())},
            "tlogEntries": [],
        },
        "dsseEnvelope": {
            "payload": B64.encode(payload),
            "payloadType": sign::PAYLOAD_TYPE,
            "signatures": [{"sig": B64.encode(sig.to_der().as_bytes()), "keyid": ""}],
        },
    })
    .to_string()
}
