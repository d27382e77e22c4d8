//! The OpenSSF model signing format (PyPI `model-signing` 1.x, "sign key" /
//! "verify key"), written and read without Python:
//!
//! `model.sig` is a Sigstore bundle (`application/vnd.dev.sigstore.bundle.v0.3+json`)
//! holding a DSSE envelope. The envelope's payload is an in-toto Statement v1
//! with predicate type `https://model_signing/signature/v1.0`; the predicate
//! lists every regular file (`resources`: relative POSIX path, `sha256`, hex
//! digest) sorted by path components, and says how the list was made
//! (`serialization`). The subject digest is SHA-256 over the concatenated raw
//! file digests in list order. The signature is ECDSA P-256 / SHA-256 (DER)
//! over the DSSE pre-authentication encoding of the payload, and
//! `verificationMaterial.publicKey.hint` is the hex SHA-256 of the signer's
//! public key in PEM (LF line endings).
//!
//! Signing is deterministic (RFC 6979 nonces), so the same key and the same
//! files give the same `model.sig` byte for byte.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use chunkforge_model::checkpoint::json_kind;
use p256::ecdsa::signature::{Signer as _, Verifier as _};
use p256::ecdsa::{DerSignature, Signature, SigningKey, VerifyingKey};
use p256::pkcs8::{
    DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey, LineEnding,
};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::hashing::{self, hex, FileDigest};
use crate::keykind;
use crate::strict_json;

pub const BUNDLE_MEDIA_TYPE: &str = "application/vnd.dev.sigstore.bundle.v0.3+json";
pub const PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";
pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
pub const PREDICATE_TYPE: &str = "https://model_signing/signature/v1.0";
/// The signature's own file name, always in `ignore_paths`.
pub const SIG_FILE: &str = "model.sig";

/// Problems with keys and signatures.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("{}: {message}", path.display())]
    Key { path: PathBuf, message: String },
    #[error("{}: could not {action}: {source}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: refusing to overwrite an existing key file (pick another --out prefix or move it away)", path.display())]
    Exists { path: PathBuf },
    #[error("{}: not a valid model signature: {message}", path.display())]
    Format { path: PathBuf, message: String },
    #[error("{}: the signature does not verify with this public key{hint}", path.display())]
    BadSignature { path: PathBuf, hint: String },
}

fn io_err<'a>(
    path: &'a Path,
    action: &'static str,
) -> impl FnOnce(std::io::Error) -> SignError + 'a {
    move |source| SignError::Io {
        path: path.to_path_buf(),
        action,
        source,
    }
}

/// Writes a fresh P-256 key pair: `PREFIX.pem` (PKCS#8, mode 0600) and
/// `PREFIX.pub` (SubjectPublicKeyInfo PEM). Never overwrites either.
pub fn keygen(prefix: &Path) -> Result<(PathBuf, PathBuf), SignError> {
    let name = prefix
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if name.is_empty() {
        return Err(SignError::Key {
            path: prefix.to_path_buf(),
            message:
                "--out needs a file prefix, e.g. keys/release (writes release.pem, release.pub)"
                    .into(),
        });
    }
    let priv_path = prefix.with_file_name(format!("{name}.pem"));
    let pub_path = prefix.with_file_name(format!("{name}.pub"));
    for p in [&priv_path, &pub_path] {
        if p.exists() || p.is_symlink() {
            return Err(SignError::Exists { path: p.clone() });
        }
    }
    let key = SigningKey::random(&mut rand_core::OsRng);
    let pem = key
        .to_pkcs8_pem(LineEnding::LF)
        .map_err(|e| SignError::Key {
            path: priv_path.clone(),
            message: format!("cannot encode the private key: {e}"),
        })?;
    let public = public_pem(key.verifying_key(), &pub_path)?;
    // Public half first: a kill between the two leaves a harmless public key,
    // never a private key without its public half.
    write_new(&pub_path, public.as_bytes(), 0o644)?;
    if let Err(e) = write_new(&priv_path, pem.as_bytes(), 0o600) {
        let _ = fs::remove_file(&pub_path);
        return Err(e);
    }
    Ok((priv_path, pub_path))
}

