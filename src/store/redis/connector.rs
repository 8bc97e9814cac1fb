//! Where the Redis store's connections come from (a deadpool-redis pool,
//! Sentinel, a cluster), and one connection of any kind.

use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

use crate::Error;

/// How long one connection attempt (connect, handshake, `PING`) may take.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Where new connections come from.
pub(super) enum Connector {
    /// One server (`redis://`, `rediss://`), through a deadpool-redis pool.
    Pool(deadpool_redis::Pool),
    /// The master that Sentinel names, asked again for every new connection,
    /// so that a failover is followed.
    #[cfg(feature = "sentinel")]
    Sentinel {
        client: tokio::sync::Mutex<redis::sentinel::SentinelClient>,
        config: redis::AsyncConnectionConfig,
    },
    /// A Redis Cluster: each connection routes by slot, follows `MOVED` and
    /// `ASK`, and reconnects to nodes by itself.
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster::ClusterClient),
}

impl Connector {
    /// A new connection that answered `PING`.
    pub(super) async fn connect(
        &self,
    ) -> Result<(Conn, Option<deadpool_redis::Connection>), Error> {
        let (mut conn, pooled) = match self {
            Connector::Pool(pool) => {
                let pooled = pool.get().await.map_err(|e| match e {
                    deadpool_redis::PoolError::Backend(e) => Error::Redis(e),
                    other => Error::Pool(other.to_string()),
                })?;
                (Conn::Single((*pooled).clone()), Some(pooled))
            }
            #[cfg(feature = "sentinel")]
            Connector::Sentinel { client, config } => {
                let conn = client
                    .lock()
                    .await
                    .get_async_connection_with_config(config)
                    .await?;
                (Conn::Single(conn), None)
            }
            #[cfg(feature = "cluster")]
            Connector::Cluster(client) => {
                (Conn::Cluster(client.get_async_connection().await?), None)
            }
        };
        redis::cmd("PING").query_async::<()>(&mut conn).await?;
        Ok((conn, pooled))
    }

    /// Whether the connections route by slot.
    pub(super) fn is_cluster(&self) -> bool {
        #[cfg(feature = "cluster")]
        if matches!(self, Connector::Cluster(_)) {
            return true;
        }
        false
    }

    /// The maximum number of connections the source can give, if bounded.
    pub(super) fn capacity(&self) -> Option<usize> {
        match self {
            Connector::Pool(pool) => Some(pool.status().max_size),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

/// One connection of any kind; cheap to clone (every kind multiplexes).
#[derive(Clone)]
pub(super) enum Conn {
    Single(MultiplexedConnection),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Conn {
    /// `cmd`'s reply as `T`. Over a single connection, redis-rs's own
    /// future is awaited in place, inside the caller's (already boxed)
    /// future, so that a command costs no allocation of its own (its
    /// `ConnectionLike` method boxes the future apart).
    pub(super) async fn query<T: redis::FromRedisValue>(&mut self, cmd: &Cmd) -> RedisResult<T> {
        match self {
            Conn::Single(conn) => {
                let value = conn.send_packed_command(cmd).await?;
                Ok(redis::from_redis_value(value.extract_error()?)?)
            }
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => cmd.query_async(self).await,
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(conn) => conn.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(conn) => conn.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(conn) => conn.get_db(),
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => conn.get_db(),
        }
    }
}
