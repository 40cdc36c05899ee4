//! Basic Envoy RLS v3 behaviour of a real `quotamesh` process over a gRPC socket.

use common::{NodeProcess, descriptor, metric_value, request, rls_header as header, write_file};
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;

const POLICY: &str = r#"
domain: t10
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: api_key
    value: vip
    rate_limit: {unit: minute, requests_per_unit: 100, name: vip}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: multi
    rate_limits:
      - {unit: minute, requests_per_unit: 5, name: per-minute}
      - {unit: hour, requests_per_unit: 2, name: per-hour}
  - key: open
    rate_limit: {unlimited: true}
  - key: client
    value: banned
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: tenant
    descriptors:
      - key: path
        value: /pay
        rate_limit: {unit: minute, requests_per_unit: 2}
"#;

fn start() -> (NodeProcess, tempfile::TempDir) {
    let directory = tempfile::tempdir().expect("temp dir");
    let policy = write_file(directory.path(), "t10.yaml", POLICY);
    (NodeProcess::start(&policy).expect("node starts"), directory)
}

/// A node whose config file also turns on the legacy RateLimit-Limit/-Remaining/-Reset.
fn start_with_legacy_headers() -> (NodeProcess, tempfile::TempDir) {
    let directory = tempfile::tempdir().expect("temp dir");
    let policy = write_file(directory.path(), "t10.yaml", POLICY);
    let config = write_file(directory.path(), "node.toml", "[headers]\nlegacy = true\n");
    let config = config.to_str().expect("UTF-8 path");
    let data_dir = directory.path().join("data");
    let node =
        NodeProcess::start_with(&policy, &data_dir, &["--config", config]).expect("node starts");
    (node, directory)
}

/// A key-only rule counts each value separately: three hits pass, the fourth is over, with
/// the limit, remaining, reset and headers Envoy needs.
#[tokio::test]
async fn key_only_rule_admits_up_to_the_limit() -> anyhow::Result<()> {
    let (node, _dir) = start_with_legacy_headers();
    let mut client = node.client().await?;
    for expected_remaining in [2, 1, 0] {
        let response = client
            .should_rate_limit(request("t10", vec![descriptor(&[("api_key", "alice")])]))
            .await?
            .into_inner();
        assert_eq!(response.overall_code(), Code::Ok);
        let status = &response.statuses[0];
        assert_eq!(status.limit_remaining, expected_remaining);
        let limit = status.current_limit.as_ref().expect("current limit");
        assert_eq!((limit.requests_per_unit, limit.unit()), (3, Unit::Minute));
        assert_eq!(header(&response, "ratelimit-policy"), Some("\"api_key\";q=3;w=60"));
        assert_eq!(header(&response, "retry-after"), None);
        assert_eq!(header(&response, "ratelimit-limit"), Some("3"));
    }
    let over = client
        .should_rate_limit(request("t10", vec![descriptor(&[("api_key", "alice")])]))
        .await?
        .into_inner();
    assert_eq!(over.overall_code(), Code::OverLimit);
    assert_eq!(over.statuses[0].code(), Code::OverLimit);
    let reset = over.statuses[0].duration_until_reset.expect("reset");
    assert!(reset.seconds > 0 && reset.seconds <= 60, "{reset:?}");
    let retry_after: u64 = header(&over, "retry-after").expect("retry-after").parse()?;
    assert!((1..=20).contains(&retry_after), "one token per 20 s: {retry_after}");
    assert!(header(&over, "ratelimit").expect("ratelimit").contains("r=0"));
    assert_eq!(header(&over, "ratelimit-remaining"), Some("0"));

    // Another value of the same key has its own counter; the exact value has its own rule.
    let bob = client
        .should_rate_limit(request("t10", vec![descriptor(&[("api_key", "bob")])]))
        .await?
        .into_inner();
    assert_eq!(bob.overall_code(), Code::Ok);
    let vip = client
        .should_rate_limit(request("t10", vec![descriptor(&[("api_key", "vip")])]))
        .await?
        .into_inner();
    assert_eq!(vip.statuses[0].limit_remaining, 99);
    assert_eq!(vip.statuses[0].current_limit.as_ref().expect("limit").name, "vip");
    Ok(())
}

