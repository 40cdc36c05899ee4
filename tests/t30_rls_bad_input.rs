//! Malformed ShouldRateLimit requests get INVALID_ARGUMENT with a clear message, oversized
//! ones RESOURCE_EXHAUSTED, and no per-key state is allocated for them.

use common::{NodeProcess, descriptor, metric_sum, request, write_file};
use quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use quotamesh::api::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tonic::Code as GrpcCode;

const POLICY: &str =
    "domain: t30\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5}\n";

/// Every kind of malformed request is refused with INVALID_ARGUMENT naming the problem, and a
/// request or metadata past the port's limits with RESOURCE_EXHAUSTED naming the sizes.
#[tokio::test]
async fn malformed_requests_are_refused() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let node = NodeProcess::start(&write_file(directory.path(), "p.yaml", POLICY))?;
    let mut client = node.client().await?.max_encoding_message_size(8 * 1024 * 1024);
    let long = "x".repeat(1025);
    let many_entries: Vec<(&str, &str)> = (0..65).map(|_| ("k", "v")).collect();
    let cases: Vec<(RateLimitRequest, &str)> = vec![
        (request("", vec![descriptor(&[("k", "v")])]), "domain must not be empty"),
        (request(&long, vec![descriptor(&[("k", "v")])]), "domain is 1025 bytes"),
        (request("t30", vec![]), "at least one descriptor"),
        (request("t30", (0..65).map(|_| descriptor(&[("k", "v")])).collect()), "65 descriptors"),
        (request("t30", vec![descriptor(&[])]), "descriptor 0 has no entries"),
        (request("t30", vec![descriptor(&many_entries)]), "65 entries"),
        (request("t30", vec![descriptor(&[("", "v")])]), "key must not be empty"),
        (request("t30", vec![descriptor(&[(long.as_str(), "v")])]), "key is 1025 bytes"),
        (request("t30", vec![descriptor(&[("k", long.as_str())])]), "value is 1025 bytes"),
        (
            request(
                "t30",
                vec![RateLimitDescriptor {
                    limit: Some(RateLimitOverride { requests_per_unit: 5, unit: 0 }),
                    ..descriptor(&[("k", "v")])
                }],
            ),
            "limit override has unknown unit 0",
        ),
    ];
    for (bad, expected) in cases {
        let status = client.should_rate_limit(bad).await.expect_err("refused");
        assert_eq!(status.code(), GrpcCode::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains(expected),
            "{:?} should mention {expected:?}",
            status.message()
        );
    }
    // Just over 1 MiB in total while every field is within its own bound, and 3 MiB (between
    // the README's 1 MiB and tonic's default 4 MiB): refused before decoding.
    let big_value = "v".repeat(1000);
    for descriptors in [64, 190] {
        let big: Vec<_> =
            (0..descriptors).map(|_| descriptor(&[("k", big_value.as_str()); 17])).collect();
        let status = client.should_rate_limit(request("t30", big)).await.expect_err("refused");
        assert_eq!(status.code(), GrpcCode::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("the limit is: 1048576 bytes"), "{}", status.message());
    }
    // Metadata past the limit, such as a 60 KiB header.
    let mut long_header = tonic::Request::new(request("t30", vec![descriptor(&[("k", "v")])]));
    long_header.metadata_mut().insert("x-padding", "p".repeat(60 * 1024).parse()?);
    let status = client.should_rate_limit(long_header).await.expect_err("60 KiB header");
    assert_eq!(status.code(), GrpcCode::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("request metadata is"), "{}", status.message());

    let metrics = node.metrics()?;
    assert_eq!(metric_sum(&metrics, "quotamesh_shard_keys"), 0.0, "no state allocated:\n{metrics}");
    // The malformed ones; the oversized ones never reach the service.
    assert_eq!(metric_sum(&metrics, "quotamesh_rls_rejected_requests_total"), 10.0);

    // The node still answers good requests.
    let good = client
        .should_rate_limit(request("t30", vec![descriptor(&[("k", "v")])]))
        .await?
        .into_inner();
    assert_eq!(good.overall_code(), Code::Ok);
    Ok(())
}

