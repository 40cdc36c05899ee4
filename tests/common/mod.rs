//! Test harness: starts real `quotamesh` processes on loopback ports with their own data
//! directories, waits until they are ready, and stops them when dropped. [`cluster`] builds
//! regions of several such processes on 127.0.0.x addresses.
//!
//! A crate of its own (`quotamesh-test-support`, imported as `common`), compiled once for
//! every integration test rather than as a module of each.

pub mod billing;
pub mod billing_checker;
pub mod cluster;
pub mod leasing;
pub mod tls;

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use quotamesh::api::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

/// The `quotamesh` binary cargo built for the running integration test: cargo builds a
/// package's binaries for its integration tests, into the directory above the tests' own
/// `deps/` (this crate is compiled once for every test, so `CARGO_BIN_EXE_quotamesh`, which
/// cargo sets only when compiling a test itself, is not available here).
pub fn quotamesh_bin() -> PathBuf {
    let test = std::env::current_exe().expect("the running test's executable");
    let deps = test.parent().expect("a test executable lies in a directory");
    let profile = if deps.ends_with("deps") { deps.parent().unwrap_or(deps) } else { deps };
    profile.join(format!("quotamesh{}", std::env::consts::EXE_SUFFIX))
}

/// How long a node may take to become ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Ports the harness hands out: below Linux's ephemeral range (32768 and up), so an
/// outgoing connection of any process cannot take a port between the check here and the
/// node's own bind (which made "address already in use" flaky under load).
const HARNESS_PORTS: std::ops::Range<u32> = 10_000..32_000;

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    free_port_on("127.0.0.1").expect("a free port on 127.0.0.1")
}

/// A port that was free a moment ago on `ip`, never one handed out before by this process;
/// each test process starts at its own place in the range.
pub fn free_port_on(ip: &str) -> anyhow::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let span = HARNESS_PORTS.end - HARNESS_PORTS.start;
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7_919) % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let port = u16::try_from(HARNESS_PORTS.start + offset).expect("ports fit u16");
        if TcpListener::bind((ip, port)).is_ok() {
            return Ok(port);
        }
    }
    anyhow::bail!("no free port on {ip} in {HARNESS_PORTS:?}")
}

/// A running `quotamesh serve` process.
pub struct NodeProcess {
    child: Option<Child>,
    pub rls_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub data_dir: PathBuf,
    /// Where the process's stdout and stderr go, when not inherited.
    pub log_path: Option<PathBuf>,
    _scratch: Option<tempfile::TempDir>,
}

impl NodeProcess {
    /// Starts a node serving `policy` (a file or directory) with a fresh data directory.
    pub fn start(policy: &Path) -> anyhow::Result<Self> {
        let scratch = tempfile::tempdir()?;
        let data_dir = scratch.path().join("data");
        let mut node = Self::start_with(policy, &data_dir, &[])?;
        node._scratch = Some(scratch);
        Ok(node)
    }

    /// Starts a node with an explicit data directory and extra arguments.
    pub fn start_with(policy: &Path, data_dir: &Path, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_with_environment(policy, data_dir, extra, &[])
    }

    /// [`Self::start_with`] with more environment variables (e.g. libfaketime's).
    pub fn start_with_environment(
        policy: &Path,
        data_dir: &Path,
        extra: &[&str],
        environment: &[(&str, String)],
    ) -> anyhow::Result<Self> {
        let rls_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse()?;
        let metrics_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse()?;
        // The admin, billing and Raft listeners too, unless the caller names them, so nodes
        // of parallel tests never share a port.
        let mut arguments: Vec<OsString> =
            vec!["--data-dir".into(), data_dir.into(), "--policy".into(), policy.into()];
        for flag in ["--admin-addr", "--billing-addr", "--raft-addr"] {
            if !extra.contains(&flag) {
                arguments.push(flag.into());
                arguments.push(format!("127.0.0.1:{}", free_port()).into());
            }
        }
        // These nodes are single-node regions whose tests check exact counts and headers: a
        // patient ledger timeout keeps a slow fsync on a loaded machine from turning a lease
        // into a fallback admission (the leasing tests set their own).
        if !extra.contains(&"--ledger-timeout-ms") {
            arguments.extend(["--ledger-timeout-ms".into(), "1000".into()]);
        }
        arguments.extend(extra.iter().map(OsString::from));
        Self::spawn(rls_addr, metrics_addr, data_dir, &arguments, environment, None)
    }

