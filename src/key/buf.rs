//! The bytes of one rate-limit key.

use smallvec::SmallVec;

/// The bytes of one rate-limit key, held inline up to 48 bytes: what
/// [`KeyExtractor::extract_into`](super::KeyExtractor::extract_into) writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyBuf(SmallVec<[u8; 48]>);

impl KeyBuf {
    /// An empty key.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `bytes`.
    #[inline]
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }

    /// Appends one byte.
    #[inline]
    pub fn push(&mut self, byte: u8) {
        self.0.push(byte);
    }

    /// The key's bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The key's length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the key is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Empties the key, keeping its storage.
    pub fn clear(&mut self) {
        self.0.clear();
    }
}

impl std::fmt::Write for KeyBuf {
    fn write_str(&mut self, text: &str) -> std::fmt::Result {
        self.extend_from_slice(text.as_bytes());
        Ok(())
    }
}

impl From<&[u8]> for KeyBuf {
    fn from(bytes: &[u8]) -> Self {
        Self(SmallVec::from_slice(bytes))
    }
}