/// The RLS service answers an unknown method with UNIMPLEMENTED and bytes that are no
/// `RateLimitRequest` with a decode error, allocates nothing for either, and goes on
/// answering.
#[tokio::test]
async fn unknown_methods_and_undecodable_messages_are_refused() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let node = NodeProcess::start(&write_file(directory.path(), "p.yaml", POLICY))?;
    let channel =
        tonic::transport::Endpoint::new(format!("http://{}", node.rls_addr))?.connect().await?;
    // A message the client encodes as field 1 = varint 5, where the service reads field 1
    // as the domain, a string: not a RateLimitRequest.
    let not_a_request = prost_types::Duration { seconds: 5, nanos: 0 };
    let call = |path: &'static str| {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        let message = not_a_request;
        async move {
            grpc.ready().await?;
            let codec =
                tonic_prost::ProstCodec::<prost_types::Duration, prost_types::Duration>::default();
            let path = http::uri::PathAndQuery::from_static(path);
            anyhow::Ok(grpc.unary(tonic::Request::new(message), path, codec).await)
        }
    };
    let unknown = call("/envoy.service.ratelimit.v3.RateLimitService/ShouldNotRateLimit")
        .await?
        .expect_err("no such method");
    assert_eq!(unknown.code(), GrpcCode::Unimplemented, "{unknown:?}");
    let undecodable = call("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        .await?
        .expect_err("not a RateLimitRequest");
    assert_eq!(undecodable.code(), GrpcCode::Internal, "{undecodable:?}");
    assert!(undecodable.message().contains("decode"), "{}", undecodable.message());

    let metrics = node.metrics()?;
    assert_eq!(metric_sum(&metrics, "quotamesh_shard_keys"), 0.0, "no state allocated:\n{metrics}");
    let good = node
        .client()
        .await?
        .should_rate_limit(request("t30", vec![descriptor(&[("k", "v")])]))
        .await?
        .into_inner();
    assert_eq!(good.overall_code(), Code::Ok);
    Ok(())
}

/// `quotamesh policy validate` reports every error with file and line and exits non-zero;
/// a good file passes.
#[test]
fn policy_validate_reports_file_and_line() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let good = write_file(directory.path(), "good.yaml", POLICY);
    let bad = write_file(
        directory.path(),
        "bad.yaml",
        "domain: bad\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n  - key: b\n    rate_limit: {unit: second, unlimited: true}\n",
    );
    let binary = env!("CARGO_BIN_EXE_quotamesh");
    let output =
        std::process::Command::new(binary).args(["policy", "validate"]).arg(&good).output()?;
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));

    let output = std::process::Command::new(binary)
        .args(["policy", "validate"])
        .arg(&good)
        .arg(&bad)
        .output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let bad_name = bad.display().to_string();
    assert!(stderr.contains(&format!("{bad_name}:4:")), "unit error on line 4: {stderr}");
    assert!(stderr.contains(&format!("{bad_name}:6:")), "unlimited error on line 6: {stderr}");
    assert!(stderr.contains("2 error(s)"), "{stderr}");

    // With --json, one object on stdout says the same to a script.
    let output = std::process::Command::new(binary)
        .args(["policy", "validate", "--json"])
        .arg(&good)
        .output()?;
    assert!(output.status.success());
    let answer: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    assert_eq!(answer["ok"], true, "{answer}");
    assert_eq!(answer["files"], 1, "{answer}");
    assert_eq!(answer["digest"].as_str().map(str::len), Some(16), "{answer}");
    let output = std::process::Command::new(binary)
        .args(["policy", "validate", "--json"])
        .arg(&good)
        .arg(&bad)
        .output()?;
    assert!(!output.status.success());
    let answer: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    assert_eq!(answer["ok"], false, "{answer}");
    let errors = answer["errors"].as_array().map(Vec::len);
    assert_eq!(errors, Some(2), "{answer}");
    Ok(())
}

/// A policy file over the size limit is refused by its size, naming the limit, not by a
/// parser limit it happens to reach (a 15 MB file was refused with a message about aliases
/// it did not contain).
#[test]
fn policy_validate_refuses_an_oversized_file_by_its_size() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let mut text = String::from("domain: big\ndescriptors:\n");
    let mut index = 0;
    while text.len() < 3 * 1024 * 1024 {
        text.push_str(&format!(
            "  - key: k{index}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
        ));
        index += 1;
    }
    let big = write_file(directory.path(), "big.yaml", &text);
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_quotamesh"))
        .args(["policy", "validate"])
        .arg(&big)
        .output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("policy files may be at most 2097152"), "{stderr}");
    assert!(!stderr.contains("alias"), "{stderr}");
    Ok(())
}