/// hits_addend counts several hits at once; the request's 0 means 1, a descriptor's own
/// value wins, and a descriptor's own 0 checks without consuming.
#[tokio::test]
async fn hits_addend_is_honoured() -> anyhow::Result<()> {
    let (node, _dir) = start();
    let mut client = node.client().await?;
    let mut three = request("t10", vec![descriptor(&[("api_key", "carol")])]);
    three.hits_addend = 3;
    let response = client.should_rate_limit(three.clone()).await?.into_inner();
    assert_eq!((response.overall_code(), response.statuses[0].limit_remaining), (Code::Ok, 0));
    let over = client.should_rate_limit(three).await?.into_inner();
    assert_eq!(over.overall_code(), Code::OverLimit);
    // By default (as in envoyproxy/ratelimit) the legacy single-limit headers are off.
    assert!(header(&over, "ratelimit").is_some() && header(&over, "retry-after").is_some());
    assert_eq!(header(&over, "ratelimit-remaining"), None);

    let mut own = descriptor(&[("api_key", "dave")]);
    own.hits_addend = Some(2);
    let mut request_level = request("t10", vec![own]);
    request_level.hits_addend = 100;
    let response = client.should_rate_limit(request_level).await?.into_inner();
    assert_eq!((response.overall_code(), response.statuses[0].limit_remaining), (Code::Ok, 1));

    // The request's 0 means 1; a descriptor's own 0 (a UInt64Value) checks without
    // consuming, and is OVER_LIMIT once nothing is left.
    let mut zero_request = request("t10", vec![descriptor(&[("api_key", "erin")])]);
    zero_request.hits_addend = 0;
    let response = client.should_rate_limit(zero_request).await?.into_inner();
    assert_eq!(response.statuses[0].limit_remaining, 2, "the request's 0 means 1");
    let check = || {
        let mut zero = descriptor(&[("api_key", "erin")]);
        zero.hits_addend = Some(0);
        request("t10", vec![zero])
    };
    for _ in 0..3 {
        let response = client.should_rate_limit(check()).await?.into_inner();
        assert_eq!((response.overall_code(), response.statuses[0].limit_remaining), (Code::Ok, 2));
    }
    let mut two = descriptor(&[("api_key", "erin")]);
    two.hits_addend = Some(2);
    let spent = client.should_rate_limit(request("t10", vec![two])).await?.into_inner();
    assert_eq!((spent.overall_code(), spent.statuses[0].limit_remaining), (Code::Ok, 0));
    let exhausted = client.should_rate_limit(check()).await?.into_inner();
    assert_eq!(exhausted.overall_code(), Code::OverLimit, "nothing left to check against");
    Ok(())
}

/// A shadow-mode rule never answers OVER_LIMIT, but counts what it would have blocked.
#[tokio::test]
async fn shadow_mode_never_blocks() -> anyhow::Result<()> {
    let (node, _dir) = start();
    let mut client = node.client().await?;
    for _ in 0..5 {
        let response = client
            .should_rate_limit(request("t10", vec![descriptor(&[("shadow", "x")])]))
            .await?
            .into_inner();
        assert_eq!(response.overall_code(), Code::Ok);
        assert_eq!(header(&response, "retry-after"), None);
    }
    let metrics = node.metrics()?;
    assert_eq!(
        metric_value(&metrics, "quotamesh_rls_shadow_blocks_total{domain=\"t10\",rule=\"shadow\"}"),
        4.0,
        "{metrics}"
    );
    Ok(())
}

/// With several limits on one descriptor a hit must pass all of them; the status shows the
/// one that rejected.
#[tokio::test]
async fn several_limits_all_apply() -> anyhow::Result<()> {
    let (node, _dir) = start();
    let mut client = node.client().await?;
    for _ in 0..2 {
        let response = client
            .should_rate_limit(request("t10", vec![descriptor(&[("multi", "m")])]))
            .await?
            .into_inner();
        assert_eq!(response.overall_code(), Code::Ok);
        let policy = header(&response, "ratelimit-policy").expect("policy header");
        assert_eq!(policy, "\"per-minute\";q=5;w=60, \"per-hour\";q=2;w=3600");
    }
    let over = client
        .should_rate_limit(request("t10", vec![descriptor(&[("multi", "m")])]))
        .await?
        .into_inner();
    assert_eq!(over.overall_code(), Code::OverLimit);
    assert_eq!(over.statuses[0].current_limit.as_ref().expect("limit").name, "per-hour");
    Ok(())
}

