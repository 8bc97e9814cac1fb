//! `ratelimit`: the server binary (see the package's README section).

fn main() {}
