//! envoyproxy/ratelimit compatibility: that project's own configuration fixtures load or are
//! refused as its config tests say, and the sequences of its integration tests give, on a
//! real node with `default_algorithm = "fixed_window"`, the codes, limits and remaining
//! counts it asserts, apart from the documented difference that rejected hits consume
//! nothing.
//!
//! The fixtures are test data read at test time from the reference copy beside the
//! repository (`../shared/reference/envoy-ratelimit-fixtures`, see its NOTICE); the
//! sequences are written here from upstream's documented behaviour.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{CpuHog, NodeProcess, descriptor, metric_value, request, write_file};
use quotamesh::api::proto::envoy::service::ratelimit::v3::RateLimitResponse;
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use quotamesh::core::policy::{LoadOptions, PolicySet, PolicySource};
use quotamesh::core::rate::Algorithm;

/// The reference copy of upstream's fixtures, beside the repository.
fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/reference/envoy-ratelimit-fixtures")
}

fn fixture(path: &str) -> PolicySource {
    let full = fixtures().join(path);
    let text = std::fs::read_to_string(&full)
        .unwrap_or_else(|error| panic!("read fixture {}: {error}", full.display()));
    PolicySource { name: path.to_owned(), text }
}

/// What a migrating user sets: upstream's counting, and merging if they merged.
fn upstream(merge_domains: bool) -> LoadOptions {
    LoadOptions { merge_domains, default_algorithm: Algorithm::FixedWindow }
}

/// Every configuration upstream's config and integration tests load, loads; every one they
/// refuse is refused (each alone, as upstream loads them).
#[test]
fn upstream_fixtures_load_and_fail_as_upstream() {
    let loads: [&[&str]; 12] = [
        &["test/config/basic_config.yaml"],
        &["test/config/shadowmode_config.yaml"],
        &["test/config/share_threshold.yaml"],
        &["test/config/wildcard.yaml"],
        &["test/config/metadata.yaml"],
        &["test/config/merge_domain_key1.yaml", "test/config/merge_domain_key2.yaml"],
        &["test/config/basic_config.yaml", "test/config/duplicate_domain.yaml"],
        &["test/integration/runtime/current/ratelimit/config/basic.yaml"],
        &["test/integration/runtime/current/ratelimit/config/another.yaml"],
        &["test/integration/runtime/current/ratelimit/config/share_threshold.yaml"],
        &["test/integration/runtime/current/ratelimit/reload.yaml"],
        &["examples/ratelimit/config/example.yaml", "examples/ratelimit/config/config.yaml"],
    ];
    for paths in loads {
        let sources: Vec<PolicySource> = paths.iter().map(|path| fixture(path)).collect();
        let merge = paths.len() > 1 && paths[0].contains("test/config");
        if let Err(errors) = PolicySet::parse_with(&sources, upstream(merge)) {
            panic!("{paths:?} must load:\n{errors}");
        }
    }
    let refused = [
        "test/config/bad_limit_unit.yaml",
        "test/config/bad_yaml.yaml",
        "test/config/duplicate_key.yaml",
        "test/config/empty_domain.yaml",
        "test/config/empty_key.yaml",
        "test/config/misspelled_key.yaml",
        "test/config/misspelled_key2.yaml",
        "test/config/non_map_list.yaml",
        "test/config/non_string_key.yaml",
        "test/config/replaces_empty.yaml",
        "test/config/replaces_self.yaml",
        "test/config/unlimited_with_unit.yaml",
    ];
    for path in refused {
        assert!(
            PolicySet::parse_with(&[fixture(path)], upstream(true)).is_err(),
            "{path} must be refused"
        );
    }
    // Without merging, one domain in two files is refused, as upstream's default.
    let split = [
        fixture("test/config/merge_domain_key1.yaml"),
        fixture("test/config/merge_domain_key2.yaml"),
    ];
    assert!(PolicySet::parse_with(&split, upstream(false)).is_err());
}

