//! Coalesced decisions on a Redis of the test's own (so that its command
//! counts are this test's): decisions that arrive while one is in flight go
//! out together, fewer calls than decisions, each decided on its own and
//! answered with its own reply; a lone decision goes out at once.

mod common;

use std::time::Duration;

use common::{command_calls, unique_prefix, TestRedis, PATIENT};
use tower_ratelimit::{Limit, Limiter, Quota, RedisStore, SetItem, SetMode};

fn limiter(server: &TestRedis, limit: Limit, coalesce: bool) -> Limiter {
    let store = RedisStore::builder(server.url.clone())
        .prefix(unique_prefix("coalesced"))
        .coalesce_decisions(coalesce)
        .build()
        .expect("store");
    Limiter::builder(store)
        .limit(limit)
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter")
}

fn fcalls(server: &TestRedis) -> u64 {
    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connect");
    command_calls(&mut conn, "fcall")
}

/// 1000 decisions at once on a quota of 300: exactly 300 granted, in fewer
/// calls than decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_go_out_together_and_stay_exact() {
    let server = TestRedis::spawn();
    let quota = Quota::per_hour(300).fixed_window();
    let limiter = limiter(&server, Limit::new("burst", quota).expect("limit"), true);
    limiter
        .peek("warm", 1)
        .await
        .expect("the library is loaded");
    let before = fcalls(&server);
    let tasks: Vec<_> = (0..1000)
        .map(|_| {
            let limiter = limiter.clone();
            tokio::spawn(async move { limiter.check("hot", 1).await })
        })
        .collect();
    let mut granted = 0;
    for task in tasks {
        granted += u32::from(task.await.expect("task").expect("decided").is_allowed());
    }
    assert_eq!(granted, 300, "exact");
    let calls = fcalls(&server) - before;
    assert!(
        calls < 1000,
        "{calls} calls for 1000 decisions: none coalesced"
    );
    println!("1000 concurrent decisions in {calls} calls");
}

/// Each caller gets its own reply: keys used 0 to 49 times each, looked at
/// all at once, each sees its own remaining.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_coalesced_decision_gets_its_own_reply() {
    let server = TestRedis::spawn();
    let quota = Quota::per_hour(100).fixed_window();
    let limiter = limiter(&server, Limit::new("own", quota).expect("limit"), true);
    let setup: Vec<_> = (0..50)
        .map(|i| {
            let limiter = limiter.clone();
            tokio::spawn(async move { limiter.check(format!("key-{i}"), i).await })
        })
        .collect();
    for task in setup {
        assert!(task.await.expect("task").expect("decided").is_allowed());
    }
    let before = fcalls(&server);
    let looks: Vec<_> = (0..50)
        .map(|i| {
            let limiter = limiter.clone();
            tokio::spawn(async move { (i, limiter.peek(format!("key-{i}"), 1).await) })
        })
        .collect();
    for look in looks {
        let (i, decision) = look.await.expect("task");
        assert_eq!(decision.expect("decided").remaining(), 100 - i, "key-{i}");
    }
    assert!(fcalls(&server) - before < 50, "the looks were coalesced");
}

/// Sets (`Limiter::decide_set`, as the Envoy service counts descriptors)
/// coalesce with each other and with decisions: many at once go out in
/// fewer calls, and each caller still reads its own counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sets_are_coalesced_and_each_gets_its_own_reply() {
    let server = TestRedis::spawn();
    let quota = Quota::per_hour(100).fixed_window();
    let limit = Limit::new("sets", quota).expect("limit");
    let limiter = limiter(&server, limit.clone(), true);
    limiter
        .peek("warm", 1)
        .await
        .expect("the library is loaded");
    let before = fcalls(&server);
    let tasks: Vec<_> = (0..200u64)
        .map(|i| {
            let (limiter, limit) = (limiter.clone(), limit.clone());
            tokio::spawn(async move {
                let key = format!("key-{}", i % 20).into_bytes();
                let set = [SetItem::new(&limit, &key, 1)];
                let mode = if i % 2 == 0 {
                    SetMode::EachCounted
                } else {
                    SetMode::EachSparing
                };
                let counted = limiter.decide_set(&set, mode).await;
                // and a decision of its own among them
                let checked = limiter.check(format!("other-{i}"), 1).await;
                (counted, checked)
            })
        })
        .collect();
    for task in tasks {
        let (counted, checked) = task.await.expect("task");
        assert!(counted.expect("decided").is_allowed());
        assert!(checked.expect("decided").is_allowed());
    }
    let calls = fcalls(&server) - before;
    assert!(
        calls < 200,
        "{calls} calls for 200 sets and 200 decisions (200 sets alone, uncoalesced, are 200 calls)"
    );
    // each key was counted 10 times, once per set
    for k in 0..20 {
        let key = format!("key-{k}");
        let peeked = limiter.peek(&key, 1).await.expect("peek");
        assert_eq!(peeked.remaining(), 90, "{key}");
    }
    println!("400 concurrent sets and decisions in {calls} calls");
}

