//! Local-first leasing against real processes: a region of three voters and two gateways
//! serving one policy, paced Envoy RLS load from the test with every answer recorded (when
//! it was sent, how long it took, what it said), and scrapes of the nodes' metrics.
//!
//! ```text
//!  test tasks ──ShouldRateLimit, paced──▶ node N (voter 1-3 or gateway 4-5) ──leases──▶ ledger
//!      └── Answer { node, stream, sent_at, latency, outcome, retry_after_s } per request
//! ```
//!
//! The cluster itself (processes, configs, kill and restart) is `super::cluster`'s.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use quotamesh::core::rate::{Algorithm, LimitSpec};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use super::cluster::{Cluster, ClusterOptions};
use super::{descriptor, http_get, request};

/// The domain of [`POLICY`].
pub const DOMAIN: &str = "lease-test";

/// The policy every node of a leasing region serves.
///
/// - `user`: fail-open token bucket, 1,000/s, burst 1,000 (the accuracy and fault tests);
/// - `payment`: the same limit, fail-closed;
/// - `tenant`: 100,000/s, so a steady 2,000/s is never rejected (coordination cost);
/// - `idle`: hit once, then left alone (what an idle key strands);
/// - `job`: 5 per minute, fixed window (a blocked key stays local);
/// - `scarce`: 2 per hour, a limit small against the region (a small key);
/// - `enterprise`: 50,000 per minute, the enterprise tier of the leasing issue;
/// - `warm`: 100,000/s with leases of 1 to 40 tokens: at 2,000/s a lease lasts 20 ms and
///   the plain 20 % refill watermark 4 ms, as the default 500 at 25,000/s (a warm hot key),
///   and its credit (`min_tokens`) is as small a share of the lease as the default's.
pub const POLICY: &str = "\
domain: lease-test
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1000}
  - key: payment
    failure_mode: closed
    rate_limit: {unit: second, requests_per_unit: 1000}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100000}
  - key: idle
    rate_limit: {unit: second, requests_per_unit: 1000}
  - key: job
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: fixed_window}
  - key: scarce
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: enterprise
    rate_limit: {unit: minute, requests_per_unit: 50000}
  - key: warm
    rate_limit: {unit: second, requests_per_unit: 100000}
    lease: {min_tokens: 1, max_tokens: 40}
";

/// The `user` and `payment` rules' rate, per second, and their bucket capacity.
pub const LIMIT_PER_SECOND: u64 = 1_000;
/// Token-bucket capacity of `user` and `payment` (the burst defaults to the rate).
pub const BURST_TOKENS: u64 = 1_000;

/// The limit of the `user` and `payment` rules.
pub fn user_limit() -> LimitSpec {
    LimitSpec::new(Algorithm::TokenBucket, LIMIT_PER_SECOND, 1_000, None).expect("a valid limit")
}
/// `leasing.nodes_in_region` on every node: three voters and two gateways.
pub const NODES_IN_REGION: u64 = 5;
/// The voters' raft node ids (127.0.0.1 to .3).
pub const VOTERS: [u64; 3] = [1, 2, 3];
/// The gateways' raft node ids (127.0.0.4 and .5).
pub const GATEWAYS: [u64; 2] = [4, 5];
/// Deadline of one RLS call from the load: far above any decision, so an error is an error.
pub const RLS_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Starts three voters and two gateways serving [`POLICY`], with `nodes_in_region = 5` and
/// the extra `[leasing]` lines `leasing` on every node.
pub async fn start_region(leasing: &str) -> anyhow::Result<Cluster> {
    let options = ClusterOptions {
        policy: Some(POLICY.to_owned()),
        config_extra: format!("[leasing]\nnodes_in_region = {NODES_IN_REGION}\n{leasing}"),
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(3, options).await?;
    for gateway in GATEWAYS {
        cluster.start_gateway(gateway)?;
    }
    Ok(cluster)
}

/// One paced stream of requests on one descriptor through one node.
#[derive(Debug, Clone)]
pub struct Stream {
    /// The node's raft id, recorded with each answer.
    pub node: u64,
    /// Its RLS address.
    pub address: SocketAddr,
    /// A name for the stream, recorded with each answer (e.g. "open", "closed").
    pub label: &'static str,
    /// The descriptor's one entry.
    pub entry: (&'static str, String),
    /// Requests per second over all of the stream's tasks.
    pub per_second: u32,
    /// Concurrent tasks sending them, each on its own tokio interval.
    pub tasks: u32,
}

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// `OK`.
    Admitted,
    /// `OVER_LIMIT`.
    OverLimit,
    /// Any other overall code, or a gRPC error (its code).
    Error(tonic::Code),
}

/// One recorded request.
#[derive(Debug, Clone)]
pub struct Answer {
    pub node: u64,
    pub label: &'static str,
    /// When it was sent, since the load's origin.
    pub sent_at: Duration,
    /// Until its answer (or error) came back.
    pub latency: Duration,
    pub outcome: Outcome,
    /// The `retry-after` header, in seconds, when the answer had one.
    pub retry_after_s: Option<u64>,
}

impl Answer {
    /// When the answer came back, since the load's origin.
    pub fn answered_at(&self) -> Duration {
        self.sent_at + self.latency
    }
}

/// A connected RLS client of `address` (one HTTP/2 connection, shared by clones).
pub async fn rls_client(address: SocketAddr) -> anyhow::Result<RateLimitServiceClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .with_context(|| format!("connect to RLS at {address}"))?;
    Ok(RateLimitServiceClient::new(channel))
}

