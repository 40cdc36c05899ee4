//! Rollout stages through real `quotamesh` processes over gRPC (DESIGN section 7): a warn
//! rule admits and tells the caller it is over and when enforcement begins; a canary rule
//! enforces on the nodes its hash picks and warns on the others; shadow and enforce keep
//! their meaning. The same warning through a real Envoy is in `t10_envoy_end_to_end.rs`.

use common::{NodeProcess, descriptor, metric_value, request, rls_header as header, write_file};
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use quotamesh::core::policy::canary_point;

const DOMAIN: &str = "rollout";

/// A node with `id` serving `policy`.
fn start(directory: &std::path::Path, id: &str, policy: &str) -> anyhow::Result<NodeProcess> {
    let policy = write_file(directory, &format!("{id}.yaml"), policy);
    NodeProcess::start_with(&policy, &directory.join(id), &["--node-id", id])
}

/// A warn rule of 2 per minute answers OK to every hit; past its limit each answer carries
/// `RateLimit-Warning` with the enforcement day, no `Retry-After`, and is counted; an
/// enforce rule next to it still refuses. A warned hit consumes nothing, as a shadow one.
#[tokio::test]
async fn a_warn_rule_admits_and_warns() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let node = start(
        directory.path(),
        "warn-node",
        r#"
domain: rollout
descriptors:
  - key: warned
    rollout: warn
    enforce_after: 2027-01-08
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: enforced
    rollout: enforce
    rate_limit: {unit: minute, requests_per_unit: 2}
"#,
    )?;
    let mut client = node.client().await?;
    for hit in 1..=6 {
        let response = client
            .should_rate_limit(request(DOMAIN, vec![descriptor(&[("warned", "w")])]))
            .await?
            .into_inner();
        assert_eq!(response.overall_code(), Code::Ok, "hit {hit}: {response:?}");
        assert_eq!(header(&response, "retry-after"), None, "hit {hit}");
        let warning = header(&response, "ratelimit-warning");
        if hit <= 2 {
            assert_eq!(warning, None, "hit {hit} is within the limit");
        } else {
            let warning = warning.unwrap_or_else(|| panic!("hit {hit} warned: {response:?}"));
            assert!(
                warning.ends_with("over quota; enforcement begins 2027-01-08"),
                "hit {hit}: {warning}"
            );
        }
    }
    for (hit, expected) in [(1, Code::Ok), (2, Code::Ok), (3, Code::OverLimit)] {
        let response = client
            .should_rate_limit(request(DOMAIN, vec![descriptor(&[("enforced", "e")])]))
            .await?
            .into_inner();
        assert_eq!(response.overall_code(), expected, "enforced hit {hit}");
        assert_eq!(header(&response, "ratelimit-warning"), None);
    }
    let metrics = node.metrics()?;
    let warned =
        metric_value(&metrics, "quotamesh_rls_warnings_total{domain=\"rollout\",rule=\"warned\"}");
    assert_eq!(warned, 4.0, "{metrics}");
    let decisions = metric_value(
        &metrics,
        "quotamesh_rls_descriptor_decisions_total{code=\"warn_over_limit\",domain=\"rollout\",rule=\"warned\"}",
    );
    assert_eq!(decisions, 4.0, "{metrics}");
    Ok(())
}