/// A rejected request consumes nothing, not even on the descriptors that were within limits.
#[tokio::test]
async fn rejected_request_consumes_nothing() -> anyhow::Result<()> {
    let (node, _dir) = start();
    let mut client = node.client().await?;
    let both =
        || request("t10", vec![descriptor(&[("api_key", "frank")]), descriptor(&[("multi", "f")])]);
    for _ in 0..2 {
        assert_eq!(client.should_rate_limit(both()).await?.into_inner().overall_code(), Code::Ok);
    }
    let rejected = client.should_rate_limit(both()).await?.into_inner();
    assert_eq!(rejected.overall_code(), Code::OverLimit);
    assert_eq!(rejected.statuses[0].code(), Code::Ok);
    assert_eq!(rejected.statuses[0].limit_remaining, 1, "frank's hit was not consumed");
    let alone = client
        .should_rate_limit(request("t10", vec![descriptor(&[("api_key", "frank")])]))
        .await?
        .into_inner();
    assert_eq!((alone.overall_code(), alone.statuses[0].limit_remaining), (Code::Ok, 0));
    Ok(())
}

/// Unknown domains, unmatched descriptors and levels without a limit answer OK; an
/// unlimited rule answers OK with the maximum remaining; nested rules match by depth.
#[tokio::test]
async fn unmatched_and_unlimited_are_ok() -> anyhow::Result<()> {
    let (node, _dir) = start();
    let mut client = node.client().await?;
    let unknown = client
        .should_rate_limit(request("nope", vec![descriptor(&[("api_key", "a")])]))
        .await?
        .into_inner();
    assert_eq!(unknown.overall_code(), Code::Ok);
    assert!(unknown.response_headers_to_add.is_empty());
    let unmatched = client
        .should_rate_limit(request("t10", vec![descriptor(&[("other", "a")])]))
        .await?
        .into_inner();
    assert_eq!(unmatched.overall_code(), Code::Ok);
    let unlimited = client
        .should_rate_limit(request("t10", vec![descriptor(&[("open", "a")])]))
        .await?
        .into_inner();
    assert_eq!(unlimited.statuses[0].limit_remaining, u32::MAX);
    let tenant_only = client
        .should_rate_limit(request("t10", vec![descriptor(&[("tenant", "t")])]))
        .await?
        .into_inner();
    assert!(tenant_only.statuses[0].current_limit.is_none());
    let nested = || request("t10", vec![descriptor(&[("tenant", "t"), ("path", "/pay")])]);
    for _ in 0..2 {
        assert_eq!(client.should_rate_limit(nested()).await?.into_inner().overall_code(), Code::Ok);
    }
    assert_eq!(
        client.should_rate_limit(nested()).await?.into_inner().overall_code(),
        Code::OverLimit
    );
    // A new key takes the waiting path (its key is created first), which matches the request
    // a second time: its unmatched descriptor still counts once.
    let with_new_key = client
        .should_rate_limit(request(
            "t10",
            vec![descriptor(&[("other", "b")]), descriptor(&[("api_key", "new-key")])],
        ))
        .await?
        .into_inner();
    assert_eq!(with_new_key.overall_code(), Code::Ok);
    let metrics = node.metrics()?;
    assert_eq!(
        metric_value(&metrics, "quotamesh_rls_unmatched_total{reason=\"domain_not_found\"}"),
        1.0
    );
    assert_eq!(
        metric_value(&metrics, "quotamesh_rls_unmatched_total{reason=\"no_rule\"}"),
        3.0,
        "other=a, the tenant level without a limit, other=b: each once"
    );
    Ok(())
}

/// A limit of 0 (envoyproxy/ratelimit's black list) refuses every hit; a descriptor's limit
/// override replaces the configured limit.
#[tokio::test]
async fn zero_limit_and_overrides() -> anyhow::Result<()> {
    use quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    let (node, _dir) = start();
    let mut client = node.client().await?;
    let banned = client
        .should_rate_limit(request("t10", vec![descriptor(&[("client", "banned")])]))
        .await?
        .into_inner();
    assert_eq!(banned.overall_code(), Code::OverLimit);
    assert_eq!(banned.statuses[0].current_limit.as_ref().expect("limit").requests_per_unit, 0);
    let fine = client
        .should_rate_limit(request("t10", vec![descriptor(&[("client", "fine")])]))
        .await?
        .into_inner();
    assert_eq!(fine.overall_code(), Code::Ok, "no rule for other clients");

    let overridden = || {
        let mut item = descriptor(&[("api_key", "gina")]);
        item.limit = Some(RateLimitOverride { requests_per_unit: 1, unit: 3 /* HOUR */ });
        request("t10", vec![item])
    };
    let first = client.should_rate_limit(overridden()).await?.into_inner();
    let limit = first.statuses[0].current_limit.as_ref().expect("limit");
    assert_eq!((limit.requests_per_unit, limit.unit()), (1, Unit::Hour));
    assert_eq!(
        client.should_rate_limit(overridden()).await?.into_inner().overall_code(),
        Code::OverLimit
    );
    Ok(())
}

