//! What a key file holds, for errors about keys chunkforge cannot use: the
//! algorithm (and curve) read from the key itself, with its OID, rather than
//! the OID chunkforge expected, which the PKCS#8 and SPKI decoders report.

use p256::pkcs8::der::asn1::ObjectIdentifier;
use p256::pkcs8::der::{pem, Decode};
use p256::pkcs8::{AlgorithmIdentifierRef, PrivateKeyInfo, SubjectPublicKeyInfoRef};

const EC_PUBLIC_KEY: &str = "1.2.840.10045.2.1";
/// The curve chunkforge signs with (model_signing's default).
pub const P256: &str = "1.2.840.10045.3.1.7";

/// The text of a key file, or why it cannot hold a PEM key.
pub fn pem_text(bytes: &[u8]) -> Result<&str, String> {
    if bytes.is_empty() {
        return Err("the key file is empty (0 bytes), no PEM key in it".into());
    }
    let text = std::str::from_utf8(bytes).map_err(|_| {
        "the file is not PEM text (a binary DER key? convert it with `openssl pkey -inform DER -in KEY -out KEY.pem`)".to_string()
    })?;
    if text.trim().is_empty() {
        return Err(format!(
            "the key file holds only whitespace ({} bytes), no PEM key",
            bytes.len()
        ));
    }
    Ok(text)
}

/// What the first PEM block of `text` is when it is not an ECDSA P-256 key,
/// e.g. "an Ed25519 key (algorithm OID 1.3.101.112)"; None when it is P-256
/// or cannot be decoded (the caller then reports the decoder's error).
pub fn foreign(text: &str) -> Option<String> {
    let start = text.find("-----BEGIN ")?;
    let (label, der) = pem::decode_vec(text[start..].trim_end().as_bytes()).ok()?;
    let kind = match label {
        "PUBLIC KEY" => algorithm(SubjectPublicKeyInfoRef::from_der(&der).ok()?.algorithm),
        "PRIVATE KEY" => algorithm(PrivateKeyInfo::from_der(&der).ok()?.algorithm),
        "EC PRIVATE KEY" => {
            let curve = sec1::EcPrivateKey::from_der(&der)
                .ok()?
                .parameters?
                .named_curve()?;
            ec_curve(curve)
        }
        "RSA PRIVATE KEY" | "RSA PUBLIC KEY" => "an RSA key (PKCS#1)".to_string(),
        "OPENSSH PRIVATE KEY" => "an OpenSSH-format private key".to_string(),
        "CERTIFICATE" => "an X.509 certificate, not a key".to_string(),
        other => format!("a PEM `{other}` block"),
    };
    (!kind.is_empty()).then_some(kind)
}

/// Empty for P-256 (the one chunkforge uses), else the algorithm's name and OID.
fn algorithm(alg: AlgorithmIdentifierRef<'_>) -> String {
    let oid = alg.oid.to_string();
    if oid == EC_PUBLIC_KEY {
        return match alg.parameters_oid() {
            Ok(curve) => ec_curve(curve),
            Err(_) => format!("an EC key without a named curve (algorithm OID {oid})"),
        };
    }
    let name = match oid.as_str() {
        "1.3.101.112" => "an Ed25519 key",
        "1.3.101.113" => "an Ed448 key",
        "1.3.101.110" => "an X25519 key",
        "1.3.101.111" => "an X448 key",
        "1.2.840.113549.1.1.1" => "an RSA key",
        "1.2.840.113549.1.1.10" => "an RSA-PSS key",
        "1.2.840.10040.4.1" => "a DSA key",
        _ => "a key of an unknown algorithm",
    };
    format!("{name} (algorithm OID {oid})")
}

fn ec_curve(curve: ObjectIdentifier) -> String {
    let oid = curve.to_string();
    let name = match oid.as_str() {
        P256 => return String::new(),
        "1.3.132.0.34" => "P-384",
        "1.3.132.0.35" => "P-521",
        "1.3.132.0.10" => "secp256k1",
        "1.2.840.10045.3.1.1" => "P-192",
        "1.3.132.0.33" => "P-224",
        "1.3.36.3.3.2.8.1.1.7" => "brainpoolP256r1",
        _ => "an unknown curve",
    };
    format!("an ECDSA key on {name} (curve OID {oid})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_whitespace_and_binary_files_say_so() {
        assert!(pem_text(b"").unwrap_err().contains("empty (0 bytes)"));
        assert!(pem_text(b" \n").unwrap_err().contains("only whitespace"));
        assert!(pem_text(&[0x30, 0x82, 0xff, 0xfe])
            .unwrap_err()
            .contains("not PEM text"));
    }

    #[test]
    fn a_p256_key_is_not_foreign() {
        let key = p256::ecdsa::SigningKey::from_slice(&[7u8; 32]).unwrap();
        use p256::pkcs8::{EncodePrivateKey, EncodePublicKey, LineEnding};
        let private = key.to_pkcs8_pem(LineEnding::LF).unwrap();
        let public = key
            .verifying_key()
            .to_public_key_pem(LineEnding::LF)
            .unwrap();
        assert_eq!(foreign(&private), None);
        assert_eq!(foreign(&public), None);
        assert_eq!(foreign("not pem"), None);
    }
}