/// Two nodes serve one policy whose rule is a canary with a share that puts exactly one of
/// them in it (computed from the same hash the nodes use): past the limit that node answers
/// OVER_LIMIT, the other OK with a warning. Both nodes agree on who is in, whatever order
/// they start in, since the choice is a hash of the node id and the rule.
#[tokio::test]
async fn a_canary_enforces_on_its_nodes_only() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let (first, second) = ("canary-a", "canary-b");
    let point = |node| canary_point(node, DOMAIN, "tenant");
    let (inside, outside) =
        if point(first) < point(second) { (first, second) } else { (second, first) };
    anyhow::ensure!(point(inside) != point(outside), "two names, two points");
    // Every point below the share is in: the share is the outside node's point.
    let share = point(outside);
    let policy = format!(
        "domain: rollout\ndescriptors:\n  - key: tenant\n    rollout: {{canary: {}.{:02}%}}\n    \
         rate_limit: {{unit: minute, requests_per_unit: 2}}\n",
        share / 100,
        share % 100
    );
    let nodes = [
        (start(directory.path(), inside, &policy)?, Code::OverLimit),
        (start(directory.path(), outside, &policy)?, Code::Ok),
    ];
    for (node, past_the_limit) in &nodes {
        let mut client = node.client().await?;
        for hit in 1..=4 {
            let response = client
                .should_rate_limit(request(DOMAIN, vec![descriptor(&[("tenant", "t1")])]))
                .await?
                .into_inner();
            let expected = if hit <= 2 { Code::Ok } else { *past_the_limit };
            assert_eq!(response.overall_code(), expected, "hit {hit}: {response:?}");
            let warned = header(&response, "ratelimit-warning").is_some();
            assert_eq!(warned, hit > 2 && *past_the_limit == Code::Ok, "hit {hit}: {response:?}");
            assert_eq!(header(&response, "retry-after").is_some(), expected == Code::OverLimit);
        }
    }
    Ok(())
}

/// A shadow rule's would-be rejections reach the node's events file as JSON lines (node,
/// rule, descriptor), and `quotamesh policy shadow-report` sums them per rule with the
/// descriptors blocked most; the requests themselves were all admitted.
#[tokio::test]
async fn shadow_events_are_written_and_reported() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let events = directory.path().join("shadow.jsonl");
    let policy = write_file(
        directory.path(),
        "policy.yaml",
        "domain: rollout\ndescriptors:\n  - key: shadowed\n    rollout: shadow\n    \
         rate_limit: {unit: minute, requests_per_unit: 1}\n",
    );
    let node = NodeProcess::start_with(
        &policy,
        &directory.path().join("data"),
        &["--node-id", "shadow-node", "--shadow-events-file", events.to_str().expect("UTF-8")],
    )?;
    let mut client = node.client().await?;
    for (value, hits) in [("x", 5), ("y", 3)] {
        for _ in 0..hits {
            let response = client
                .should_rate_limit(request(DOMAIN, vec![descriptor(&[("shadowed", value)])]))
                .await?
                .into_inner();
            assert_eq!(response.overall_code(), Code::Ok);
        }
    }
    // 4 of x and 2 of y would have been refused; the writer flushes within a second.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let lines = loop {
        let text = std::fs::read_to_string(&events).unwrap_or_default();
        if text.lines().count() >= 6 || std::time::Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(lines.lines().count(), 6, "{lines}");
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().expect("a line"))?;
    assert_eq!(first["event"], "RateLimitShadowBlock");
    assert_eq!(first["node"], "shadow-node");
    assert_eq!(first["rule"], "shadowed");
    assert_eq!(first["descriptor"][0]["value"], "x");

    let report = std::process::Command::new(env!("CARGO_BIN_EXE_quotamesh"))
        .args(["policy", "shadow-report", "--since", "1h", "--top", "2"])
        .arg(&events)
        .output()?;
    let text = String::from_utf8(report.stdout)?;
    assert!(report.status.success(), "{text}");
    assert!(text.contains("rollout/shadowed: 6 request(s) would have been refused"), "{text}");
    let top: Vec<&str> = text.lines().skip(1).map(str::trim).collect();
    assert_eq!(top, ["4  shadowed=x", "2  shadowed=y"], "{text}");
    let json = std::process::Command::new(env!("CARGO_BIN_EXE_quotamesh"))
        .args(["policy", "shadow-report", "--json"])
        .arg(&events)
        .output()?;
    let json: serde_json::Value = serde_json::from_slice(&json.stdout)?;
    assert_eq!(json["rules"][0]["blocks"], 6, "{json}");
    Ok(())
}
