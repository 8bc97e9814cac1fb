//! A Lua error in the decision library names the line of `lua/` it came
//! from: Redis reports a line of the assembled library (`user_function:N`),
//! and the crate's error (`tower_ratelimit::Error`, made from Redis' as
//! every store error is) names `lua/<file>.lua:<line>` instead. On a Redis
//! of the test's own, with the library loaded as `RedisStore` loads it.

mod common;

use common::TestRedis;
use tower_ratelimit::{Error, RedisStore};

/// The crate's error for a call of the library with `keys` and `args`,
/// which must fail.
fn library_error(server: &TestRedis, keys: &[&str], args: &[&str]) -> String {
    let client = redis::Client::open(server.url.as_str()).expect("client");
    let mut conn = client.get_connection().expect("connection");
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(RedisStore::library())
        .query(&mut conn)
        .expect("FUNCTION LOAD");
    let failed = redis::cmd("FCALL")
        .arg(RedisStore::function_name())
        .arg(keys.len())
        .arg(keys)
        .arg(args)
        .query::<redis::Value>(&mut conn)
        .expect_err("a malformed call fails");
    let text = failed.to_string();
    assert!(
        text.contains("user_function:"),
        "Redis reports a line of the library: {text}"
    );
    Error::from(failed).to_string()
}

/// The line `lua/<file>.lua:<line>` names in `error`, which must name one.
fn source_line(error: &str, file: &str) -> String {
    let at = format!("lua/{file}.lua:");
    let start = error
        .find(&at)
        .unwrap_or_else(|| panic!("`{error}` names no line of lua/{file}.lua"))
        + at.len();
    let digits: String = error[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let line: usize = digits.parse().expect("a line number");
    let path = format!("{}/lua/{file}.lua", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("read the source");
    text.lines()
        .nth(line - 1)
        .unwrap_or_else(|| panic!("{path} has no line {line}"))
        .to_owned()
}

/// A GCRA limit of no parameters ("3": its id alone) fails where the
/// algorithm reads its horizon from them, in `lua/gcra.lua`.
#[test]
fn an_algorithms_error_names_its_file_and_line() {
    let server = TestRedis::spawn();
    let error = library_error(&server, &["k"], &["3"]);
    assert!(
        error.contains("arithmetic") && !error.contains("user_function:"),
        "{error}"
    );
    let line = source_line(&error, "gcra");
    assert!(
        line.contains("gcra.horizon = function(s)"),
        "{error}: {line}"
    );
}

/// A call without arguments fails where the entry point reads the first,
/// in `lua/dispatch.lua`: a line of the library the build copied.
#[test]
fn the_entry_points_error_names_its_file_and_line() {
    let server = TestRedis::spawn();
    let error = library_error(&server, &[], &[]);
    assert!(error.contains("bad argument"), "{error}");
    let line = source_line(&error, "dispatch");
    assert!(line.contains("string.byte(args[1], 1)"), "{error}: {line}");
}
