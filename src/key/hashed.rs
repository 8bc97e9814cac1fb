//! [`Hashed`]: a key stored as a digest of itself, for keys that are secrets.

use http::request::Parts;
use sha2::{Digest, Sha256};

use super::{extract_via_buf, KeyBuf, KeyExtractor};

/// The bytes of the digest a [`Hashed`] key keeps: 128 bits of SHA-256,
/// written as 32 lowercase hex digits.
const DIGEST_BYTES: usize = 16;

/// Another extractor's key, replaced by a fixed-length digest of it before
/// it reaches the store: SHA-256, its first 16 bytes as 32 lowercase hex
/// digits.
///
/// Keys are written into the store's key names (Redis: `<prefix>:...:<key>`),
/// where `SCAN`, `MONITOR`, the slow log, a replica or a backup shows them
/// to whoever can read the store. An API key, a bearer token or a session
/// cookie must not stand there in plain text: key such a limit by an id of
/// the secret (an API key's id, the tenant it belongs to, looked up by an
/// auth layer and read with
/// [`RequestExtension`](super::RequestExtension)) or by its hash, which
/// this wrapper makes. Two secrets share a bucket only if their digests
/// meet (1 in 2^128 for a pair).
///
/// A digest hides a secret only when the secret cannot be guessed: an API
/// key of 128 random bits or more can not be found from its digest, but a
/// phone number or an e-mail address can (by hashing every candidate), so
/// hashing them hides them from a glance, not from an attacker who reads
/// the store.
///
/// The key written is the digest alone: a request without the inner key
/// (or with an empty one) has none. Without allocating when the inner key
/// has at most 48 bytes (see [`KeyBuf`]).
///
/// ```
/// use http::HeaderName;
/// use tower_ratelimit::key::{Hashed, Header, KeyExtractor};
///
/// let api_key = Header::new(HeaderName::from_static("x-api-key")).hashed();
/// // the same as Hashed::new(Header::new(..))
/// let request = http::Request::get("/").header("x-api-key", "sk-live-0123456789").body(()).unwrap();
/// let (parts, ()) = request.into_parts();
/// let key = api_key.extract(&parts).expect("a key");
/// assert_eq!(key.len(), 32);
/// assert!(!String::from_utf8_lossy(&key).contains("sk-live"));
/// assert_eq!(api_key.key_kind(), "Hashed(Header(x-api-key))");
/// ```
#[derive(Debug, Clone, Default)]
pub struct Hashed<K> {
    inner: K,
}

impl<K: KeyExtractor> Hashed<K> {
    /// `inner`'s keys, hashed.
    pub fn new(inner: K) -> Self {
        Self { inner }
    }

    /// The extractor whose keys are hashed.
    pub fn inner(&self) -> &K {
        &self.inner
    }
}

/// Appends the hex digest of `plain` to `key`.
fn write_digest(plain: &[u8], key: &mut KeyBuf) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(plain);
    for byte in digest.iter().take(DIGEST_BYTES) {
        key.push(HEX[usize::from(byte >> 4)]);
        key.push(HEX[usize::from(byte & 0x0f)]);
    }
}

impl<K: KeyExtractor> KeyExtractor for Hashed<K> {
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        extract_via_buf(self, parts)
    }

    fn extract_into(&self, parts: &Parts, key: &mut KeyBuf) -> bool {
        let mut plain = KeyBuf::new();
        if !self.inner.extract_into(parts, &mut plain) || plain.is_empty() {
            return false;
        }
        write_digest(plain.as_bytes(), key);
        true
    }

    /// `Hashed(<the inner kind>)`: another kind than the inner
    /// extractor's, since its keys are other texts.
    fn key_kind(&self) -> String {
        format!("Hashed({})", self.inner.key_kind())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_is_sha256s_first_16_bytes_in_hex() {
        let mut key = KeyBuf::new();
        write_digest(b"abc", &mut key);
        // SHA-256("abc") = ba7816bf 8f01cfea 414140de 5dae2223 b00361a3 ...
        assert_eq!(key.as_bytes(), b"ba7816bf8f01cfea414140de5dae2223");
    }

    #[test]
    fn no_key_or_an_empty_key_is_none() {
        let (parts, ()) = http::Request::new(()).into_parts();
        let none = Hashed::new(|_: &Parts| None::<String>);
        assert_eq!(none.extract(&parts), None);
        let empty = Hashed::new(|_: &Parts| Some(String::new()));
        assert_eq!(empty.extract(&parts), None);
        let some = Hashed::new(|_: &Parts| Some("abc".to_owned()));
        assert_eq!(
            some.extract(&parts),
            Some(b"ba7816bf8f01cfea414140de5dae2223".to_vec())
        );
    }
}
