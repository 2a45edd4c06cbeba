//! API key secrets: made from the kernel's random pool, shown once, kept
//! only as a SHA-256 hash.
//!
//! A secret is `wrn_<key id hex>_<64 hex digits>`: the id lets the server
//! find the key's record with one read, the rest is 256 random bits. A
//! plain hash is enough (no password hashing): the secret is not guessable
//! the way a password is.

use sha2::{Digest, Sha256};

use crate::error::IamError;

const SECRET_PREFIX: &str = "wrn_";
const KEY_ID_PREFIX: &str = "key-";

/// `n` random bytes as lowercase hex.
pub(crate) fn random_hex(n: usize) -> Result<String, IamError> {
    let mut bytes = vec![0u8; n];
    let mut filled = 0;
    while filled < n {
        filled += rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty())
            .map_err(|e| IamError::Internal(format!("cannot read random bytes: {e}")))?;
    }
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A new key: its id and its secret.
pub(crate) fn new_key() -> Result<(String, String), IamError> {
    let id_hex = random_hex(8)?;
    let secret = format!("{SECRET_PREFIX}{id_hex}_{}", random_hex(32)?);
    Ok((format!("{KEY_ID_PREFIX}{id_hex}"), secret))
}

/// The key id a secret names, if it has the shape of one.
pub(crate) fn key_id_of(secret: &str) -> Option<String> {
    let rest = secret.strip_prefix(SECRET_PREFIX)?;
    let (id_hex, random) = rest.split_once('_')?;
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hex(id_hex, 16) && hex(random, 64)).then(|| format!("{KEY_ID_PREFIX}{id_hex}"))
}

pub(crate) fn hash(secret: &str) -> String {
    Sha256::digest(secret.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Compares without an early exit, so the time taken does not tell how
/// many leading characters matched.
pub(crate) fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_names_its_key_and_hashes_stably() {
        let (id, secret) = new_key().unwrap();
        assert_eq!(key_id_of(&secret).as_deref(), Some(id.as_str()));
        assert_eq!(hash(&secret), hash(&secret));
        assert_eq!(hash(&secret).len(), 64);
        let (_, other) = new_key().unwrap();
        assert_ne!(secret, other);
        assert!(!same(&hash(&secret), &hash(&other)));
        assert!(same(&hash(&secret), &hash(&secret)));
    }

    #[test]
    fn malformed_secrets_name_no_key() {
        for bad in ["", "wrn_", "wrn_abc_def", "Bearer x", "wrn_0123456789abcdef_short", "key-0123456789abcdef"] {
            assert_eq!(key_id_of(bad), None, "{bad}");
        }
    }
}