/// Writes a new file crash-safely: the bytes go to a temporary file in the same
/// folder, which is then hard-linked to `path` (fails if `path` exists, so an
/// existing key is never overwritten) and removed. A kill at any point leaves
/// either no file or the complete one (plus, at worst, a stale temporary).
/// Errors name `path`, the file the user asked for, never the temporary.
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), SignError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
            .map_err(io_err(path, "create"))?;
        f.write_all(bytes).map_err(io_err(path, "write"))?;
        f.sync_all().map_err(io_err(path, "write"))?;
        fs::hard_link(&tmp, path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                SignError::Exists {
                    path: path.to_path_buf(),
                }
            } else {
                io_err(path, "create")(e)
            }
        })
    })();
    let _ = fs::remove_file(&tmp);
    result
}

fn public_pem(key: &VerifyingKey, path: &Path) -> Result<String, SignError> {
    key.to_public_key_pem(LineEnding::LF)
        .map_err(|e| SignError::Key {
            path: path.to_path_buf(),
            message: format!("cannot encode the public key: {e}"),
        })
}

const PRIVATE_EXPECTED: &str =
    "expected an unencrypted PKCS#8 PEM ECDSA P-256 private key, as `chunkforge keygen` writes";
const PUBLIC_EXPECTED: &str = "expected an ECDSA P-256 public key in SubjectPublicKeyInfo PEM (BEGIN PUBLIC KEY), as `chunkforge keygen` writes";

/// A key file's PEM text; an empty, blank or binary file is named as such.
fn read_key_text(path: &Path, action: &'static str) -> Result<String, SignError> {
    let bytes = fs::read(path).map_err(io_err(path, action))?;
    keykind::pem_text(&bytes)
        .map(str::to_string)
        .map_err(|m| key_err(path, m))
}

fn key_err(path: &Path, message: String) -> SignError {
    SignError::Key {
        path: path.into(),
        message,
    }
}

/// A key the decoder refused: named by what it is (algorithm, curve and OID,
/// read from the key) when it is another kind of key, else the decoder's reason.
fn unusable_key(path: &Path, text: &str, expected: &str, e: impl std::fmt::Display) -> SignError {
    key_err(
        path,
        match keykind::foreign(text) {
            Some(kind) => format!(
                "this is {kind}, not an ECDSA P-256 key (curve OID {}), the only kind chunkforge signs and verifies with (make one with `chunkforge keygen`)",
                keykind::P256
            ),
            None => format!("{expected} ({e})"),
        },
    )
}

/// Reads a P-256 private key: PKCS#8 PEM (`BEGIN PRIVATE KEY`, what `keygen`
/// and `openssl genpkey` write) or SEC1 PEM (`BEGIN EC PRIVATE KEY`).
pub fn load_private_key(path: &Path) -> Result<SigningKey, SignError> {
    let text = read_key_text(path, "read the private key")?;
    if text.contains("BEGIN ENCRYPTED PRIVATE KEY") {
        return Err(SignError::Key {
            path: path.into(),
            message: "the private key is encrypted; decrypt it first (openssl pkcs8 -in KEY -out PLAIN.pem)".into(),
        });
    }
    if text.contains("BEGIN EC PRIVATE KEY") {
        let secret = p256::SecretKey::from_sec1_pem(&text)
            .map_err(|e| unusable_key(path, &text, "expected a P-256 EC private key", e))?;
        return Ok(SigningKey::from(secret));
    }
    SigningKey::from_pkcs8_pem(&text).map_err(|e| unusable_key(path, &text, PRIVATE_EXPECTED, e))
}

/// Reads a P-256 public key in SubjectPublicKeyInfo PEM (`BEGIN PUBLIC KEY`).
pub fn load_public_key(path: &Path) -> Result<VerifyingKey, SignError> {
    let text = read_key_text(path, "read the public key")?;
    VerifyingKey::from_public_key_pem(&text)
        .map_err(|e| unusable_key(path, &text, PUBLIC_EXPECTED, e))
}

/// The key hint model_signing records and checks: hex SHA-256 of the public
/// key's PEM encoding with LF line endings.
pub fn key_hint(key: &VerifyingKey) -> String {
    let pem = key
        .to_public_key_pem(LineEnding::LF)
        .expect("P-256 public keys always encode");
    hex(&Sha256::digest(pem.as_bytes()))
}

/// DSSE pre-authentication encoding: `DSSEv1 <len(type)> <type> <len(body)> <body>`.
pub fn pae(payload: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "DSSEv1 {} {} {} ",
        PAYLOAD_TYPE.len(),
        PAYLOAD_TYPE,
        payload.len()
    )
    .into_bytes();
    out.extend_from_slice(payload);
    out
}