/// A node serving upstream's integration-test configs, its example config and the split
/// domain of its merge test, from its own files unchanged, with `[policy]` set as a migrating
/// user sets it.
fn start_upstream_node() -> (NodeProcess, tempfile::TempDir) {
    start_node_serving(&[
        ("basic.yaml", "test/integration/runtime/current/ratelimit/config/basic.yaml"),
        ("another.yaml", "test/integration/runtime/current/ratelimit/config/another.yaml"),
        ("share.yaml", "test/integration/runtime/current/ratelimit/config/share_threshold.yaml"),
        ("reload.yaml", "test/integration/runtime/current/ratelimit/reload.yaml"),
        ("example.yaml", "examples/ratelimit/config/example.yaml"),
        ("merge1.yaml", "test/config/merge_domain_key1.yaml"),
        ("merge2.yaml", "test/config/merge_domain_key2.yaml"),
    ])
}

/// A node serving the fixtures `files` (name in the policy directory, fixture path), with
/// `[policy]` set as a migrating user sets it; the policy directory is `policies` in the
/// returned one.
fn start_node_serving(files: &[(&str, &str)]) -> (NodeProcess, tempfile::TempDir) {
    let directory = tempfile::tempdir().expect("temp dir");
    let policies = directory.path().join("policies");
    std::fs::create_dir(&policies).expect("policy directory");
    for (name, path) in files {
        write_file(&policies, name, &fixture(path).text);
    }
    let config = write_file(
        directory.path(),
        "node.toml",
        "[policy]\nmerge_domains = true\ndefault_algorithm = \"fixed_window\"\n",
    );
    let config = config.to_str().expect("UTF-8 path").to_owned();
    let node =
        NodeProcess::start_with(&policies, &directory.path().join("data"), &["--config", &config])
            .expect("node starts");
    (node, directory)
}

fn now_ms() -> u64 {
    u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970").as_millis())
        .expect("fits u64")
}

/// Waits until at least `margin_ms` remain in the current aligned window of `window_ms`, so
/// a short sequence runs inside one fixed window (upstream's tests assume the same).
fn inside_one_window(window_ms: u64, margin_ms: u64) {
    let left_ms = window_ms - now_ms() % window_ms;
    if left_ms < margin_ms {
        std::thread::sleep(Duration::from_millis(left_ms + 50));
    }
}

/// Seconds to the end of the current aligned window, as upstream computes
/// `duration_until_reset`.
fn seconds_to_window_end(window_ms: u64) -> i64 {
    i64::try_from((window_ms - now_ms() % window_ms).div_ceil(1_000)).expect("small")
}

async fn call(
    node: &NodeProcess,
    domain: &str,
    descriptors: Vec<
        quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor,
    >,
) -> RateLimitResponse {
    let mut client = node.client().await.expect("client");
    client.should_rate_limit(request(domain, descriptors)).await.expect("answer").into_inner()
}

/// Upstream's basic sequence on a key-only rule of 20 per minute, with both cores busy,
/// on `key2` and on `key2_local` (upstream runs it again on the `_local` keys with its local
/// cache on; quotamesh has no such cache to turn on, and the answers are the same): 20
/// answers OK with remaining 19 down to 0, then OVER_LIMIT with remaining 0; every status
/// shows the limit (20 per MINUTE, no name) and the time to the end of the aligned minute;
/// the statistics count 25 hits, 20 within, 4 near (the 17th to 20th, ratio 0.8), 5 over.
#[tokio::test]
async fn key_only_minute_limit_counts_as_upstream() {
    let (node, _directory) = start_upstream_node();
    let _hog = CpuHog::start(2);
    for key in ["key2", "key2_local"] {
        inside_one_window(60_000, 15_000);
        let value = format!("value-{}", now_ms());
        for hit in 0..25_u32 {
            let response = call(&node, "another", vec![descriptor(&[(key, &value)])]).await;
            let status = &response.statuses[0];
            let (code, remaining) =
                if hit < 20 { (Code::Ok, 19 - hit) } else { (Code::OverLimit, 0) };
            assert_eq!(
                (response.overall_code(), status.code(), status.limit_remaining),
                (code, code, remaining),
                "{key} hit {hit}"
            );
            let limit = status.current_limit.as_ref().expect("current limit");
            assert_eq!(
                (limit.requests_per_unit, limit.unit(), limit.name.as_str()),
                (20, Unit::Minute, "")
            );
            let reset = status.duration_until_reset.expect("reset").seconds;
            assert!(
                (reset - seconds_to_window_end(60_000)).abs() <= 1,
                "reset {reset} at {key} hit {hit}"
            );
        }
        let metrics = node.metrics().expect("metrics");
        assert_eq!(statistics(&metrics, "another", key), (25.0, 20.0, 4.0, 5.0), "{metrics}");
    }
}

