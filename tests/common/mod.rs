//! Test harness: starts real `quotamesh` processes on loopback ports with their own data
//! directories, waits until they are ready, and stops them when dropped.

#![allow(dead_code)] // Each test binary uses a different part of the harness.

pub mod billing;
pub mod billing_checker;

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

/// How long a node may take to become ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// A running `quotamesh serve` process.
pub struct NodeProcess {
    child: Option<Child>,
    pub rls_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub data_dir: PathBuf,
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
        let rls_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse()?;
        let metrics_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse()?;
        // The billing and Raft ports too, unless the caller names them: nodes of parallel
        // tests must not meet on the defaults.
        let mut ports = Vec::new();
        for flag in ["--billing-addr", "--raft-addr"] {
            if !extra.contains(&flag) {
                ports.push(flag.to_owned());
                ports.push(format!("127.0.0.1:{}", free_port()));
            }
        }
        let child = Command::new(env!("CARGO_BIN_EXE_quotamesh"))
            .arg("serve")
            .arg("--rls-addr")
            .arg(rls_addr.to_string())
            .arg("--metrics-addr")
            .arg(metrics_addr.to_string())
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--policy")
            .arg(policy)
            .args(&ports)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .spawn()
            .context("spawn quotamesh")?;
        let mut node = Self {
            child: Some(child),
            rls_addr,
            metrics_addr,
            data_dir: data_dir.to_owned(),
            _scratch: None,
        };
        node.wait_ready()?;
        Ok(node)
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!("quotamesh exited before becoming ready: {status}");
                }
            }
            if let Ok((200, _)) = http_get(self.metrics_addr, "/readyz") {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("quotamesh was not ready within {READY_TIMEOUT:?}")
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
