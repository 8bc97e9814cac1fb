//! [`registry!`]: of the one list of the algorithms (in `mod.rs`), the
//! enums the rest of the crate holds and the one `match` over them for each
//! step and name, each arm handing over to the algorithm's [`Algo`](super::Algo).
//! A state is only ever decided with the parameters of its own algorithm;
//! the arms for a mismatch (never taken) answer as a fresh state would.

macro_rules! registry {
    ($($alg:ident = $id:literal: $module:ident::$state:ident,)*) => {
        /// The integers a limit's algorithm decides with, derived once from
        /// its quota ([`Params::derive`]), typed per algorithm.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) enum Params {
            $($alg(<$module::$state as Algo>::Params),)*
        }

        /// The working state of one key under one algorithm, in the reading
        /// limit's units: made from what the store keeps by
        /// [`State::prepare`], written back by [`State::save_into`].
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub(crate) enum State {
            $($alg($module::$state),)*
        }

        /// What the in-process store keeps of one key of one limit: exactly
        /// the fields the scripts keep in Redis.
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub(crate) enum Stored {
            $($alg(<$module::$state as Algo>::Stored),)*
        }

        /// Every algorithm, in the order of their ids (1, 2, ...).
        #[cfg_attr(not(any(test, feature = "redis")), allow(dead_code))]
        pub(crate) const ALGORITHMS: &[Algorithm] = &[$(Algorithm::$alg),*];

        impl Algorithm {
            /// The id a limit's string starts with, which the scripts
            /// dispatch on: its place in [`ALGORITHMS`], from 1.
            pub(crate) fn id(self) -> u8 {
                match self { $(Algorithm::$alg => $id,)* }
            }

            /// The name of its table in the scripts (and of its files,
            /// `lua/` and `src/algorithm/`).
            #[cfg_attr(not(test), allow(dead_code))]
            pub(crate) fn lua_name(self) -> &'static str {
                match self { $(Algorithm::$alg => stringify!($module),)* }
            }

            /// The suffixes of the keys it stores under ([`Algo::KEYS`]).
            #[cfg_attr(not(any(test, feature = "redis")), allow(dead_code))]
            pub(crate) fn key_parts(self) -> &'static [&'static str] {
                match self { $(Algorithm::$alg => <$module::$state as Algo>::KEYS,)* }
            }

            /// The shape of its parameters ([`Shape::KIND`]).
            #[cfg_attr(not(test), allow(dead_code))]
            pub(crate) fn shape(self) -> &'static str {
                match self { $(Algorithm::$alg => <<$module::$state as Algo>::Params as Shape>::KIND,)* }
            }

            /// Its name in prose ([`Algo::NAME`]).
            pub(crate) fn name(self) -> &'static str {
                match self { $(Algorithm::$alg => <$module::$state as Algo>::NAME,)* }
            }

            /// What its amount is called ([`Algo::AMOUNT`]).
            pub(crate) fn amount_name(self) -> &'static str {
                match self { $(Algorithm::$alg => <$module::$state as Algo>::AMOUNT,)* }
            }

            /// What its rate is called: `Some` for a bucket ([`Algo::RATE`]).
            pub(crate) fn rate_name(self) -> Option<&'static str> {
                match self { $(Algorithm::$alg => <$module::$state as Algo>::RATE,)* }
            }

            /// Its parameters for `q`, whose window and amount are checked.
            pub(super) fn params(self, q: &Quota, window: u128) -> Result<Params, ConfigError> {
                match self {
                    $(Algorithm::$alg => <<$module::$state as Algo>::Params as Shape>::derive(q, window).map(Params::$alg),)*
                }
            }
        }

        impl Params {
            /// Whose parameters these are.
            pub(crate) fn algorithm(&self) -> Algorithm {
                match self { $(Params::$alg(_) => Algorithm::$alg,)* }
            }

            /// The most one decision can be granted ([`Shape::capacity`]).
            pub(crate) fn capacity(&self) -> i64 {
                match self { $(Params::$alg(p) => p.capacity(),)* }
            }

            /// The longest wait a limit asks by itself, its horizon: a key's
            /// clock is believed that far ahead of the store's, no further
            /// (see "Clock steps" in `lua/driver.lua`, and [`Shape::horizon`]).
            #[inline]
            pub(crate) fn horizon(&self) -> i64 {
                match self { $(Params::$alg(p) => p.horizon(),)* }
            }

            /// The time in which a spent capacity comes back in full, in
            /// microseconds ([`Shape::policy_window`]): the `w` of
            /// `RateLimit-Policy` (see [`Limit::policy_window`](crate::Limit::policy_window)).
            pub(crate) fn policy_window_us(&self) -> u64 {
                let us = match self { $(Params::$alg(p) => p.policy_window(),)* };
                u64::try_from(us).unwrap_or(0)
            }

            /// The parameters as a limit's string sends them to the scripts,
            /// after the algorithm's id ([`Shape::wire`]).
            pub(crate) fn wire(&self) -> [i64; 3] {
                match self { $(Params::$alg(p) => p.wire(),)* }
            }
        }

        impl State {
            /// The working state of `stored` (`None`, or a form of another
            /// algorithm: fresh), written at its writer's clock `written`,
            /// in this limit's units as of `now`, as the scripts' `load` and
            /// `prepare` do. A state dated after `now` is moved back to it
            /// whole (see "Clock steps" in `lua/driver.lua`); returns whether
            /// it was and still holds something, in which case the decision
            /// writes it back whatever it decides. A sliding log's grants are
            /// moved out of `stored`, which [`restore`](Self::restore) or
            /// [`save_into`](Self::save_into) gives back.
            #[inline(always)]
            pub(crate) fn prepare(
                stored: Option<&mut Stored>,
                p: &Params,
                written: i64,
                now: i64,
            ) -> (Self, bool) {
                match p {
                    $(Params::$alg(p) => {
                        let stored = match stored {
                            Some(Stored::$alg(stored)) => Some(stored),
                            _ => None,
                        };
                        let (s, moved) = <$module::$state as Algo>::prepare(p, stored, written, now);
                        (State::$alg(s), moved)
                    })*
                }
            }

            /// Gives a state that was prepared from `stored` and not saved
            /// back to it: unchanged but for the pruning of a sliding log,
            /// as in Redis.
            #[inline]
            pub(crate) fn restore(self, stored: &mut Stored) {
                match (self, stored) {
                    $((State::$alg(s), Stored::$alg(stored)) => Algo::restore(s, stored),)*
                    _ => {}
                }
            }

            /// [`save_new`](Self::save_new) into `stored`, reusing a sliding
            /// log's allocation; returns the expiry.
            #[inline(always)]
            pub(crate) fn save_into(self, p: &Params, now: i64, stored: &mut Stored) -> i64 {
                match (self, stored, p) {
                    $((State::$alg(s), Stored::$alg(stored), Params::$alg(p)) => {
                        Algo::save_into(s, p, now, stored)
                    })*
                    (state, stored, _) => {
                        let (saved, expires_at) = state.save_new(p, now);
                        *stored = saved;
                        expires_at
                    }
                }
            }

            /// Writes the working state into a new stored form, as of `now`
            /// (the key's new `written`), as the scripts' `save` functions
            /// do. Returns it and the time at which the state becomes equal
            /// to a fresh one: the key's expiry.
            #[inline(always)]
            pub(crate) fn save_new(self, p: &Params, now: i64) -> (Stored, i64) {
                let stored = match (self, p) {
                    $((State::$alg(s), Params::$alg(p)) => Stored::$alg(Algo::save(s, p, now)),)*
                    // (never) a fresh state
                    (_, p) => match p {
                        $(Params::$alg(p) => {
                            Stored::$alg(Algo::save(<$module::$state as Algo>::prepare(p, None, now, now).0, p, now))
                        })*
                    },
                };
                let expires_at = stored.expires_at();
                (stored, expires_at)
            }

            #[inline]
            pub(super) fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
                match (self, p) {
                    $((State::$alg(s), Params::$alg(p)) => Algo::earliest(s, p, now, cost),)*
                    _ => None,
                }
            }

            #[inline]
            pub(super) fn grant(&mut self, p: &Params, at: i64, cost: i64) {
                match (self, p) {
                    $((State::$alg(s), Params::$alg(p)) => Algo::grant(s, p, at, cost),)*
                    _ => {}
                }
            }

            /// Gives back a grant of `cost` made at `at`, the state
            /// prepared as of `now` ([`Algo::refund`]). Returns whether the
            /// state changed (and must be saved).
            pub(crate) fn refund(&mut self, p: &Params, now: i64, at: i64, cost: i64) -> bool {
                match (self, p) {
                    $((State::$alg(s), Params::$alg(p)) => Algo::refund(s, p, now, at, cost),)*
                    _ => false,
                }
            }

            /// Moves a grant of `cost` made at `at` to `to` ([`Algo::renew`]).
            pub(crate) fn renew(&mut self, at: i64, to: i64, cost: i64) -> bool {
                match self { $(State::$alg(s) => Algo::renew(s, at, to, cost),)* }
            }

            #[inline]
            pub(crate) fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
                match (self, p) {
                    $((State::$alg(s), Params::$alg(p)) => Algo::status(s, p, now, at),)*
                    _ => (0, 0),
                }
            }
        }

        impl Stored {
            /// When the state becomes equal to a fresh one: the expiry
            /// `save` returned.
            pub(crate) fn expires_at(&self) -> i64 {
                match self { $(Stored::$alg(stored) => stored.expires_at(),)* }
            }
        }
    };
}