/// Upstream's statistics of one key, as (total, within, near, over).
fn statistics(metrics: &str, domain: &str, key: &str) -> (f64, f64, f64, f64) {
    let series = |name: &str| {
        metric_value(
            metrics,
            &format!("quotamesh_ratelimit_{name}_total{{domain=\"{domain}\",key=\"{key}\"}}"),
        )
    };
    (series("total_hits"), series("within_limit"), series("near_limit"), series("over_limit"))
}

/// Two descriptors in one request (upstream's key2 at 20/minute and key3 at 10/hour, and
/// again on the `_local` keys), 15 times as upstream sends them: the request is OVER_LIMIT
/// once key3 is, with each status saying its own code, and the statistics of the two keys
/// in the same request are counted apart: key2 15 hits all within, key3 15 hits of which
/// 10 within, 2 near and 5 over (upstream asserts the totals and the over-limit counts).
/// The documented difference: the rejected requests consume nothing on key2 either
/// (upstream's remaining for key2 goes on down to 5; here it stays at 10).
#[tokio::test]
async fn multiple_descriptors_answer_per_descriptor() {
    let (node, _directory) = start_upstream_node();
    for (key2, key3) in [("key2", "key3"), ("key2_local", "key3_local")] {
        inside_one_window(60_000, 15_000);
        let value = format!("multi-{}", now_ms());
        for hit in 0..15_u32 {
            let response = call(
                &node,
                "another",
                vec![descriptor(&[(key2, &value)]), descriptor(&[(key3, &value)])],
            )
            .await;
            let (first, second) = (&response.statuses[0], &response.statuses[1]);
            if hit < 10 {
                assert_eq!(response.overall_code(), Code::Ok, "{key3} hit {hit}");
                assert_eq!((first.limit_remaining, second.limit_remaining), (19 - hit, 9 - hit));
            } else {
                assert_eq!(response.overall_code(), Code::OverLimit, "{key3} hit {hit}");
                assert_eq!((first.code(), second.code()), (Code::Ok, Code::OverLimit));
                // Nothing was consumed: key2 still has what the 10 admitted requests left.
                assert_eq!((first.limit_remaining, second.limit_remaining), (10, 0));
            }
            let limits = [first, second].map(|status| {
                let limit = status.current_limit.as_ref().expect("limit");
                (limit.requests_per_unit, limit.unit())
            });
            assert_eq!(limits, [(20, Unit::Minute), (10, Unit::Hour)]);
        }
        let metrics = node.metrics().expect("metrics");
        assert_eq!(statistics(&metrics, "another", key2), (15.0, 15.0, 0.0, 0.0), "{metrics}");
        assert_eq!(statistics(&metrics, "another", key3), (15.0, 10.0, 2.0, 5.0), "{metrics}");
    }
}

/// Upstream's token-quota pattern with a stream that overruns what is left (a check with
/// `hits_addend: 0`, the stream's tokens charged at its end): upstream adds the whole
/// charge to its window's counter, so the caller is over its limit for the rest of the
/// window. On a fixed window quotamesh spends what was left, with the same answers: the
/// charge is OVER_LIMIT (Envoy ignores that answer), and every later check and hit is
/// OVER_LIMIT with remaining 0; so is a charge beyond the whole limit. Both cores busy.
#[tokio::test]
async fn a_charge_larger_than_what_is_left_spends_the_window() {
    let (node, _directory) = start_upstream_node();
    let _hog = CpuHog::start(2);
    inside_one_window(60_000, 15_000);
    let value = format!("quota-{}", now_ms());
    let hits = |value: &str, hits: Option<u64>| {
        let mut key2 = descriptor(&[("key2", value)]);
        key2.hits_addend = hits;
        vec![key2]
    };
    let answer = |response: RateLimitResponse| {
        (response.overall_code(), response.statuses[0].limit_remaining)
    };
    let check = Some(0);
    assert_eq!(answer(call(&node, "another", hits(&value, check)).await), (Code::Ok, 20));
    assert_eq!(answer(call(&node, "another", hits(&value, Some(15))).await), (Code::Ok, 5));
    assert_eq!(answer(call(&node, "another", hits(&value, check)).await), (Code::Ok, 5));
    // The stream's charge is 8 with 5 left: refused, and it spends the 5, also when the
    // lease asked for it came late and the fallback refused it (Envoy ignores this answer).
    assert_eq!(answer(call(&node, "another", hits(&value, Some(8))).await), (Code::OverLimit, 0));
    for request in [check, None, check] {
        let response = call(&node, "another", hits(&value, request)).await;
        assert_eq!(answer(response), (Code::OverLimit, 0), "after the overrun: {request:?}");
    }
    // A charge beyond the whole limit, on a key never seen: the window is spent at once.
    let big = format!("{value}-big");
    assert_eq!(answer(call(&node, "another", hits(&big, Some(30))).await), (Code::OverLimit, 0));
    assert_eq!(answer(call(&node, "another", hits(&big, check)).await), (Code::OverLimit, 0));
    let metrics = node.metrics().expect("metrics");
    // Checks count no hit; the charges and the plain hit do (15 + 8 + 1 + 30).
    assert_eq!(statistics(&metrics, "another", "key2").0, 54.0, "{metrics}");
}

