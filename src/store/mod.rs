//! Where limit state lives: [`MemoryStore`] (in-process, the default) and
//! [`RedisStore`] (shared by every instance). Both run the same algorithms with
//! the same arithmetic and give the same decisions for the same inputs.

pub(crate) mod keys;
mod memory;
mod redis;

use std::future::Future;
use std::pin::Pin;

pub use self::memory::MemoryStore;
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
        /// The hash-tagged key, see [`keys::tag`].
        pub(crate) tag: String,
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
        /// The in-process store that decides in this one's place while it
        /// fails (the layer's `FallbackToMemory`): one per store, shared by
        /// its clones and every layer over it, so a limit shared by several
        /// layers stays one limit during an outage. `None` for a store that
        /// does not fail (memory).
        /// The application clock the store decides on, if it has one.
        fn clock(&self) -> Option<std::sync::Arc<dyn crate::Clock>> {
            None
        }

        /// Whether the store is shared with other processes over a network,
        /// so that a local cache of its denials saves round trips.
        fn remote(&self) -> bool {
            false
        }

        fn fallback(&self) -> Option<MemoryStore> {
            None
        }
    }
}