/// A lone decision goes out at once, on its own: one call each.
#[tokio::test]
async fn a_lone_decision_is_its_own_call() {
    let server = TestRedis::spawn();
    let quota = Quota::per_hour(100).fixed_window();
    let limiter = limiter(&server, Limit::new("lone", quota).expect("limit"), true);
    limiter
        .peek("warm", 1)
        .await
        .expect("the library is loaded");
    let before = fcalls(&server);
    for _ in 0..20 {
        assert!(limiter.check("k", 1).await.expect("decided").is_allowed());
    }
    assert_eq!(fcalls(&server) - before, 20);
}

/// Without coalescing, each of many concurrent decisions is its own call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_coalescing_each_decision_is_its_own_call() {
    let server = TestRedis::spawn();
    let quota = Quota::per_hour(100).fixed_window();
    let limiter = limiter(&server, Limit::new("apart", quota).expect("limit"), false);
    limiter
        .peek("warm", 1)
        .await
        .expect("the library is loaded");
    let before = fcalls(&server);
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let limiter = limiter.clone();
            tokio::spawn(async move { limiter.check("hot", 1).await })
        })
        .collect();
    let mut granted = 0;
    for task in tasks {
        granted += u32::from(task.await.expect("task").expect("decided").is_allowed());
    }
    assert_eq!(granted, 100);
    assert_eq!(fcalls(&server) - before, 200);
}