/// Per-second windows (upstream's `key1`, 50 per second): 50 hits in one second answer OK
/// with remaining 49 down to 0 and `duration_until_reset` 1 s, the 51st is OVER_LIMIT, and
/// the first hit after the second boundary starts a new window (remaining 49): hits spent
/// at the end of one second count nothing in the next. Likewise a charge beyond the limit
/// spends its second only: a check just after the boundary has all 50. A sequence that the
/// loaded machine stretched over a boundary is sent again (at most 5 times); both cores
/// busy.
#[tokio::test]
async fn per_second_windows_restart_at_each_second() {
    let (node, _directory) = start_upstream_node();
    let _hog = CpuHog::start(2);
    let mut fitted = 0;
    for attempt in 0..5 {
        inside_one_window(1_000, 800);
        let value = format!("second-{attempt}-{}", now_ms());
        let started_ms = now_ms();
        let mut answers = Vec::with_capacity(51);
        for _ in 0..51 {
            let response = call(&node, "basic", vec![descriptor(&[("key1", &value)])]).await;
            let status = &response.statuses[0];
            let limit = status.current_limit.as_ref().expect("limit");
            assert_eq!((limit.requests_per_unit, limit.unit()), (50, Unit::Second));
            let reset = status.duration_until_reset.expect("reset").seconds;
            answers.push((response.overall_code(), status.limit_remaining, reset));
        }
        let overrun = format!("{value}-overrun");
        let mut charge = descriptor(&[("key1", &overrun)]);
        charge.hits_addend = Some(60);
        let charged = call(&node, "basic", vec![charge]).await;
        if now_ms() / 1_000 != started_ms / 1_000 {
            continue;
        }
        fitted += 1;
        let expected: Vec<(Code, u32, i64)> = (0..51_u32)
            .map(|hit| if hit < 50 { (Code::Ok, 49 - hit, 1) } else { (Code::OverLimit, 0, 1) })
            .collect();
        assert_eq!(answers, expected);
        assert_eq!(charged.overall_code(), Code::OverLimit);
        // Into the next second.
        std::thread::sleep(Duration::from_millis(1_000 - now_ms() % 1_000 + 50));
        let next = call(&node, "basic", vec![descriptor(&[("key1", &value)])]).await;
        assert_eq!((next.overall_code(), next.statuses[0].limit_remaining), (Code::Ok, 49));
        let mut check = descriptor(&[("key1", &overrun)]);
        check.hits_addend = Some(0);
        let checked = call(&node, "basic", vec![check]).await;
        assert_eq!(
            (checked.overall_code(), checked.statuses[0].limit_remaining),
            (Code::Ok, 50),
            "the overrun spent its own second only"
        );
        break;
    }
    assert_eq!(fitted, 1, "no sequence fitted in one second in 5 attempts");
}