/// One signed file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    pub name: String,
    pub sha256: [u8; 32],
}

/// SHA-256 over the raw digests in list order: the statement's subject digest.
pub fn root_digest(resources: &[Resource]) -> [u8; 32] {
    let mut h = Sha256::new();
    for r in resources {
        h.update(r.sha256);
    }
    h.finalize().into()
}

/// Builds the in-toto statement for `files` (any order; sorted here by path
/// components). `extra` is added to the predicate beside `serialization` and
/// `resources` (model_signing verifiers ignore unknown predicate fields).
/// The hex digest of the resource list `statement` signs (its subject's).
pub fn root_hex(files: &[(String, FileDigest)]) -> String {
    hex(&root_digest(&sorted_resources(files)))
}

fn sorted_resources(files: &[(String, FileDigest)]) -> Vec<Resource> {
    let mut resources: Vec<Resource> = files
        .iter()
        .map(|(n, d)| Resource {
            name: n.clone(),
            sha256: d.sha256,
        })
        .collect();
    resources.sort_by(|a, b| hashing::cmp_components(&a.name, &b.name));
    resources
}

pub fn statement(
    model_name: &str,
    files: &[(String, FileDigest)],
    ignore_paths: &[&str],
    extra: Option<(&str, Value)>,
) -> Value {
    let resources = sorted_resources(files);
    let root = root_digest(&resources);
    let mut predicate = Map::new();
    predicate.insert(
        "serialization".into(),
        json!({
            "method": "files",
            "hash_type": "sha256",
            "allow_symlinks": false,
            "ignore_paths": ignore_paths,
        }),
    );
    predicate.insert(
        "resources".into(),
        Value::Array(
            resources
                .iter()
                .map(|r| json!({"name": r.name, "algorithm": "sha256", "digest": hex(&r.sha256)}))
                .collect(),
        ),
    );
    if let Some((k, v)) = extra {
        predicate.insert(k.into(), v);
    }
    json!({
        "_type": STATEMENT_TYPE,
        "subject": [{"name": model_name, "digest": {"sha256": hex(&root)}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    })
}

/// Signs `statement` and returns the bundle's JSON text (what goes into `model.sig`).
pub fn sign_bundle(key: &SigningKey, statement: &Value) -> String {
    let payload = serde_json::to_string_pretty(statement).expect("JSON values serialize");
    sign_payload(key, payload.as_bytes())
}

/// The bundle's JSON text for a DSSE payload given as bytes. Public so tests
/// can sign payloads no `Value` can express (duplicate keys).
pub fn sign_payload(key: &SigningKey, payload: &[u8]) -> String {
    let sig: Signature = key.sign(&pae(payload));
    let der: DerSignature = sig.to_der();
    let bundle = json!({
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {
            "publicKey": {"hint": key_hint(key.verifying_key())},
            "tlogEntries": [],
        },
        "dsseEnvelope": {
            "payload": B64.encode(payload),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": B64.encode(der.as_bytes()), "keyid": ""}],
        },
    });
    let mut text = serde_json::to_string_pretty(&bundle).expect("JSON values serialize");
    text.push('\n');
    text
}

/// A statement whose signature checked out, with its resource list validated.
#[derive(Debug)]
pub struct Verified {
    pub model_name: String,
    pub resources: Vec<Resource>,
    pub ignore_paths: Vec<String>,
    pub predicate: Map<String, Value>,
}

/// The fields each object of a key-signed bundle may hold: model_signing
/// 1.1.1 reads `model.sig` with sigstore_models (pydantic, `extra="forbid"`,
/// strict types), which rejects any other, and so does chunkforge, so the two
/// verifiers never disagree on one folder (`publicKey`'s `rawBytes` and
/// `keyDetails` are the ones model_signing drops unread before parsing).
/// Where the two still differ, chunkforge is the stricter: it reads only the
/// camelCase names model_signing writes (pydantic also takes `dsse_envelope`,
/// and a bundle holding both spellings would say two things), and refuses
/// transparency-log entries and RFC 3161 timestamps, which a key-signed
/// release never carries and chunkforge does not check.
const BUNDLE_FIELDS: &[(&str, &[&str])] = &[
    (
        "the bundle",
        &["mediaType", "verificationMaterial", "dsseEnvelope"],
    ),
    (
        "verificationMaterial",
        &[
            "publicKey",
            "x509CertificateChain",
            "certificate",
            "tlogEntries",
            "timestampVerificationData",
        ],
    ),
    (
        "verificationMaterial.publicKey",
        &["hint", "rawBytes", "keyDetails"],
    ),
    (
        "verificationMaterial.timestampVerificationData",
        &["rfc3161Timestamps"],
    ),
    ("dsseEnvelope", &["payload", "payloadType", "signatures"]),
    ("dsseEnvelope.signatures[]", &["sig", "keyid"]),
];

/// The object at `at` of a bundle, refused with any field [`BUNDLE_FIELDS`]
/// does not list there.
fn fields_of<'a>(v: &'a Value, at: &str) -> Result<&'a Map<String, Value>, String> {
    let obj = v
        .as_object()
        .ok_or_else(|| format!("{at} is {}, expected an object", json_kind(v)))?;
    only_fields(obj, at)
}

