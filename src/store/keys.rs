//! Storage keys: `<prefix>:{<escaped key>}:<limit name>:<part>`, the part
//! an algorithm's (`gcra`, `log`, ...) or `pen`, the state of the limit's
//! [penalty](crate::Limit::with_penalty).
//!
//! Everything between the braces is the Redis Cluster hash tag: the user key
//! alone, so every limit of one key (10 per second AND 1000 per day for one
//! client) lands in one slot and one script can decide them atomically. The
//! limit name after the tag keeps limits apart (names never contain `{`, `}`
//! or `:`). User key material is escaped
//! injectively (no two keys share an encoding, none contains `{` or `}`), and
//! keys longer than [`MAX_RAW_KEY`] bytes are replaced by `#` and their SHA-256
//! (`#` is always escaped in plain keys, so a digest cannot be impersonated).

#[cfg(feature = "redis")]
use percent_encoding::{percent_encode, AsciiSet, CONTROLS};
use sha2::{Digest, Sha256};
use smallvec::SmallVec;

use super::Check;

/// Longest user key stored as-is; longer ones are hashed.
pub(crate) const MAX_RAW_KEY: usize = 128;

/// How the in-memory store keeps a key longer than [`MAX_RAW_KEY`]: its
/// SHA-256 padded to one byte more than any key kept as-is, so memory per
/// key stays bounded whatever a client sends, and no key kept as-is can
/// equal a digest.
pub(crate) type LongKey = [u8; MAX_RAW_KEY + 1];

/// The bounded form of a key longer than [`MAX_RAW_KEY`].
pub(crate) fn long_key(key: &[u8]) -> LongKey {
    let mut out = [0; MAX_RAW_KEY + 1];
    out[..32].copy_from_slice(&Sha256::digest(key));
    out
}

/// Whether `check`'s key is stored as it is (not longer than
/// [`MAX_RAW_KEY`]).
#[inline(always)]
pub(crate) fn is_bounded(check: &Check<'_>) -> bool {
    check.key.len() <= MAX_RAW_KEY
}

/// Runs `f` on `checks` with every key longer than [`MAX_RAW_KEY`]
/// replaced by its bounded form (see [`LongKey`]).
#[inline(always)]
pub(crate) fn bounded_keys<R>(checks: &[Check<'_>], f: impl FnOnce(&[Check<'_>]) -> R) -> R {
    if checks.iter().all(is_bounded) {
        return f(checks);
    }
    with_long_keys(checks, f)
}

#[inline(never)]
fn with_long_keys<R>(checks: &[Check<'_>], f: impl FnOnce(&[Check<'_>]) -> R) -> R {
    let long: SmallVec<[LongKey; 2]> = checks.iter().map(|c| long_key(c.key)).collect();
    let bounded: SmallVec<[Check<'_>; 2]> = checks
        .iter()
        .zip(&long)
        .map(|(c, long)| Check {
            key: if c.key.len() > MAX_RAW_KEY {
                long
            } else {
                c.key
            },
            ..*c
        })
        .collect();
    f(&bounded)
}

/// Runs `f` on `check` with its key bounded (see [`bounded_keys`]).
pub(crate) fn bounded_one<R>(check: &Check<'_>, f: impl FnOnce(&Check<'_>) -> R) -> Option<R> {
    bounded_keys(std::slice::from_ref(check), |checks| checks.first().map(f))
}

#[cfg(feature = "redis")]
const ESCAPED: &AsciiSet = &CONTROLS.add(b' ').add(b'%').add(b'{').add(b'}').add(b'#');

/// The hash tag of every key stored for the user key `key`: `{escaped key}`
/// (what a cluster hashes to find the keys' slot).
#[cfg(any(feature = "cluster", all(test, feature = "redis")))]
pub(crate) fn tag(key: &[u8]) -> String {
    let mut out = Vec::with_capacity(key.len().min(MAX_RAW_KEY) + 2);
    write_tag(&mut out, key);
    // escaped: ASCII only
    String::from_utf8(out).unwrap_or_default()
}

/// Appends [`tag`]`(key)` to `out`.
#[cfg(feature = "redis")]
pub(crate) fn write_tag(out: &mut Vec<u8>, key: &[u8]) {
    out.push(b'{');
    if key.len() > MAX_RAW_KEY {
        out.push(b'#');
        const HEX: &[u8; 16] = b"0123456789abcdef";
        for byte in Sha256::digest(key) {
            out.push(HEX[usize::from(byte >> 4)]);
            out.push(HEX[usize::from(byte & 15)]);
        }
    } else {
        for piece in percent_encode(key, ESCAPED) {
            out.extend_from_slice(piece.as_bytes());
        }
    }
    out.push(b'}');
}

#[cfg(all(test, feature = "redis"))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn escapes_braces_and_hashes_long_keys() {
        assert_eq!(tag(b"+1 555"), "{+1%20555}");
        assert_eq!(tag(b"x}:{y"), "{x%7D:%7By}");
        assert_eq!(tag(b"#abc"), "{%23abc}");
        assert_eq!(tag("é".as_bytes()), "{%C3%A9}");
        let long = tag(&[b'k'; 10_000]);
        assert_eq!(long.len(), "{#}".len() + 64);
        assert_ne!(long, tag(&[b'k'; 10_001]));
    }

    proptest! {
        #[test]
        fn tags_are_injective_and_keep_one_hash_tag(a in proptest::collection::vec(any::<u8>(), 0..200),
                                                    b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let (ta, tb) = (tag(&a), tag(&b));
            prop_assert_eq!(a == b, ta == tb);
            prop_assert_eq!(ta.matches('{').count(), 1);
            prop_assert_eq!(ta.matches('}').count(), 1);
            prop_assert!(ta.ends_with('}'), "tag {}", ta);
            prop_assert!(ta.len() <= 3 * MAX_RAW_KEY + 2);
        }
    }
}

#[cfg(test)]
mod long_keys {
    #[test]
    fn keys_longer_than_the_bound_are_kept_as_digests() {
        let limit =
            crate::Limit::new("l", crate::Quota::per_second(1).fixed_window()).expect("limit");
        let (long, longer) = (vec![b'k'; 10_000], vec![b'k'; 10_001]);
        let checks = [
            super::Check {
                limit: &limit,
                key: b"short",
                cost: 1,
            },
            super::Check {
                limit: &limit,
                key: &long,
                cost: 1,
            },
            super::Check {
                limit: &limit,
                key: &longer,
                cost: 1,
            },
        ];
        super::bounded_keys(&checks, |bounded| {
            assert_eq!(bounded[0].key, b"short");
            assert_eq!(bounded[1].key.len(), super::MAX_RAW_KEY + 1);
            assert_ne!(bounded[1].key, bounded[2].key);
            assert_eq!(bounded[1].key, super::long_key(&long));
        });
    }
}
