//! `quotamesh bench ledger`: committed `AcquireLeases` throughput and latency of a real
//! loopback region, with fsync on (the Raft log is always fsync'd), against a single-node
//! region measured in the same run; the region runs twice, with mTLS between its nodes (as
//! shipped) and in plaintext (`insecure_cluster`), to price the TLS.
//!
//! ```text
//!  bench ──spawns──▶ quotamesh serve × N (127.0.0.1..N, own config and data directory)
//!    │                  └─ cluster init (N > 1)
//!    └─ clients ──AcquireLeases(batch)──▶ leader's admin gRPC ──▶ Raft commit ──▶ reply
//!       per case: warm-up, then a timed window: batches and grants committed, latency of
//!       each call (client-observed: gRPC + commit + apply), and the bytes every node wrote
//!       to storage (/proc/<pid>/io write_bytes) and its data directory's growth.
//! ```
//!
//! Figures come from a shared, noisy machine: compare the ratios, not the absolutes.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use tonic::transport::Channel;

use crate::api::proto::quotamesh::admin::v1 as proto;
use crate::api::proto::quotamesh::admin::v1::admin_client::AdminClient;

/// The bench policy: one key-only rule whose day-long bucket never runs dry in a run.
const BENCH_POLICY: &str = "\
domain: bench
descriptors:
  - key: k
    rate_limit: {unit: day, requests_per_unit: 1000000000000}
";
/// Distinct descriptor values cycled through, as a lease broker revisits its active keys.
const KEY_SPACE: u64 = 100_000;
/// How long a node may take to answer its first status call.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Deadline of one benchmark call; a slower commit counts as an error.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The operator token of the benchmark's nodes (they live only for the run, on loopback).
const BENCH_ADMIN_TOKEN: &str = "bench-operator-token";