/// Upstream's runtime reload: a policy file added to the watched directory takes effect
/// without a restart (the `reload` domain's 0-per-second `block` rule answers OVER_LIMIT
/// where its domain was unknown, OK), a changed file takes effect, and a removed one is
/// gone again.
#[tokio::test]
async fn a_policy_file_changed_on_disk_takes_effect() {
    let (node, directory) = start_node_serving(&[(
        "basic.yaml",
        "test/integration/runtime/current/ratelimit/config/basic.yaml",
    )]);
    let policies = directory.path().join("policies");
    let block = || vec![descriptor(&[("block", "foo")])];
    let unknown = call(&node, "reload", block()).await;
    assert_eq!(unknown.overall_code(), Code::Ok);
    assert!(unknown.statuses[0].current_limit.is_none(), "no rule yet");

    let reload = fixture("test/integration/runtime/current/ratelimit/reload.yaml").text;
    write_file(&policies, "reload.yaml", &reload);
    let blocked =
        until_answer(&node, "reload", block, |answer| answer.overall_code() == Code::OverLimit)
            .await;
    let limit = blocked.statuses[0].current_limit.as_ref().expect("limit");
    assert_eq!(
        (limit.requests_per_unit, limit.unit(), blocked.statuses[0].limit_remaining),
        (0, Unit::Second, 0)
    );

    // Changed on disk: the block rule now admits 5 per second.
    let zero = "key: block\n    rate_limit:\n      unit: second\n      requests_per_unit: 0";
    assert!(reload.contains(zero), "the fixture's block rule");
    write_file(&policies, "reload.yaml", &reload.replace(zero, &zero.replace(": 0", ": 5")));
    let admitted =
        until_answer(&node, "reload", block, |answer| answer.overall_code() == Code::Ok).await;
    let limit = admitted.statuses[0].current_limit.as_ref().expect("limit");
    assert_eq!((limit.requests_per_unit, limit.unit()), (5, Unit::Second));

    // Removed: the domain is unknown again, the other file's rules stay.
    std::fs::remove_file(policies.join("reload.yaml")).expect("remove");
    until_answer(&node, "reload", block, |answer| answer.statuses[0].current_limit.is_none()).await;
    let basic = call(&node, "basic", vec![descriptor(&[("one_per_minute", "reload-test")])]).await;
    assert_eq!(basic.statuses[0].current_limit.as_ref().expect("limit").requests_per_unit, 1);
}