fn only_fields<'a>(
    obj: &'a Map<String, Value>,
    at: &str,
) -> Result<&'a Map<String, Value>, String> {
    let allowed = BUNDLE_FIELDS
        .iter()
        .find(|(a, _)| *a == at)
        .map_or(&[][..], |(_, f)| f);
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(format!(
            "{at} has an unexpected field '{k}' (model_signing rejects such a bundle as malformed; \
             {at} holds only {})",
            allowed.join(", ")
        )),
        None => Ok(obj),
    }
}

/// The bundle's structure as model_signing requires it of a key-signed
/// bundle (see [`BUNDLE_FIELDS`]); the values themselves are checked after.
fn check_bundle_shape(top: &Map<String, Value>) -> Result<(), String> {
    only_fields(top, "the bundle")?;
    let vm = top
        .get("verificationMaterial")
        .ok_or("no verificationMaterial (model_signing requires one, with the publicKey hint)")?;
    let vm = fields_of(vm, "verificationMaterial")?;
    let set = |k: &str| vm.get(k).is_some_and(|v| !v.is_null());
    match vm.get("publicKey").filter(|v| !v.is_null()) {
        None if set("certificate") || set("x509CertificateChain") => {
            return Err(
                "signed with a certificate, not a key: chunkforge verifies key-signed \
                        releases only (model_signing verify key refuses it too)"
                    .into(),
            )
        }
        None => {
            return Err(
                "verificationMaterial has no publicKey (model_signing requires exactly one \
                        of publicKey, x509CertificateChain and certificate)"
                    .into(),
            )
        }
        Some(_) if set("certificate") || set("x509CertificateChain") => {
            return Err(
                "verificationMaterial holds a publicKey and a certificate (model_signing \
                        requires exactly one)"
                    .into(),
            )
        }
        Some(pk) => {
            let pk = fields_of(pk, "verificationMaterial.publicKey")?;
            if let Some(h) = pk.get("hint").filter(|h| !h.is_null() && !h.is_string()) {
                return Err(format!(
                    "verificationMaterial.publicKey.hint is {}, expected a string",
                    json_kind(h)
                ));
            }
        }
    }
    match vm.get("tlogEntries") {
        None => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(Value::Array(_)) => {
            return Err(
                "verificationMaterial.tlogEntries is not empty: a key-signed release has no \
                        transparency-log entries, and chunkforge does not check them"
                    .into(),
            )
        }
        Some(v) => {
            return Err(format!(
                "verificationMaterial.tlogEntries is {}, expected a list",
                json_kind(v)
            ))
        }
    }
    if let Some(t) = vm.get("timestampVerificationData").filter(|t| !t.is_null()) {
        let t = fields_of(t, "verificationMaterial.timestampVerificationData")?;
        if t.get("rfc3161Timestamps")
            .is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err(
                "verificationMaterial.timestampVerificationData holds timestamps: a \
                        key-signed release has none, and chunkforge does not check them"
                    .into(),
            );
        }
    }
    let Some(env) = top.get("dsseEnvelope").filter(|v| !v.is_null()) else {
        return Err("no dsseEnvelope (only key-signed DSSE bundles are supported)".into());
    };
    let env = fields_of(env, "dsseEnvelope")?;
    for k in ["payload", "payloadType"] {
        match env.get(k) {
            Some(Value::String(_)) => {}
            Some(v) => {
                return Err(format!(
                    "dsseEnvelope.{k} is {}, expected a string",
                    json_kind(v)
                ))
            }
            None => return Err(format!("dsseEnvelope has no {k}")),
        }
    }
    let sigs = match env.get("signatures") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err("dsseEnvelope.signatures is empty".into()),
        Some(v) => {
            return Err(format!(
                "dsseEnvelope.signatures is {}, expected a list",
                json_kind(v)
            ))
        }
        None => return Err("dsseEnvelope has no signatures".into()),
    };
    for s in sigs {
        let s = fields_of(s, "dsseEnvelope.signatures[]")?;
        if !s.get("sig").is_some_and(Value::is_string) {
            return Err("dsseEnvelope.signatures[]: a signature without its sig string".into());
        }
        if let Some(k) = s.get("keyid").filter(|k| !k.is_null() && !k.is_string()) {
            return Err(format!(
                "dsseEnvelope.signatures[].keyid is {}, expected a string",
                json_kind(k)
            ));
        }
    }
    Ok(())
}

