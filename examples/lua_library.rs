//! Prints the Redis Function library that `RedisStore` loads, as
//! `FUNCTION LOAD` takes it: `cargo run --example lua_library | redis-cli -x
//! FUNCTION LOAD REPLACE`. `bench/lua.sh` measures what it prints.

fn main() {
    print!("{}", tower_ratelimit::RedisStore::library());
}