    /// Starts `quotamesh serve` on the given RLS and metrics addresses with more arguments
    /// and environment variables, its output to `log_path` when given; waits until ready.
    pub fn spawn(
        rls_addr: SocketAddr,
        metrics_addr: SocketAddr,
        data_dir: &Path,
        arguments: &[OsString],
        environment: &[(&str, String)],
        log_path: Option<&Path>,
    ) -> anyhow::Result<Self> {
        Self::spawn_as(rls_addr, metrics_addr, data_dir, arguments, environment, log_path, None)
    }

    /// [`Self::spawn`] under the user id `uid` when given (the test runs as root), so
    /// firewall rules can tell the process's packets apart (`meta skuid`).
    pub fn spawn_as(
        rls_addr: SocketAddr,
        metrics_addr: SocketAddr,
        data_dir: &Path,
        arguments: &[OsString],
        environment: &[(&str, String)],
        log_path: Option<&Path>,
        uid: Option<u32>,
    ) -> anyhow::Result<Self> {
        let mut command = Command::new(quotamesh_bin());
        if let Some(uid) = uid {
            std::os::unix::process::CommandExt::uid(&mut command, uid);
        }
        command
            .arg("serve")
            .arg("--rls-addr")
            .arg(rls_addr.to_string())
            .arg("--metrics-addr")
            .arg(metrics_addr.to_string())
            .args(arguments)
            // The log a user gets (dependencies at WARN, quotamesh at INFO), not a test's own.
            .env_remove("RUST_LOG")
            .env("RUST_BACKTRACE", "0")
            .envs(environment.iter().map(|(name, value)| (*name, value.as_str())))
            .stdin(Stdio::null());
        if let Some(log_path) = log_path {
            let log = std::fs::OpenOptions::new().create(true).append(true).open(log_path)?;
            command.stdout(log.try_clone()?).stderr(log);
        }
        let child = command.spawn().context("spawn quotamesh")?;
        let mut node = Self {
            child: Some(child),
            rls_addr,
            metrics_addr,
            data_dir: data_dir.to_owned(),
            log_path: log_path.map(Path::to_owned),
            _scratch: None,
        };
        node.wait_ready()?;
        Ok(node)
    }

    /// The last `lines` lines of the process's log file, when it has one.
    pub fn log_tail(&self, lines: usize) -> String {
        let Some(path) = &self.log_path else {
            return String::new();
        };
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Waits until the node has started: `/healthz` answers once every part runs. Not
    /// `/readyz`, which also wants a leader for every group the node is a member of, and a
    /// node restarted into a region that is down gets one only when more nodes are back.
    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("quotamesh exited before becoming ready: {status}\n{}", self.log_tail(20));
            }
            if let Ok((200, _)) = http_get(self.metrics_addr, "/healthz") {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("quotamesh was not ready within {READY_TIMEOUT:?}")
    }

    /// `/readyz`: its status code and body.
    pub fn readiness(&self) -> anyhow::Result<(u16, String)> {
        http_get(self.metrics_addr, "/readyz")
    }

    /// Whether the process has exited (reaping it if so).
    pub fn exited(&mut self) -> anyhow::Result<Option<std::process::ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => Ok(child.try_wait()?),
            None => Ok(None),
        }
    }

    /// A gRPC client connected to the node's RLS port.
    pub async fn client(&self) -> anyhow::Result<RateLimitServiceClient<Channel>> {
        Ok(RateLimitServiceClient::connect(format!("http://{}", self.rls_addr)).await?)
    }

    /// The node's Prometheus text.
    pub fn metrics(&self) -> anyhow::Result<String> {
        let (status, body) = http_get(self.metrics_addr, "/metrics")?;
        anyhow::ensure!(status == 200, "/metrics answered {status}");
        Ok(body)
    }

    /// Sends a signal to the process.
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self.child.as_ref().context("process already stopped")?.id();
        let status =
            Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status()?;
        anyhow::ensure!(status.success(), "kill -{signal} failed");
        Ok(())
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL (kill -9): no shutdown, no flush; waits until the process is gone.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        let mut child = self.child.take().context("process already stopped")?;
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        self.signal("TERM")?;
        let mut child = self.child.take().context("process already stopped")?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("quotamesh did not exit within 20 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// An HTTP response as the tests need it.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    /// The first value of a header (name in lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_str())
    }
}