/// Asks until `wanted` holds for the answer, for at most 10 s (the watcher folds a burst of
/// file events into one reload).
async fn until_answer(
    node: &NodeProcess,
    domain: &str,
    descriptors: impl Fn() -> Vec<
        quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor,
    >,
    wanted: impl Fn(&RateLimitResponse) -> bool,
) -> RateLimitResponse {
    for _ in 0..100 {
        let response = call(node, domain, descriptors()).await;
        if wanted(&response) {
            return response;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{domain} never gave the answer waited for");
}

/// `share_threshold`: every value under `files/*` shares one counter of 10 per hour (the
/// 11th hit, on a value never seen, is OVER_LIMIT); without it each value has its own.
#[tokio::test]
async fn share_threshold_shares_one_counter() {
    let (node, _directory) = start_upstream_node();
    inside_one_window(3_600_000, 60_000);
    for hit in 0..10_u32 {
        let file = format!("files/{hit}.pdf");
        let response =
            call(&node, "share-threshold-test", vec![descriptor(&[("files", &file)])]).await;
        assert_eq!(
            (response.overall_code(), response.statuses[0].limit_remaining),
            (Code::Ok, 9 - hit)
        );
    }
    let other =
        call(&node, "share-threshold-test", vec![descriptor(&[("files", "files/b.csv")])]).await;
    assert_eq!(other.overall_code(), Code::OverLimit, "the shared counter is spent");
    for _ in 0..10 {
        let response = call(
            &node,
            "share-threshold-test",
            vec![descriptor(&[("files_no_share", "files_no_share/a")])],
        )
        .await;
        assert_eq!(response.overall_code(), Code::Ok);
    }
    let fresh = call(
        &node,
        "share-threshold-test",
        vec![descriptor(&[("files_no_share", "files_no_share/b")])],
    )
    .await;
    assert_eq!(
        (fresh.overall_code(), fresh.statuses[0].limit_remaining),
        (Code::Ok, 9),
        "own counter"
    );
    let metrics = node.metrics().expect("metrics");
    let shared = "quotamesh_ratelimit_total_hits_total{domain=\"share-threshold-test\",key=\"files_files/*\"}";
    assert_eq!(metric_value(&metrics, shared), 11.0, "{metrics}");
}

/// Upstream's one-per-minute and blocked (0 per second) rules, and its example's named and
/// unnamed limits: `current_limit.name` is the limit's `name` or empty.
#[tokio::test]
async fn small_limits_and_names() {
    let (node, _directory) = start_upstream_node();
    inside_one_window(60_000, 10_000);
    let value = format!("once-{}", now_ms());
    let first = call(&node, "basic", vec![descriptor(&[("one_per_minute", &value)])]).await;
    assert_eq!((first.overall_code(), first.statuses[0].limit_remaining), (Code::Ok, 0));
    let second = call(&node, "basic", vec![descriptor(&[("one_per_minute", &value)])]).await;
    assert_eq!(second.overall_code(), Code::OverLimit);
    for _ in 0..3 {
        let blocked = call(&node, "reload", vec![descriptor(&[("block", "anything")])]).await;
        assert_eq!(
            (blocked.overall_code(), blocked.statuses[0].limit_remaining),
            (Code::OverLimit, 0)
        );
    }
    let named = call(&node, "rl", vec![descriptor(&[("foo", "x"), ("bar", "bkthomps")])]).await;
    assert_eq!(named.statuses[0].current_limit.as_ref().expect("limit").name, "bkthomps");
    let unnamed = call(&node, "rl", vec![descriptor(&[("foo", "x"), ("bar", "other")])]).await;
    let limit = unnamed.statuses[0].current_limit.as_ref().expect("limit");
    assert_eq!((limit.name.as_str(), limit.requests_per_unit), ("", 3));
    // `detailed_metric` on a key-only rule: statistics per runtime value.
    call(&node, "rl", vec![descriptor(&[("unspec", "abc")])]).await;
    let metrics = node.metrics().expect("metrics");
    let detailed = "quotamesh_ratelimit_total_hits_total{domain=\"rl\",key=\"unspec_abc\"}";
    assert_eq!(metric_value(&metrics, detailed), 1.0, "{metrics}");
    // The merged domain serves both files' rules.
    let merged = call(&node, "test-domain", vec![descriptor(&[("key1", "value1")])]).await;
    assert_eq!(merged.statuses[0].limit_remaining, 9);
    let merged = call(&node, "test-domain", vec![descriptor(&[("key2", "value2")])]).await;
    assert_eq!(merged.statuses[0].limit_remaining, 19);
}

/// The example's quota-mode descriptors (service_1 at 1 and service_2 at 2 per minute, each
/// with `metadata`): the request passes while any of them passes, and the dynamic metadata
/// carries the metadata of the rules that passed; once all are over it is OVER_LIMIT.
#[tokio::test]
async fn quota_mode_and_metadata() {
    let (node, _directory) = start_upstream_node();
    inside_one_window(60_000, 10_000);
    let both =
        || vec![descriptor(&[("service", "service_1")]), descriptor(&[("service", "service_2")])];
    let name_in = |response: &RateLimitResponse| -> Option<String> {
        use prost_types::value::Kind;
        let metadata = response.dynamic_metadata.as_ref()?.fields.get("metadata")?;
        let Some(Kind::StructValue(metadata)) = &metadata.kind else { return None };
        let Some(Kind::StructValue(quota)) = &metadata.fields.get("service_with_quota")?.kind
        else {
            return None;
        };
        match &quota.fields.get("name")?.kind {
            Some(Kind::StringValue(name)) => Some(name.clone()),
            _ => None,
        }
    };
    let first = call(&node, "rl", both()).await;
    assert_eq!(first.overall_code(), Code::Ok);
    assert_eq!(name_in(&first).as_deref(), Some("service_1"), "the first rule's metadata wins");
    let domain = first.dynamic_metadata.as_ref().and_then(|metadata| metadata.fields.get("domain"));
    assert!(domain.is_some(), "upstream's shape: domain, descriptors, metadata");
    let second = call(&node, "rl", both()).await;
    assert_eq!(second.overall_code(), Code::Ok, "service_2 still has quota");
    assert_eq!((second.statuses[0].code(), second.statuses[1].code()), (Code::OverLimit, Code::Ok));
    assert_eq!(name_in(&second).as_deref(), Some("service_2"));
    let third = call(&node, "rl", both()).await;
    assert_eq!(third.overall_code(), Code::OverLimit, "every quota-mode descriptor is over");
    assert!(third.dynamic_metadata.is_none());
}