/// The server stops with decisions waiting: each of them fails with an
/// error by its deadline, none hangs; once it is back, decisions resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_waiting_for_a_server_that_stopped_fail_by_their_deadline() {
    let mut server = TestRedis::spawn();
    let store = RedisStore::builder(server.url.clone())
        .prefix(unique_prefix("coalesced-down"))
        .build()
        .expect("store");
    let limiter = Limiter::builder(store)
        .limit(Limit::new("down", Quota::per_hour(1000).fixed_window()).expect("limit"))
        .timeout(Duration::from_millis(300))
        .cache_denials(false)
        .build()
        .expect("limiter");
    limiter
        .peek("warm", 1)
        .await
        .expect("the library is loaded");
    server.stop();
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let limiter = limiter.clone();
            tokio::spawn(async move { tokio::time::timeout(PATIENT, limiter.check("k", 1)).await })
        })
        .collect();
    for task in tasks {
        let answered = task.await.expect("task").expect("answered by its deadline");
        assert!(answered.is_err(), "the store is down");
    }
    server.restart();
    let until = tokio::time::Instant::now() + PATIENT;
    while limiter.check("k", 1).await.is_err() {
        assert!(tokio::time::Instant::now() < until, "never recovered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A batch may be the first call a freshly loaded library runs (a server
/// restarted, its functions flushed, while decisions queue): it decides
/// each of its decisions. Sent by hand in the library's wire format (op 7
/// of `lua/dispatch.lua`): three GCRA decisions of 5 per second on three
/// keys, as one run.
#[test]
fn a_batch_can_be_the_first_call_of_the_library() {
    let server = TestRedis::spawn();
    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connect");
    let library = RedisStore::library();
    let name = library
        .lines()
        .next()
        .and_then(|line| line.strip_prefix("#!lua name="))
        .expect("the library names its function")
        .to_owned();
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(library)
        .query(&mut conn)
        .expect("load");
    let reply: Vec<u8> = redis::cmd("FCALL")
        .arg(&name)
        .arg(3)
        .arg(&["first:{a}", "first:{b}", "first:{c}"][..])
        .arg("o:0:0:0:0:7")
        .arg("#1:1:3")
        .arg("3:5:1:1000000:1")
        .query(&mut conn)
        .expect("a batch as the first call");
    // each decision: its length (a double), then outcome, now, its
    // limit's kind, wait, remaining and reset (doubles)
    assert_eq!(reply.len(), 3 * (8 + 48), "three replies");
    for decision in reply.chunks(8 + 48) {
        let double = |i: usize| {
            let bytes: [u8; 8] = decision[8 * i..8 * i + 8].try_into().expect("8 bytes");
            f64::from_le_bytes(bytes)
        };
        assert_eq!(double(0), 48.0, "a reply of six doubles");
        assert_eq!(double(1), 0.0, "granted");
        assert_eq!(double(5), 4.0, "4 of 5 left");
    }
}

/// One decision of a batch that the library cannot make fails alone: its
/// reply is `!` and the error's text, nothing is written for it, and every
/// other decision of the call is decided as its own call would decide it.
/// Sent by hand in the library's wire format (op 7 of `lua/dispatch.lua`),
/// since no value a limiter sends or reads makes a decision fail (a limit's
/// string of an algorithm that does not exist stands for what was not
/// foreseen): GCRA decisions of 5 per second, one of them on a key that
/// holds a hash (another type reads as absent and is overwritten), and,
/// between them, a decision of an unknown algorithm and one of two limits
/// whose second is unknown. Before, the error failed the whole call.
#[test]
fn a_decision_the_library_cannot_make_fails_alone_and_writes_nothing() {
    let server = TestRedis::spawn();
    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connect");
    let library = RedisStore::library();
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(library)
        .query(&mut conn)
        .expect("load");
    let _: i64 = redis::cmd("HSET")
        .arg("t:{f}")
        .arg("level")
        .arg("garbage")
        .query(&mut conn)
        .expect("HSET");
    let gcra = "3:5:1:1000000:1";
    let unknown = "9:5:1:1000000:1";
    let keys = ["t:{a}", "t:{f}", "t:{c}", "t:{d}", "t:{d}2", "t:{e}"];
    let reply: Vec<u8> = redis::cmd("FCALL")
        .arg(RedisStore::function_name())
        .arg(keys.len())
        .arg(&keys[..])
        .arg("o:0:0:0:0:7")
        .arg("#1:1:2")
        .arg(gcra)
        .arg("#1:1:1")
        .arg(unknown)
        .arg("#2:3:1")
        .arg("o:0:0:0:0")
        .arg(gcra)
        .arg(unknown)
        .arg("#1:1:1")
        .arg(gcra)
        .query(&mut conn)
        .expect("the call succeeds");
    let mut replies = Vec::new();
    let mut rest = &reply[..];
    while !rest.is_empty() {
        let len = f64::from_le_bytes(rest[..8].try_into().expect("8 bytes")) as usize;
        replies.push(rest[8..8 + len].to_vec());
        rest = &rest[8 + len..];
    }
    assert_eq!(replies.len(), 5, "one reply per decision");
    for i in [0, 1, 4] {
        let r = &replies[i];
        assert_eq!(r.len(), 48, "decision {i}: a reply of six doubles");
        let double = |j: usize| f64::from_le_bytes(r[8 * j..8 * j + 8].try_into().expect("8"));
        assert_eq!(
            (double(0), double(4)),
            (0.0, 4.0),
            "decision {i}: granted, 4 left"
        );
    }
    for i in [2, 3] {
        assert_eq!(replies[i].first(), Some(&b'!'), "decision {i} failed alone");
    }
    for key in ["t:{c}", "t:{d}", "t:{d}2"] {
        let exists: i64 = redis::cmd("EXISTS")
            .arg(key)
            .query(&mut conn)
            .expect("EXISTS");
        assert_eq!(
            exists, 0,
            "nothing written for the failed decision of {key}"
        );
    }
    for key in ["t:{a}", "t:{f}", "t:{e}"] {
        let kind: String = redis::cmd("TYPE").arg(key).query(&mut conn).expect("TYPE");
        assert_eq!(kind, "string", "{key}: its state");
    }
}