/// A minimal HTTP/1.1 GET with extra request headers.
pub fn http_request(
    address: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<HttpResponse> {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").context("no header end")?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .context("no status line")?
        .parse()?;
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    Ok(HttpResponse { status, headers, body: body.to_owned() })
}

/// A minimal HTTP/1.1 GET, enough for the metrics and health endpoints.
pub fn http_get(address: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let response = http_request(address, path, &[])?;
    Ok((response.status, response.body))
}

/// The value of a metric line (exact name and label set as Prometheus prints it), or 0.
pub fn metric_value(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Runs `nft` (as root, with nftables installed) with `input` on its standard input, for
/// at most 10 s.
pub fn nft(arguments: &[&str], input: Option<&str>) -> anyhow::Result<()> {
    let mut child = Command::new("timeout")
        .args(["10", "nft"])
        .args(arguments)
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("run nft")?;
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin.write_all(input.as_bytes())?;
    }
    let output = child.wait_with_output()?;
    anyhow::ensure!(
        output.status.success(),
        "nft {}: {}",
        arguments.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// Sum of every series of a metric family.
pub fn metric_sum(metrics: &str, family: &str) -> f64 {
    metrics
        .lines()
        .filter(|line| line.starts_with(family) && line[family.len()..].starts_with(['{', ' ']))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A descriptor from `(key, value)` pairs.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry { key: (*key).to_owned(), value: (*value).to_owned() })
            .collect(),
        limit: None,
        hits_addend: None,
    }
}

/// A request for `domain` with the given descriptors.
pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest { domain: domain.to_owned(), descriptors, hits_addend: 0 }
}

/// Writes `text` to `name` in `directory` and returns the path.
pub fn write_file(directory: &Path, name: &str, text: &str) -> PathBuf {
    let path = directory.join(name);
    std::fs::write(&path, text).expect("write test file");
    path
}

/// What one run of the `quotamesh` binary left.
pub struct CliRun {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `quotamesh arguments`, with `QUOTAMESH_ADMIN_TOKEN` set to `token` or unset; the
/// exit code is the caller's to judge.
pub fn run_cli(arguments: &[&str], token: Option<&str>) -> anyhow::Result<CliRun> {
    let mut command = Command::new(quotamesh_bin());
    command.args(arguments).env("RUST_BACKTRACE", "0").env_remove("QUOTAMESH_ADMIN_TOKEN");
    if let Some(token) = token {
        command.env("QUOTAMESH_ADMIN_TOKEN", token);
    }
    let output = command.output().context("run quotamesh")?;
    Ok(CliRun {
        code: output.status.code(),
        stdout: String::from_utf8(output.stdout)?,
        stderr: String::from_utf8(output.stderr)?,
    })
}

/// Two threads that spin until dropped: both cores busy, as on a shared CI machine.
pub struct CpuHog {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuHog {
    /// Starts `threads` spinning threads.
    pub fn start(threads: usize) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = std::sync::Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut spin = 0_u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        spin = std::hint::black_box(spin.wrapping_mul(6_364_136_223_846_793_005));
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// libfaketime's preload library where Debian installs it (any architecture).
pub fn libfaketime() -> anyhow::Result<PathBuf> {
    let library = Path::new("/usr/lib");
    let mut candidates = vec![library.join("faketime/libfaketime.so.1")];
    if let Ok(entries) = std::fs::read_dir(library) {
        for entry in entries.flatten() {
            candidates.push(entry.path().join("faketime/libfaketime.so.1"));
        }
    }
    candidates.into_iter().find(|path| path.exists()).context(
        "libfaketime not found: install Debian's `faketime` package (scripts/test.sh does)",
    )
}

/// A response header an RLS answer asks Envoy to add, by its (lower-case) name.
pub fn rls_header<'r>(
    response: &'r quotamesh::api::proto::envoy::service::ratelimit::v3::RateLimitResponse,
    name: &str,
) -> Option<&'r str> {
    response
        .response_headers_to_add
        .iter()
        .find(|header| header.key == name)
        .map(|header| header.value.as_str())
}
