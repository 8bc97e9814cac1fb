//! `rls-load`: load for a rate limit service that speaks Envoy's protocol
//! (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`).
//!
//! One client, one HTTP/2 connection, a fixed duration. Two modes:
//! - closed loop (default): `--inflight N` requests always in flight, each
//!   sent as soon as the one before it on its slot is answered;
//! - open loop (`--rate R`): a request every 1/R seconds whatever the
//!   answers, at most `--inflight` outstanding at once. Its latency is
//!   counted from when the sender dispatched it, the wait for a free slot
//!   included (so a slow server cannot hide its queue); how late the sender
//!   itself dispatched against the schedule (tokio's timer ticks in
//!   milliseconds) is reported apart, as `late_p99_us` and `late_max_us`.
//!
//! Each request carries `--descriptors D` descriptors, the i-th with one entry
//! `d<i> = v<n mod values>`, so `--values` keys per descriptor are hit in turn.
//! It prints one line of `name=value` pairs: requests, answers by code,
//! errors, decisions per second, latency p50/p99/max in microseconds.
//!
//! The messages are written here with the field numbers of Envoy's
//! `rls.proto` and `ratelimit.proto`, only the fields this load needs.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};

/// `envoy.service.ratelimit.v3.RateLimitRequest` (the fields sent).
#[derive(Clone, PartialEq, prost::Message)]
struct RateLimitRequest {
    #[prost(string, tag = "1")]
    domain: String,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<RateLimitDescriptor>,
    #[prost(uint32, tag = "3")]
    hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor` (entries only).
#[derive(Clone, PartialEq, prost::Message)]
struct RateLimitDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<Entry>,
}

/// `RateLimitDescriptor.Entry`.
#[derive(Clone, PartialEq, prost::Message)]
struct Entry {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, tag = "2")]
    value: String,
}

/// `envoy.service.ratelimit.v3.RateLimitResponse` (the overall code only;
/// the rest is skipped by the decoder).
#[derive(Clone, PartialEq, prost::Message)]
struct RateLimitResponse {
    #[prost(int32, tag = "1")]
    overall_code: i32,
}

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

struct Args {
    addr: String,
    domain: String,
    descriptors: usize,
    inflight: usize,
    duration: Duration,
    rate: Option<f64>,
    values: u64,
}

fn usage() -> &'static str {
    "usage: rls-load --addr HOST:PORT [--domain bench] [--descriptors 1] [--inflight 50] \
     [--duration 10] [--rate R] [--values 100]"
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: String::new(),
        domain: "bench".into(),
        descriptors: 1,
        inflight: 50,
        duration: Duration::from_secs(10),
        rate: None,
        values: 100,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value; {}", usage()))?;
        let bad = |what: &str| format!("{flag}: {what}, got {value:?}");
        match flag.as_str() {
            "--addr" => args.addr = value,
            "--domain" => args.domain = value,
            "--descriptors" => {
                args.descriptors = value.parse().map_err(|_| bad("a count"))?;
            }
            "--inflight" => args.inflight = value.parse().map_err(|_| bad("a count"))?,
            "--duration" => {
                let secs: f64 = value.parse().map_err(|_| bad("seconds"))?;
                if !(secs > 0.0 && secs <= 600.0) {
                    return Err(bad("seconds in (0, 600]"));
                }
                args.duration = Duration::from_secs_f64(secs);
            }
            "--rate" => {
                let rate: f64 = value.parse().map_err(|_| bad("requests per second"))?;
                if !(rate > 0.0 && rate <= 1e6) {
                    return Err(bad("a rate in (0, 1e6]"));
                }
                args.rate = Some(rate);
            }
            "--values" => args.values = value.parse().map_err(|_| bad("a count"))?,
            _ => return Err(format!("unknown flag {flag}; {}", usage())),
        }
    }
    if args.addr.is_empty() {
        return Err(usage().into());
    }
    if args.descriptors == 0 || args.inflight == 0 || args.values == 0 {
        return Err("--descriptors, --inflight and --values must be at least 1".into());
    }
    Ok(args)
}

/// What one slot or the whole run saw.
#[derive(Default)]
struct Tally {
    latencies_us: Vec<u32>,
    ok: u64,
    over: u64,
    other: u64,
    errors: u64,
    first_error: Option<String>,
    /// Open loop: how late the sender dispatched (p99 and most), in µs.
    late_p99_us: u32,
    late_max_us: u32,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.latencies_us.extend(other.latencies_us);
        self.ok += other.ok;
        self.over += other.over;
        self.other += other.other;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

fn request(args: &Args, n: u64) -> RateLimitRequest {
    let value = format!("v{}", n % args.values);
    RateLimitRequest {
        domain: args.domain.clone(),
        descriptors: (0..args.descriptors)
            .map(|i| RateLimitDescriptor {
                entries: vec![Entry {
                    key: format!("d{i}"),
                    value: value.clone(),
                }],
            })
            .collect(),
        hits_addend: 1,
    }
}

/// One call; its outcome goes into `tally`, its latency counted from `due`
/// (when it was sent, or dispatched to wait for a slot).
async fn call(
    client: &mut tonic::client::Grpc<Channel>,
    message: RateLimitRequest,
    due: Instant,
    tally: &mut Tally,
) {
    let outcome = async {
        client
            .ready()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let codec = tonic_prost::ProstCodec::<RateLimitRequest, RateLimitResponse>::default();
        client
            .unary(
                tonic::Request::new(message),
                PathAndQuery::from_static(PATH),
                codec,
            )
            .await
    }
    .await;
    let micros = due.elapsed().as_micros().min(u32::MAX as u128) as u32;
    tally.latencies_us.push(micros);
    match outcome {
        Ok(response) => match response.into_inner().overall_code {
            1 => tally.ok += 1,
            2 => tally.over += 1,
            _ => tally.other += 1,
        },
        Err(status) => {
            tally.errors += 1;
            if tally.first_error.is_none() {
                tally.first_error = Some(format!("{:?}: {}", status.code(), status.message()));
            }
        }
    }
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

async fn run(args: Arc<Args>) -> Result<(Tally, Duration), String> {
    let endpoint = Endpoint::from_shared(format!("http://{}", args.addr))
        .map_err(|e| format!("--addr: {e}"))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    // One connection: every clone of the channel multiplexes over it.
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", args.addr))?;
    let client = tonic::client::Grpc::new(channel);
    let start = Instant::now();
    let end = start + args.duration;
    let mut tally = Tally::default();
    let mut late_us = Vec::new();
    match args.rate {
        None => {
            let mut slots = Vec::with_capacity(args.inflight);
            for slot in 0..args.inflight {
                let mut client = client.clone();
                let args = Arc::clone(&args);
                slots.push(tokio::spawn(async move {
                    let mut tally = Tally::default();
                    let mut n = slot as u64;
                    while Instant::now() < end {
                        let message = request(&args, n);
                        call(&mut client, message, Instant::now(), &mut tally).await;
                        n += args.inflight as u64;
                    }
                    tally
                }));
            }
            for slot in slots {
                tally.merge(slot.await.map_err(|e| format!("a slot failed: {e}"))?);
            }
        }
        Some(rate) => {
            let period = Duration::from_secs_f64(1.0 / rate);
            let permits = Arc::new(Semaphore::new(args.inflight));
            let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel();
            let mut n: u64 = 0;
            loop {
                let due = start + period.mul_f64(n as f64);
                if due >= end {
                    break;
                }
                tokio::time::sleep_until(due.into()).await;
                let dispatched = Instant::now();
                late_us.push(
                    dispatched
                        .duration_since(due)
                        .as_micros()
                        .min(u32::MAX as u128) as u32,
                );
                let mut client = client.clone();
                let message = request(&args, n);
                let permits = Arc::clone(&permits);
                let sender = sender.clone();
                tokio::spawn(async move {
                    let mut one = Tally::default();
                    // The wait for a permit counts in the latency.
                    if let Ok(_permit) = permits.acquire().await {
                        call(&mut client, message, dispatched, &mut one).await;
                    }
                    let _ = sender.send(one);
                });
                n += 1;
            }
            drop(sender);
            while let Some(one) = receiver.recv().await {
                tally.merge(one);
            }
        }
    }
    late_us.sort_unstable();
    tally.late_p99_us = percentile(&late_us, 99.0);
    tally.late_max_us = late_us.last().copied().unwrap_or(0);
    Ok((tally, start.elapsed()))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => Arc::new(args),
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    // One thread: the client is meant to be pinned to one core.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (mut tally, elapsed) = match runtime.block_on(run(Arc::clone(&args))) {
        Ok(result) => result,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::FAILURE;
        }
    };
    tally.latencies_us.sort_unstable();
    let requests = tally.latencies_us.len() as u64;
    let secs = elapsed.as_secs_f64();
    println!(
        "requests={requests} ok={} over_limit={} other={} errors={} secs={secs:.3} \
         decisions_per_s={:.0} descriptors_per_s={:.0} p50_us={} p99_us={} max_us={} \
         late_p99_us={} late_max_us={}",
        tally.ok,
        tally.over,
        tally.other,
        tally.errors,
        (requests - tally.errors) as f64 / secs,
        (requests - tally.errors) as f64 * args.descriptors as f64 / secs,
        percentile(&tally.latencies_us, 50.0),
        percentile(&tally.latencies_us, 99.0),
        tally.latencies_us.last().copied().unwrap_or(0),
        tally.late_p99_us,
        tally.late_max_us,
    );
    if let Some(error) = tally.first_error {
        eprintln!("first error: {error}");
    }
    if tally.errors > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
