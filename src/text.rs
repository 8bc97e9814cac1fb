//! [`StackText`]: short text written on the stack, then copied once where it
//! goes (a key, a header value). Pushing into a `SmallVec` checks its
//! inline-or-heap state on every write, and the formatting machinery costs
//! more than the text itself; both run on every request.

/// Up to `N` bytes of text on the stack. A write that would not fit is
/// refused and leaves the text as it was.
pub(crate) struct StackText<const N: usize> {
    bytes: [u8; N],
    len: usize,
}

impl<const N: usize> StackText<N> {
    pub(crate) fn new() -> Self {
        Self {
            bytes: [0; N],
            len: 0,
        }
    }

    /// Appends `byte`; `false` (nothing written) when full.
    #[inline]
    pub(crate) fn push(&mut self, byte: u8) -> bool {
        let Some(slot) = self.bytes.get_mut(self.len) else {
            return false;
        };
        *slot = byte;
        self.len += 1;
        true
    }

    /// Appends `text`; `false` (nothing written) when it does not fit.
    #[inline]
    pub(crate) fn put(&mut self, text: &[u8]) -> bool {
        let end = self.len + text.len();
        let Some(room) = self.bytes.get_mut(self.len..end) else {
            return false;
        };
        room.copy_from_slice(text);
        self.len = end;
        true
    }

    /// A decimal number below 256, digit by digit.
    #[inline]
    pub(crate) fn decimal(&mut self, n: u8) -> bool {
        (n < 100 || self.push(b'0' + n / 100))
            && (n < 10 || self.push(b'0' + n / 10 % 10))
            && self.push(b'0' + n % 10)
    }

    /// The text written so far.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::StackText;

    #[test]
    fn writes_that_do_not_fit_are_refused_whole() {
        let mut text = StackText::<4>::new();
        assert!(text.put(b"ab"));
        assert!(!text.put(b"cde"), "3 bytes into 2 left");
        assert_eq!(text.as_bytes(), b"ab");
        assert!(text.decimal(7) && text.push(b'!'));
        assert!(!text.push(b'x') && !text.decimal(0));
        assert_eq!(text.as_bytes(), b"ab7!");
    }

    #[test]
    fn decimals_are_written_without_leading_zeros() {
        for n in [0u8, 9, 10, 99, 100, 255] {
            let mut text = StackText::<3>::new();
            assert!(text.decimal(n));
            assert_eq!(text.as_bytes(), n.to_string().as_bytes());
        }
    }
}