/// Reads `sig_path`, checks the bundle's structure, the key hint and the ECDSA
/// signature, then the statement (types, subject digest, resource list).
/// Resource names are returned as recorded; the caller judges them as paths.
pub fn verify_bundle(sig_path: &Path, key: &VerifyingKey) -> Result<Verified, SignError> {
    let fmt = |message: String| SignError::Format {
        path: sig_path.to_path_buf(),
        message,
    };
    let text = fs::read_to_string(sig_path).map_err(io_err(sig_path, "read"))?;
    let bundle: Value = strict_json::from_str(&text).map_err(|e| fmt(format!("not JSON ({e})")))?;
    let top = bundle
        .as_object()
        .ok_or_else(|| fmt("expected a JSON object".into()))?;
    check_bundle_shape(top).map_err(fmt)?;
    let media = top.get("mediaType").and_then(Value::as_str).unwrap_or("");
    if media != BUNDLE_MEDIA_TYPE {
        return Err(fmt(format!(
            "media type '{media}', expected '{BUNDLE_MEDIA_TYPE}'"
        )));
    }
    let env = top
        .get("dsseEnvelope")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            fmt("no dsseEnvelope (only key-signed DSSE bundles are supported)".into())
        })?;
    let ptype = env.get("payloadType").and_then(Value::as_str).unwrap_or("");
    if ptype != PAYLOAD_TYPE {
        return Err(fmt(format!(
            "payload type '{ptype}', expected '{PAYLOAD_TYPE}'"
        )));
    }
    let payload = env
        .get("payload")
        .and_then(Value::as_str)
        .and_then(|p| B64.decode(p).ok())
        .ok_or_else(|| fmt("dsseEnvelope.payload is missing or not base64".into()))?;
    let sig_b64 = env
        .get("signatures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(|s| s.get("sig"))
        .and_then(Value::as_str)
        .ok_or_else(|| fmt("dsseEnvelope.signatures[0].sig is missing".into()))?;
    let sig_der = B64
        .decode(sig_b64)
        .map_err(|e| fmt(format!("signature is not base64 ({e})")))?;

    let want_hint = key_hint(key);
    let hint = bundle
        .pointer("/verificationMaterial/publicKey/hint")
        .and_then(Value::as_str)
        .unwrap_or("");
    if !hint.is_empty() && hint != want_hint {
        return Err(SignError::BadSignature {
            path: sig_path.to_path_buf(),
            hint: format!(
                ": it was made with a different key (key hint {hint}; this public key's hint is {want_hint})"
            ),
        });
    }
    let sig = Signature::from_der(&sig_der).map_err(|e| {
        fmt(format!(
            "signature is not a DER ECDSA P-256 signature ({e})"
        ))
    })?;
    if key.verify(&pae(&payload), &sig).is_err() {
        return Err(SignError::BadSignature {
            path: sig_path.to_path_buf(),
            hint: String::new(),
        });
    }

    let st: Value = strict_json::from_slice(&payload)
        .map_err(|e| fmt(format!("signed payload is not JSON ({e})")))?;
    let get_str = |p: &str| st.pointer(p).and_then(Value::as_str).unwrap_or("");
    if get_str("/_type") != STATEMENT_TYPE {
        return Err(fmt(format!(
            "statement type '{}', expected '{STATEMENT_TYPE}'",
            get_str("/_type")
        )));
    }
    if get_str("/predicateType") != PREDICATE_TYPE {
        return Err(fmt(format!(
            "predicate type '{}', expected '{PREDICATE_TYPE}'",
            get_str("/predicateType")
        )));
    }
    let subjects = st
        .get("subject")
        .and_then(Value::as_array)
        .ok_or_else(|| fmt("statement has no subject".into()))?;
    if subjects.len() != 1 {
        return Err(fmt(format!(
            "expected exactly one subject, found {}",
            subjects.len()
        )));
    }
    let model_name = subjects[0]
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let subject_digest = subjects[0]
        .pointer("/digest/sha256")
        .and_then(Value::as_str)
        .unwrap_or("");
    let predicate = st
        .get("predicate")
        .and_then(Value::as_object)
        .cloned()
        .ok_or_else(|| fmt("statement has no predicate".into()))?;
    let ser = predicate
        .get("serialization")
        .and_then(Value::as_object)
        .ok_or_else(|| fmt("predicate has no serialization".into()))?;
    let method = ser.get("method").and_then(Value::as_str).unwrap_or("");
    let hash_type = ser.get("hash_type").and_then(Value::as_str).unwrap_or("");
    if method != "files" || hash_type != "sha256" {
        return Err(fmt(format!(
            "serialization method '{method}' with hash '{hash_type}' is not supported (only files/sha256)"
        )));
    }
    // Every entry counts: the verifier judges the list, so nothing is dropped here.
    let ignore_paths = match ser.get("ignore_paths") {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|i| i.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| {
                fmt(format!(
                    "serialization.ignore_paths is {v}, expected a list of paths"
                ))
            })?,
    };
    let mut resources = Vec::new();
    for (i, r) in predicate
        .get("resources")
        .and_then(Value::as_array)
        .ok_or_else(|| fmt("predicate has no resources list".into()))?
        .iter()
        .enumerate()
    {
        let name = r.get("name").and_then(Value::as_str);
        let alg = r.get("algorithm").and_then(Value::as_str);
        let dig = r
            .get("digest")
            .and_then(Value::as_str)
            .and_then(hashing::parse_hex32);
        match (name, alg, dig) {
            (Some(n), Some("sha256"), Some(d)) => resources.push(Resource {
                name: n.to_string(),
                sha256: d,
            }),
            _ => {
                return Err(fmt(format!(
                    "resource #{i} ({}) needs a name, algorithm sha256 and a 64-hex digest",
                    name.unwrap_or("?")
                )))
            }
        }
    }
    let root = hex(&root_digest(&resources));
    if root != subject_digest {
        return Err(fmt(format!(
            "subject digest {subject_digest} does not match the signed resource list (which hashes to {root})"
        )));
    }
    Ok(Verified {
        model_name,
        resources,
        ignore_paths,
        predicate,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SigningKey {
        SigningKey::from_bytes(&[7u8; 32].into()).unwrap()
    }

    fn files() -> Vec<(String, FileDigest)> {
        ["b", "a.b", "a/b"]
            .iter()
            .map(|n| {
                (
                    n.to_string(),
                    FileDigest {
                        size: 1,
                        sha256: Sha256::digest(n.as_bytes()).into(),
                    },
                )
            })
            .collect()
    }

    fn write_sig(text: &str, tag: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("cf-sig-{}-{tag}.sig", std::process::id()));
        fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn sign_then_verify_and_determinism() {
        let st = statement("m", &files(), &[SIG_FILE], None);
        let a = sign_bundle(&key(), &st);
        assert_eq!(
            a,
            sign_bundle(&key(), &st),
            "RFC 6979: same input, same bytes"
        );
        let p = write_sig(&a, "ok");
        let v = verify_bundle(&p, key().verifying_key()).unwrap();
        let names: Vec<_> = v.resources.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["a/b", "a.b", "b"]);
        let other = SigningKey::from_bytes(&[9u8; 32].into()).unwrap();
        let e = verify_bundle(&p, other.verifying_key()).unwrap_err();
        assert!(e.to_string().contains("different key"), "{e}");
        fs::remove_file(p).unwrap();
    }

    #[test]
    fn tampered_payload_fails() {
        let st = statement("m", &files(), &[SIG_FILE], None);
        let text = sign_bundle(&key(), &st);
        let mut b: Value = serde_json::from_str(&text).unwrap();
        let mut st2 = st.clone();
        st2["subject"][0]["name"] = json!("n");
        b["dsseEnvelope"]["payload"] =
            json!(B64.encode(serde_json::to_string_pretty(&st2).unwrap()));
        let p = write_sig(&b.to_string(), "tamper");
        let e = verify_bundle(&p, key().verifying_key()).unwrap_err();
        assert!(matches!(e, SignError::BadSignature { .. }), "{e}");
        fs::remove_file(p).unwrap();
    }
}