/// [`send_one`], sent once more a second later when the answer is a refusal that asks to
/// come back within a second: a key with no credit (a small key) whose lease came after the
/// wait budget on a loaded machine is refused by its fallback that way, and a client that
/// honours Retry-After is then admitted. Returns the answer and whether it was retried.
pub async fn send_honouring_late_lease(
    client: &mut RateLimitServiceClient<Channel>,
    node: u64,
    label: &'static str,
    entry: (&str, &str),
    origin: Instant,
) -> (Answer, bool) {
    let answer = send_one(client, node, label, entry, origin).await;
    if answer.outcome == Outcome::OverLimit
        && answer.retry_after_s.is_some_and(|seconds: u64| seconds <= 1)
    {
        tokio::time::sleep(Duration::from_secs(1)).await;
        return (send_one(client, node, label, entry, origin).await, true);
    }
    (answer, false)
}

/// Sends one request on `entry` and records it.
pub async fn send_one(
    client: &mut RateLimitServiceClient<Channel>,
    node: u64,
    label: &'static str,
    entry: (&str, &str),
    origin: Instant,
) -> Answer {
    let mut message = tonic::Request::new(request(DOMAIN, vec![descriptor(&[entry])]));
    message.set_timeout(RLS_CALL_TIMEOUT);
    let sent = Instant::now();
    let result = client.should_rate_limit(message).await;
    let latency = sent.elapsed();
    let (outcome, retry_after_s) = match result {
        Ok(response) => {
            let response = response.into_inner();
            let outcome = match response.overall_code() {
                Code::Ok => Outcome::Admitted,
                Code::OverLimit => Outcome::OverLimit,
                Code::Unknown => Outcome::Error(tonic::Code::Unknown),
            };
            let retry_after_s = response
                .response_headers_to_add
                .iter()
                .find(|header| header.key == "retry-after")
                .and_then(|header| header.value.parse().ok());
            (outcome, retry_after_s)
        }
        Err(status) => (Outcome::Error(status.code()), None),
    };
    Answer { node, label, sent_at: sent.duration_since(origin), latency, outcome, retry_after_s }
}

/// Starts `stream`'s tasks; each sends on its own interval (offset so the stream is even)
/// until `stop` turns true, catching up on missed ticks so a slow answer does not lower the
/// offered rate. Await the handles with [`collect`].
pub async fn start_stream(
    stream: &Stream,
    origin: Instant,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<Vec<JoinHandle<Vec<Answer>>>> {
    let client = rls_client(stream.address).await?;
    let period = Duration::from_secs_f64(f64::from(stream.tasks) / f64::from(stream.per_second));
    let mut handles = Vec::new();
    for task in 0..stream.tasks {
        let mut client = client.clone();
        let mut stop = stop.clone();
        let stream = stream.clone();
        let offset = period.mul_f64(f64::from(task) / f64::from(stream.tasks));
        handles.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            let mut interval =
                tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            loop {
                tokio::select! {
                    _ = interval.tick() => {}
                    _ = stop.changed() => {}
                }
                if *stop.borrow() {
                    break;
                }
                let entry = (stream.entry.0, stream.entry.1.as_str());
                answers.push(send_one(&mut client, stream.node, stream.label, entry, origin).await);
            }
            answers
        }));
    }
    Ok(handles)
}

/// Every answer of the given tasks, in the order they were sent.
pub async fn collect(handles: Vec<JoinHandle<Vec<Answer>>>) -> anyhow::Result<Vec<Answer>> {
    let mut answers = Vec::new();
    for handle in handles {
        answers.extend(handle.await?);
    }
    answers.sort_by_key(|answer| answer.sent_at);
    Ok(answers)
}

/// The node's Prometheus text, read off the async workers (the HTTP client blocks).
pub async fn scrape(metrics_addr: SocketAddr) -> anyhow::Result<String> {
    let (status, body) =
        tokio::task::spawn_blocking(move || http_get(metrics_addr, "/metrics")).await??;
    anyhow::ensure!(status == 200, "/metrics at {metrics_addr} answered {status}");
    Ok(body)
}

/// The nearest-rank percentile `percent` of the answers' latencies (zero for none).
pub fn percentile<'a>(answers: impl Iterator<Item = &'a Answer>, percent: usize) -> Duration {
    let mut latencies: Vec<Duration> = answers.map(|answer| answer.latency).collect();
    if latencies.is_empty() {
        return Duration::ZERO;
    }
    latencies.sort_unstable();
    let rank = (latencies.len() * percent).div_ceil(100).max(1);
    latencies[rank - 1]
}

/// Milliseconds with a fraction, for printing durations.
pub fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// Prints one measured figure on a line of its own, which `benches/leasing_region.sh`
/// gathers into the leasing benchmark's table.
pub fn figure(case: &str, what: &str, value: impl std::fmt::Display) {
    eprintln!("figure | {case} | {what} | {value}");
}
