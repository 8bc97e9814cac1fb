//! Whether the server keeps what calendar quotas count: a month's count
//! must survive a restart (persistence) and memory pressure (no eviction).
//! Asked once per store, at its first decision once a limiter or layer
//! with a calendar limit was built over it (see
//! [`CalendarRate`](crate::CalendarRate#in-redis)).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::conn::Lanes;
use crate::store::Deadline;

/// How long the check may take: it runs on a task of its own, never in a
/// decision's time.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// What the server's configuration lacks for calendar quotas, as one
/// sentence each; empty when nothing.
fn lacks(config: &HashMap<String, String>) -> Vec<String> {
    let get = |name: &str| config.get(name).map(|v| v.trim().to_ascii_lowercase());
    let mut lacks = Vec::new();
    let policy = get("maxmemory-policy");
    let bounded = get("maxmemory").is_some_and(|m| m != "0");
    if let Some(policy) = policy.filter(|p| bounded && p != "noeviction") {
        lacks.push(format!(
            "it evicts keys under maxmemory (maxmemory-policy {policy}; every key of this crate \
             has a TTL, so volatile-* policies evict them too): set maxmemory-policy noeviction"
        ));
    }
    let aof = get("appendonly").is_some_and(|v| v == "yes");
    let rdb = get("save").is_some_and(|v| !v.is_empty() && v != "\"\"");
    if get("appendonly").is_some() && get("save").is_some() && !aof && !rdb {
        lacks.push(
            "it keeps nothing on disk (appendonly no, save \"\"): enable AOF (appendonly yes) \
             or RDB snapshots (save)"
                .to_owned(),
        );
    }
    lacks
}

/// Checks, on a task of its own, that the server behind `lanes` keeps
/// calendar quotas, and logs what it lacks (see the module docs) for the
/// store of prefix `prefix`.
pub(super) fn check(lanes: &Arc<Lanes>, prefix: &str) {
    let (lanes, prefix) = (lanes.clone(), prefix.to_owned());
    tokio::spawn(async move { log(&lanes, &prefix).await });
}

async fn log(lanes: &Arc<Lanes>, prefix: &str) {
    let deadline = Deadline::after(CHECK_TIMEOUT).start();
    let mut config = HashMap::new();
    // one parameter per call: several at once need Redis 7
    for name in ["maxmemory", "maxmemory-policy", "appendonly", "save"] {
        let get = redis::cmd("CONFIG").arg("GET").arg(name).clone();
        match lanes
            .command::<HashMap<String, String>>(&get, deadline)
            .await
        {
            Ok(values) => config.extend(values),
            Err(error) => {
                tracing::debug!(
                    target: "tower_ratelimit",
                    %error,
                    "could not read the Redis configuration (CONFIG disabled or renamed?): \
                     not checking that it keeps calendar quotas"
                );
                return;
            }
        }
    }
    let lacks = lacks(&config);
    if !lacks.is_empty() {
        tracing::warn!(
            target: "tower_ratelimit",
            prefix = %prefix,
            "a limit with a calendar quota (per day, week, month, year) is decided in a Redis \
             that may forget what it counted: {}. A forgotten count starts the period over \
             for its key (see CalendarRate's docs).",
            lacks.join("; and ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn what_a_server_lacks_for_calendar_quotas() {
        let durable = [
            ("maxmemory", "1000000"),
            ("maxmemory-policy", "noeviction"),
            ("appendonly", "no"),
            ("save", "3600 1 300 100 60 10000"),
        ];
        assert!(lacks(&config(&durable)).is_empty());
        let mut aof = durable;
        aof[2].1 = "yes";
        aof[3].1 = "";
        assert!(lacks(&config(&aof)).is_empty());
        let mut volatile = durable;
        volatile[1].1 = "volatile-lru";
        assert_eq!(lacks(&config(&volatile)).len(), 1);
        // without maxmemory nothing is evicted, whatever the policy
        let mut unbounded = volatile;
        unbounded[0].1 = "0";
        assert!(lacks(&config(&unbounded)).is_empty());
        let mut forgetful = volatile;
        forgetful[3].1 = "";
        assert_eq!(lacks(&config(&forgetful)).len(), 2);
        // what the server did not say is not held against it
        assert!(lacks(&config(&[])).is_empty());
    }
}