/// Flags of `quotamesh bench ledger`.
#[derive(Debug, Args)]
pub struct LedgerBenchArgs {
    /// Voters of the measured region (the baseline is always one node).
    #[arg(long, default_value_t = 3)]
    pub nodes: u64,
    /// Length of each measured window, in seconds.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Warm-up before each window, in seconds.
    #[arg(long, default_value_t = 1)]
    pub warmup_seconds: u64,
    /// Cases as BATCH:CLIENTS (lease requests per command : commands in flight).
    #[arg(long, value_delimiter = ',', default_value = "1:1,1:16,64:8,1024:4")]
    pub cases: Vec<String>,
    /// Where the nodes' configs, logs and data directories go [default: a fresh directory
    /// under the system's temporary directory, removed afterwards]. Must be a real disk for
    /// the fsync figures to mean anything.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

/// One case's figures.
#[derive(Debug, Clone, serde::Serialize)]
struct CaseResult {
    nodes: u64,
    /// mTLS between the nodes (a region of one has no links between nodes).
    tls: bool,
    batch: usize,
    clients: usize,
    seconds: f64,
    batches: u64,
    grants: u64,
    errors: u64,
    batches_per_second: f64,
    grants_per_second: f64,
    latency_p50_ms: f64,
    latency_p99_ms: f64,
    latency_max_ms: f64,
    write_bytes_per_grant: f64,
    data_dir_growth_bytes_per_grant: f64,
}

/// Runs the benchmark and prints its table (or JSON).
///
/// # Errors
/// When a node cannot be started or formed, or a case cannot run.
pub async fn run(arguments: LedgerBenchArgs) -> anyhow::Result<()> {
    let cases = arguments
        .cases
        .iter()
        .map(|case| {
            let (batch, clients) = case.split_once(':').context("a case is BATCH:CLIENTS")?;
            Ok((batch.parse::<usize>()?, clients.parse::<usize>()?))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    anyhow::ensure!(
        (1..=9).contains(&arguments.nodes),
        "--nodes must be between 1 and 9 (nodes use 127.0.0.1 to 127.0.0.9)"
    );
    let (work_dir, remove_after) = match &arguments.work_dir {
        Some(directory) => (directory.clone(), false),
        None => (
            std::env::temp_dir().join(format!("quotamesh-bench-ledger-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&work_dir)
        .with_context(|| format!("cannot create {}", work_dir.display()))?;
    let mut results = Vec::new();
    let mut topologies = vec![(1, false)];
    if arguments.nodes > 1 {
        topologies.push((arguments.nodes, false));
        topologies.push((arguments.nodes, true));
    }
    let outcome = async {
        for (nodes, tls) in topologies {
            let region_dir = work_dir.join(format!("region-{nodes}-{}", tls_name(tls)));
            let mut region = Region::start(&region_dir, nodes, tls).await?;
            let measured = async {
                for (batch, clients) in &cases {
                    let result = region.measure(*batch, *clients, &arguments).await?;
                    if !arguments.json {
                        eprintln!(
                            "{nodes} node(s) {}, batch {batch}, {clients} client(s): {:.0} grants/s, p99 {:.2} ms",
                            tls_name(tls),
                            result.grants_per_second,
                            result.latency_p99_ms
                        );
                    }
                    results.push(result);
                }
                anyhow::Ok(())
            }
            .await;
            region.stop();
            measured?;
        }
        anyhow::Ok(())
    }
    .await;
    if remove_after {
        let _ = std::fs::remove_dir_all(&work_dir);
    }
    outcome?;
    report(&results, arguments.json)
}

fn tls_name(tls: bool) -> &'static str {
    if tls { "mtls" } else { "plain" }
}

fn report(results: &[CaseResult], json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(results)?);
        return Ok(());
    }
    println!(
        "AcquireLeases through the leader's admin API, fsync'd Raft log; latency as the client sees it"
    );
    println!(
        "{:>5} {:>5} {:>6} {:>7} {:>10} {:>10} {:>8} {:>8} {:>8} {:>12} {:>12}",
        "nodes",
        "links",
        "batch",
        "clients",
        "batches/s",
        "grants/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "written B/g",
        "dir B/g"
    );
    for result in results {
        println!(
            "{:>5} {:>5} {:>6} {:>7} {:>10.0} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>12.1} {:>12.1}",
            result.nodes,
            tls_name(result.tls),
            result.batch,
            result.clients,
            result.batches_per_second,
            result.grants_per_second,
            result.latency_p50_ms,
            result.latency_p99_ms,
            result.latency_max_ms,
            result.write_bytes_per_grant,
            result.data_dir_growth_bytes_per_grant,
        );
    }
    let region_nodes = results.iter().map(|result| result.nodes).max().unwrap_or(1);
    print_ratios(
        &format!("{region_nodes} nodes (plaintext) / 1 node"),
        results,
        |result| result.nodes == region_nodes && region_nodes > 1 && !result.tls,
        |region, single| single.nodes == 1 && !single.tls && same_case(region, single),
    );
    print_ratios(
        &format!("{region_nodes} nodes with mTLS / plaintext"),
        results,
        |result| result.tls,
        |tls, plain| !plain.tls && plain.nodes == tls.nodes && same_case(tls, plain),
    );
    Ok(())
}

fn same_case(one: &CaseResult, other: &CaseResult) -> bool {
    one.batch == other.batch && one.clients == other.clients
}

/// Prints, for every result `measured` selects, its figures over those of the result
/// `baseline_of` pairs it with.
fn print_ratios(
    title: &str,
    results: &[CaseResult],
    measured: impl Fn(&CaseResult) -> bool,
    baseline_of: impl Fn(&CaseResult, &CaseResult) -> bool,
) {
    let pairs: Vec<(&CaseResult, &CaseResult)> = results
        .iter()
        .filter(|result| measured(result))
        .filter_map(|result| {
            Some((result, results.iter().find(|baseline| baseline_of(result, baseline))?))
        })
        .collect();
    if pairs.is_empty() {
        return;
    }
    println!("\nratios, {title} (same case, same run):");
    for (result, baseline) in pairs {
        println!(
            "  batch {:>4} x {:>2} clients: grants/s x{:.2}, p50 x{:.2}, p99 x{:.2}, bytes written per grant x{:.2}",
            result.batch,
            result.clients,
            ratio(result.grants_per_second, baseline.grants_per_second),
            ratio(result.latency_p50_ms, baseline.latency_p50_ms),
            ratio(result.latency_p99_ms, baseline.latency_p99_ms),
            ratio(result.write_bytes_per_grant, baseline.write_bytes_per_grant),
        );
    }
}

fn ratio(numerator: f64, denominator: f64) -> f64 {
    if denominator > 0.0 { numerator / denominator } else { f64::NAN }
}

/// One node process of the benchmark region.
struct BenchNode {
    admin_addr: SocketAddr,
    data_dir: PathBuf,
    child: Child,
}

/// A region of node processes.
struct Region {
    nodes: Vec<BenchNode>,
    leader_admin: SocketAddr,
    next_key: Arc<AtomicU64>,
    size: u64,
    tls: bool,
}

fn free_port(ip: &str) -> anyhow::Result<u16> {
    Ok(TcpListener::bind(format!("{ip}:0"))?.local_addr()?.port())
}

impl Region {
    async fn start(directory: &Path, size: u64, tls: bool) -> anyhow::Result<Self> {
        std::fs::create_dir_all(directory)?;
        let authority = if tls && size > 1 {
            Some(crate::tls::authority::Authority::generate("bench", crate::clock::now_ms(), 1)?)
        } else {
            None
        };
        let policy = directory.join("bench.yaml");
        std::fs::write(&policy, BENCH_POLICY)?;
        let mut addresses = Vec::new();
        for id in 1..=size {
            let ip = format!("127.0.0.{id}");
            let port = |_: &str| -> anyhow::Result<SocketAddr> {
                Ok(format!("{ip}:{}", free_port(&ip)?).parse()?)
            };
            addresses.push((id, port("rls")?, port("metrics")?, port("admin")?, port("raft")?));
        }
        let mut nodes = Vec::new();
        for (id, rls, metrics, admin, raft) in &addresses {
            let data_dir = directory.join(format!("node-{id}"));
            let mut config = format!(
                "node_id = \"bench-{id}\"\nraft_node_id = {id}\ncluster_id = \"bench\"\n\
                 data_dir = \"{}\"\npolicy = \"{}\"\nrls_addr = \"{rls}\"\n\
                 metrics_addr = \"{metrics}\"\nadmin_addr = \"{admin}\"\nraft_addr = \"{raft}\"\n\
                 billing_addr = \"{}:0\"\n",
                data_dir.display(),
                policy.display(),
                // The billing API is not measured here; keep it off the shared default port.
                admin.ip(),
            );
            if size > 1 && !tls {
                config.push_str("insecure_cluster = true\n");
            }
            // One node: no peers, so it forms its own group on first start.
            if size > 1 {
                for (peer, _, _, _, peer_raft) in &addresses {
                    config.push_str(&format!(
                        "[[peers]]\nid = {peer}\nraft_addr = \"{peer_raft}\"\n"
                    ));
                }
            }
            if let Some(authority) = &authority {
                config.push_str(&node_tls(directory, authority, *id, &raft.ip().to_string())?);
            }
            config.push_str(&format!(
                "[[admin.tokens]]\nname = \"bench\"\nsha256 = \"{}\"\n",
                crate::api::billing::auth::token_sha256_hex(BENCH_ADMIN_TOKEN)
            ));
            let config_path = directory.join(format!("node-{id}.toml"));
            std::fs::write(&config_path, config)?;
            let log = std::fs::File::create(directory.join(format!("node-{id}.log")))?;
            let child = Command::new(std::env::current_exe()?)
                .arg("serve")
                .arg("--config")
                .arg(&config_path)
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .context("cannot start a node")?;
            nodes.push(BenchNode { admin_addr: *admin, data_dir, child });
        }
        let mut region =
            Self { nodes, leader_admin: addresses[0].3, next_key: Arc::default(), size, tls };
        if let Err(error) = region.form().await {
            region.stop();
            return Err(error);
        }
        Ok(region)
    }

    /// Waits for every node, forms the group, and finds the leader.
    async fn form(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        for node in &self.nodes {
            while status(node.admin_addr).await.is_err() {
                if Instant::now() > deadline {
                    bail!("node at {} did not come up; see its log", node.admin_addr);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        if self.size > 1 {
            let mut client = client(self.nodes[0].admin_addr).await?;
            client.init(timed(proto::InitRequest {})).await?;
        }
        loop {
            let first = status(self.nodes[0].admin_addr).await?;
            if let Some(leader) = first.leader_id {
                let index = usize::try_from(leader.saturating_sub(1))?;
                let leader_status = status(self.nodes[index].admin_addr).await?;
                if leader_status.state == "Leader" {
                    self.leader_admin = self.nodes[index].admin_addr;
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("no leader elected");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn measure(
        &mut self,
        batch: usize,
        clients: usize,
        arguments: &LedgerBenchArgs,
    ) -> anyhow::Result<CaseResult> {
        let mut connections = Vec::new();
        for _ in 0..clients {
            connections.push(client(self.leader_admin).await?);
        }
        // Warm-up: the same load, not counted.
        let warmup = Duration::from_secs(arguments.warmup_seconds);
        drive(&connections, batch, warmup, &self.next_key).await;

        let written_before = self.written_bytes();
        let size_before = self.data_dir_bytes();
        let window = Duration::from_secs(arguments.seconds.max(1));
        let started = Instant::now();
        let load = drive(&connections, batch, window, &self.next_key).await;
        let elapsed = started.elapsed().as_secs_f64();
        let written = self.written_bytes().saturating_sub(written_before);
        let growth = self.data_dir_bytes().saturating_sub(size_before);

        let mut latencies = load.latencies;
        latencies.sort_unstable();
        let percentile = |fraction: f64| -> f64 {
            if latencies.is_empty() {
                return f64::NAN;
            }
            let index = ((latencies.len() as f64 * fraction).ceil() as usize)
                .saturating_sub(1)
                .min(latencies.len() - 1);
            latencies[index].as_secs_f64() * 1e3
        };
        let grants = load.grants.max(1) as f64;
        Ok(CaseResult {
            nodes: self.size,
            tls: self.tls,
            batch,
            clients,
            seconds: elapsed,
            batches: load.batches,
            grants: load.grants,
            errors: load.errors,
            batches_per_second: load.batches as f64 / elapsed,
            grants_per_second: load.grants as f64 / elapsed,
            latency_p50_ms: percentile(0.50),
            latency_p99_ms: percentile(0.99),
            latency_max_ms: latencies.last().map_or(f64::NAN, |max| max.as_secs_f64() * 1e3),
            write_bytes_per_grant: written as f64 / grants,
            data_dir_growth_bytes_per_grant: growth as f64 / grants,
        })
    }

    /// Bytes all node processes caused to be written to storage so far.
    fn written_bytes(&self) -> u64 {
        self.nodes
            .iter()
            .filter_map(|node| {
                let text = std::fs::read_to_string(format!("/proc/{}/io", node.child.id())).ok()?;
                text.lines()
                    .find_map(|line| line.strip_prefix("write_bytes: ")?.trim().parse::<u64>().ok())
            })
            .sum()
    }

    fn data_dir_bytes(&self) -> u64 {
        self.nodes.iter().map(|node| directory_bytes(&node.data_dir)).sum()
    }

    fn stop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.child.kill();
            let _ = node.child.wait();
        }
    }
}

/// Bytes of the files under `directory`.
fn directory_bytes(directory: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(directory) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|entry| match entry.file_type() {
            Ok(kind) if kind.is_dir() => directory_bytes(&entry.path()),
            Ok(_) => entry.metadata().map_or(0, |metadata| metadata.len()),
            Err(_) => 0,
        })
        .sum()
}

/// What the clients of one window did.
struct Load {
    batches: u64,
    grants: u64,
    errors: u64,
    latencies: Vec<Duration>,
}

/// Runs one client per connection, each with one call in flight, for `window`.
async fn drive(
    connections: &[AdminClient<Channel>],
    batch: usize,
    window: Duration,
    next_key: &Arc<AtomicU64>,
) -> Load {
    let deadline = Instant::now() + window;
    let workers: Vec<_> = connections
        .iter()
        .cloned()
        .map(|mut client| {
            let next_key = Arc::clone(next_key);
            tokio::spawn(async move {
                let mut load = Load { batches: 0, grants: 0, errors: 0, latencies: Vec::new() };
                while Instant::now() < deadline {
                    let first = next_key.fetch_add(batch as u64, Ordering::Relaxed);
                    let leases = (0..batch as u64)
                        .map(|offset| proto::LeaseWanted {
                            domain: "bench".to_owned(),
                            entries: vec![proto::DescriptorEntry {
                                key: "k".to_owned(),
                                value: ((first + offset) % KEY_SPACE).to_string(),
                            }],
                            tokens_wanted: 1,
                        })
                        .collect();
                    let request = proto::AcquireLeasesRequest { leases, lease_ttl_ms: 1_000 };
                    let sent = Instant::now();
                    match client.acquire_leases(timed(request)).await {
                        Ok(reply) => {
                            load.latencies.push(sent.elapsed());
                            load.batches += 1;
                            load.grants += reply
                                .get_ref()
                                .results
                                .iter()
                                .filter(|result| result.granted_tokens > 0)
                                .count() as u64;
                        }
                        Err(_) => load.errors += 1,
                    }
                }
                load
            })
        })
        .collect();
    let mut total = Load { batches: 0, grants: 0, errors: 0, latencies: Vec::new() };
    for worker in workers {
        if let Ok(load) = worker.await {
            total.batches += load.batches;
            total.grants += load.grants;
            total.errors += load.errors;
            total.latencies.extend(load.latencies);
        } else {
            total.errors += 1;
        }
    }
    total
}

/// Writes node `id`'s certificate, key and the CA bundle into `<directory>/certs`; returns
/// the node's `[tls]` section.
fn node_tls(
    directory: &Path,
    authority: &crate::tls::authority::Authority,
    id: u64,
    host: &str,
) -> anyhow::Result<String> {
    let certs = directory.join("certs");
    std::fs::create_dir_all(&certs)?;
    let issued = authority.issue_node(
        "bench",
        crate::core::ledger::NodeId(id),
        &[host.to_owned()],
        crate::clock::now_ms(),
        1,
    )?;
    let (cert, key, ca) = (
        certs.join(format!("node-{id}.pem")),
        certs.join(format!("node-{id}.key")),
        certs.join("ca.pem"),
    );
    std::fs::write(&cert, &issued.cert_pem)?;
    std::fs::write(&key, &issued.key_pem)?;
    std::fs::write(&ca, authority.cert_pem())?;
    Ok(format!(
        "[tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n",
        cert.display(),
        key.display(),
        ca.display()
    ))
}

fn timed<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(CALL_TIMEOUT);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {BENCH_ADMIN_TOKEN}").parse().expect("an ASCII constant"),
    );
    request
}

async fn client(address: SocketAddr) -> anyhow::Result<AdminClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(CALL_TIMEOUT)
        .tcp_nodelay(true)
        .connect()
        .await?;
    Ok(AdminClient::new(channel)
        .max_decoding_message_size(crate::api::admin::ADMIN_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(crate::api::admin::ADMIN_MESSAGE_BYTES_MAX))
}

async fn status(address: SocketAddr) -> anyhow::Result<proto::StatusReply> {
    let mut client = client(address).await?;
    Ok(client.status(timed(proto::StatusRequest {})).await?.into_inner())
}
