//! Where limit state lives: [`MemoryStore`] (in-process, the default) and
//! [`RedisStore`] (shared by every instance). Both run the same algorithms with
//! the same arithmetic and give the same decisions for the same inputs.

pub(crate) mod keys;
mod memory;
mod redis;

use std::future::Future;
use std::pin::Pin;

pub use self::memory::{MemoryStore, MemoryStoreBuilder, DEFAULT_MAX_KEYS, DEFAULT_SWEEP_INTERVAL};
pub use self::redis::{RedisStore, RedisStoreBuilder};

use crate::algorithm::Reply;
use crate::Error;

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

pub(crate) use self::sealed::Check;

/// A place to keep limit state. Implemented by [`MemoryStore`] and
/// [`RedisStore`]; sealed so that both can evolve together with the algorithms.
pub trait Store: sealed::Sealed + Send + Sync + 'static {}

pub(crate) mod sealed {
    use super::{BoxFuture, Error, Reply};
    use crate::{Limit, MemoryStore};

    /// One limit of an atomic decision: which limit, whose key, at what cost.
    #[derive(Debug)]
    #[allow(unreachable_pub)]
    pub struct Check<'a> {
        pub(crate) limit: &'a Limit,
        /// The user's key, as given (the Redis store escapes it into its
        /// hash tag, see `keys::tag`).
        pub(crate) key: &'a [u8],
        /// Cost; 0 looks without consuming.
        pub(crate) cost: i64,
    }

    /// The operations of a store, private to this crate.
    #[allow(unreachable_pub)]
    pub trait Sealed {
        /// Decides all checks atomically: grants all of them at one time no
        /// later than `max_wait` microseconds from now, or none. A `dry` run
        /// decides the same way but grants and writes nothing.
        fn decide<'a>(
            &'a self,
            checks: &'a [Check<'a>],
            max_wait: i64,
            dry: bool,
        ) -> BoxFuture<'a, Result<Reply, Error>>;
        /// Forgets the state of every check's key.
        fn reset<'a>(&'a self, checks: &'a [Check<'a>]) -> BoxFuture<'a, Result<(), Error>>;
        /// [`decide`](Self::decide) for a store that answers at once (no
        /// I/O, nothing to time out): the reply, without a future or a timer.
        /// `None` for a store that must be awaited.
        fn decide_sync(&self, checks: &[Check<'_>], max_wait: i64, dry: bool) -> Option<Reply> {
            let _ = (checks, max_wait, dry);
            None
        }
        /// [`reset`](Self::reset) for a store that answers at once; `false`
        /// (nothing done) for a store that must be awaited.
        fn reset_sync(&self, checks: &[Check<'_>]) -> bool {
            let _ = checks;
            false
        }
        /// The in-process store that decides in this one's place while it
        /// fails (the layer's `FallbackToMemory`): one per store, shared by
        /// its clones and every layer over it, so a limit shared by several
        /// layers stays one limit during an outage. `None` for a store that
        /// does not fail (memory).
        fn fallback(&self) -> Option<MemoryStore> {
            None
        }
    }
}