/// The node serves gRPC health (overall and for the RLS service) and reflection.
#[tokio::test]
async fn health_and_reflection_are_served() -> anyhow::Result<()> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let (node, _dir) = start();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", node.rls_addr))?
        .connect()
        .await?;
    let mut health = HealthClient::new(channel.clone());
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
        let answer =
            health.check(HealthCheckRequest { service: service.to_owned() }).await?.into_inner();
        assert_eq!(answer.status(), ServingStatus::Serving, "service {service:?}");
    }

    use tokio_stream::StreamExt;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut reflection = ServerReflectionClient::new(channel);
    let ask = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers =
        reflection.server_reflection_info(tokio_stream::iter([ask])).await?.into_inner();
    let answer = answers.next().await.expect("one answer")?;
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        anyhow::bail!("unexpected reflection answer");
    };
    assert!(
        list.service
            .iter()
            .any(|service| service.name == "envoy.service.ratelimit.v3.RateLimitService")
    );
    Ok(())
}

/// The names of a process's threads that serve its RLS port (`rls-N`), in order of N.
fn serving_threads(node: &NodeProcess) -> anyhow::Result<Vec<String>> {
    let pid = node.pid().expect("a running node");
    let mut names = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let name = std::fs::read_to_string(task?.path().join("comm"))?.trim().to_owned();
        if name.starts_with("rls-") {
            names.push(name);
        }
    }
    names.sort_by_key(|name| name[4..].parse::<usize>().unwrap_or(usize::MAX));
    Ok(names)
}

/// Six hits of one key over six connections of their own: a limit of 3 a minute admits
/// three, whichever thread each connection landed on.
async fn admitted_over_six_connections(node: &NodeProcess, key: &str) -> anyhow::Result<usize> {
    let mut clients = Vec::new();
    for _ in 0..6 {
        clients.push(node.client().await?);
    }
    let mut admitted = 0;
    for client in &mut clients {
        let answer = client
            .should_rate_limit(request("t10", vec![descriptor(&[("api_key", key)])]))
            .await?
            .into_inner();
        if answer.overall_code() == Code::Ok {
            admitted += 1;
        }
    }
    Ok(admitted)
}

/// A node on [`POLICY`] with `toml` for its configuration file, both in the directory
/// returned (bind it before the node, so that the node stops first).
fn start_configured(toml: &str) -> anyhow::Result<(tempfile::TempDir, NodeProcess)> {
    let directory = tempfile::tempdir()?;
    let policy = write_file(directory.path(), "t10.yaml", POLICY);
    let config = write_file(directory.path(), "node.toml", toml);
    let config = config.to_str().expect("UTF-8 path");
    let node =
        NodeProcess::start_with(&policy, &directory.path().join("data"), &["--config", config])?;
    Ok((directory, node))
}

/// A node serving its RLS port from three threads hands each its share of the connections,
/// and they decide against one set of counters.
#[tokio::test]
async fn serving_threads_share_the_counters() -> anyhow::Result<()> {
    let (_directory, node) = start_configured("rls_threads = 3\n")?;
    assert_eq!(serving_threads(&node)?, ["rls-0", "rls-1", "rls-2"]);
    assert_eq!(admitted_over_six_connections(&node, "shared").await?, 3, "over every thread");
    Ok(())
}

/// By default the port is served on the node's runtime, with no serving thread of its own;
/// `rls_threads = "auto"` runs one per core the node may use but one, at least one (the
/// test's own affinity, which the node inherits). Both decide alike.
#[tokio::test]
async fn serving_threads_follow_the_cores_when_auto() -> anyhow::Result<()> {
    let (_directory, node) = start_configured("")?;
    assert_eq!(serving_threads(&node)?, Vec::<String>::new(), "the node's runtime serves");
    assert_eq!(admitted_over_six_connections(&node, "node-runtime").await?, 3);

    let threads = quotamesh::config::auto_rls_threads(std::thread::available_parallelism()?.get());
    let (_directory, node) = start_configured("rls_threads = \"auto\"\n")?;
    let expected: Vec<String> = (0..threads).map(|index| format!("rls-{index}")).collect();
    assert_eq!(serving_threads(&node)?, expected, "one serving thread per core but one");
    assert_eq!(admitted_over_six_connections(&node, "auto").await?, 3);
    Ok(())
}
