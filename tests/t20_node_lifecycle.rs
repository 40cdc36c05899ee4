//! Life cycle of a real node: policy reload from disk without restart, refusal of a bad
//! policy, SIGHUP, exclusive data directory, clean exit on SIGTERM.

use std::time::{Duration, Instant};

use common::{NodeProcess, descriptor, metric_value, request, write_file};
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

fn policy(limit: u32) -> String {
    format!(
        "domain: t20\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
    )
}

/// Polls `check` until it holds or 10 s pass.
async fn eventually(mut check: impl AsyncFnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if check().await? {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("condition not reached within 10 s")
}

/// Editing the policy file changes the limit in place; a broken edit is refused, counted,
/// and the good policy stays active; SIGHUP reloads too.
#[tokio::test]
async fn policy_reloads_without_restart() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let path = write_file(directory.path(), "policy.yaml", &policy(1000));
    let node = NodeProcess::start(&path)?;
    let mut client = node.client().await?;
    let limit_of = async |client: &mut _| -> anyhow::Result<u32> {
        let client: &mut quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<_> = client;
        let response = client
            .should_rate_limit(request("t20", vec![descriptor(&[("k", "a")])]))
            .await?
            .into_inner();
        Ok(response.statuses[0].current_limit.as_ref().map_or(0, |limit| limit.requests_per_unit))
    };
    assert_eq!(limit_of(&mut client).await?, 1000);

    std::fs::write(&path, policy(7))?;
    eventually(async || Ok(limit_of(&mut client).await? == 7)).await?;

    std::fs::write(
        &path,
        "domain: t20\ndescriptors:\n  - key: k\n    rate_limit: {unit: never}\n",
    )?;
    eventually(async || {
        Ok(metric_value(&node.metrics()?, "quotamesh_policy_reload_failures_total") >= 1.0)
    })
    .await?;
    assert_eq!(limit_of(&mut client).await?, 7, "the bad file did not replace the good policy");

    std::fs::write(&path, policy(9))?;
    eventually(async || Ok(limit_of(&mut client).await? == 9)).await?;

    // SIGHUP reloads even when no file changed: the reload finds the same policy.
    let unchanged = "quotamesh_policy_reloads_total{result=\"unchanged\"}";
    let before = metric_value(&node.metrics()?, unchanged);
    node.signal("HUP")?;
    eventually(async || Ok(metric_value(&node.metrics()?, unchanged) > before)).await?;
    assert_eq!(limit_of(&mut client).await?, 9);
    Ok(())
}

/// A second node refuses a data directory that a running node holds.
#[test]
fn data_directory_is_exclusive() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let path = write_file(directory.path(), "policy.yaml", &policy(10));
    let data_dir = directory.path().join("data");
    let _first = NodeProcess::start_with(&path, &data_dir, &[])?;
    let second = NodeProcess::start_with(&path, &data_dir, &[]);
    let error = second.err().expect("second node must not start").to_string();
    assert!(error.contains("exited before becoming ready"), "{error}");
    Ok(())
}

/// SIGTERM stops the node cleanly (exit status 0) and frees its data directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_cleanly() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let path = write_file(directory.path(), "policy.yaml", &policy(10));
    let data_dir = directory.path().join("data");
    let mut node = NodeProcess::start_with(&path, &data_dir, &[])?;
    let mut client = node.client().await?;
    let response = client
        .should_rate_limit(request("t20", vec![descriptor(&[("k", "a")])]))
        .await?
        .into_inner();
    assert_eq!(response.overall_code(), Code::Ok);
    let status = node.terminate()?;
    assert!(status.success(), "exit status {status}");
    let restarted = NodeProcess::start_with(&path, &data_dir, &[]);
    assert!(restarted.is_ok(), "the data directory was released");
    Ok(())
}
