//! Bad input to a 3-process region's admin API, and data directories a node must refuse.

use anyhow::{Context, Result};
use common::cluster::{Cluster, ClusterOptions, call, wanted};
use quotamesh::api::proto::quotamesh::admin::v1 as admin;
use quotamesh::core::ledger::{LEASE_REQUESTS_PER_COMMAND_MAX, LEASE_TOKENS_MAX};
use tonic::Code;

fn request(leases: Vec<admin::LeaseWanted>) -> admin::AcquireLeasesRequest {
    admin::AcquireLeasesRequest { leases, lease_ttl_ms: 0 }
}

fn entry(key: &str, value: &str) -> admin::DescriptorEntry {
    admin::DescriptorEntry { key: key.to_owned(), value: value.to_owned() }
}

// Proves that grant requests for unknown domains and rules, unlimited rules, malformed
// descriptors and keys, zero or absurd token counts and TTLs, oversized batches and messages,
// and bad membership calls each get a definite error that says what is wrong, on a follower
// and on the leader alike, and change nothing: digest and applied index stay as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_change_nothing() -> Result<()> {
    let cluster = Cluster::start(3, ClusterOptions::default()).await?;
    let leader = cluster.leader().await?;
    let follower = [1, 2, 3].into_iter().find(|id| *id != leader).context("a follower")?;
    cluster
        .admin(leader)
        .await?
        .acquire_leases(call(request(vec![wanted("api_key", "t30-good", 4)])))
        .await?;
    let before = cluster.converged(&[1, 2, 3]).await?;

    let long_value = "v".repeat(1_025); // Over the RLS path's 1 KiB per field.
    let mut nested = wanted("api_key", "x", 1);
    nested.entries.push(entry("api_key", "y"));
    let mut other_domain = wanted("api_key", "x", 1);
    other_domain.domain = "no-such-domain".to_owned();
    let mut no_entries = wanted("api_key", "x", 1);
    no_entries.entries.clear();
    let mut empty_domain = wanted("api_key", "x", 1);
    empty_domain.domain.clear();
    let mut one_bad_item: Vec<admin::LeaseWanted> =
        (0..63).map(|n| wanted("api_key", &format!("t30-batch-{n}"), 1)).collect();
    one_bad_item.push(wanted("api_key", "t30-batch-63", 0));
    let too_many: Vec<admin::LeaseWanted> = (0..=LEASE_REQUESTS_PER_COMMAND_MAX)
        .map(|n| wanted("api_key", &format!("t30-many-{n}"), 1))
        .collect();
    let huge_message: Vec<admin::LeaseWanted> = (0..LEASE_REQUESTS_PER_COMMAND_MAX)
        .map(|_| wanted("api_key", &"h".repeat(1200), 1))
        .collect();
    let mut long_ttl = request(vec![wanted("api_key", "x", 1)]);
    long_ttl.lease_ttl_ms = 3_600_000;

    let cases: Vec<(&str, admin::AcquireLeasesRequest, Code, String)> = vec![
        (
            "unknown domain",
            request(vec![other_domain]),
            Code::NotFound,
            "no policy for domain".into(),
        ),
        (
            "no rule for the descriptor",
            request(vec![wanted("nope", "x", 1)]),
            Code::NotFound,
            "no rule of domain".into(),
        ),
        (
            "no rule at that depth",
            request(vec![nested]),
            Code::NotFound,
            "no rule of domain".into(),
        ),
        (
            "unlimited rule",
            request(vec![wanted("free", "x", 1)]),
            Code::NotFound,
            "has no limit".into(),
        ),
        (
            "zero tokens",
            request(vec![wanted("api_key", "x", 0)]),
            Code::InvalidArgument,
            "tokens_wanted must be between 1".into(),
        ),
        (
            "absurd tokens",
            request(vec![wanted("api_key", "x", LEASE_TOKENS_MAX + 1)]),
            Code::InvalidArgument,
            "tokens_wanted must be between 1".into(),
        ),
        (
            "u64::MAX tokens",
            request(vec![wanted("api_key", "x", u64::MAX)]),
            Code::InvalidArgument,
            "tokens_wanted".into(),
        ),
        (
            "value too long",
            request(vec![wanted("api_key", &long_value, 1)]),
            Code::InvalidArgument,
            "at most 1024 bytes".into(),
        ),
        ("no entries", request(vec![no_entries]), Code::InvalidArgument, "1 to 16 entries".into()),
        (
            "empty entry key",
            request(vec![wanted("", "x", 1)]),
            Code::InvalidArgument,
            "key must not be empty".into(),
        ),
        (
            "empty domain",
            request(vec![empty_domain]),
            Code::InvalidArgument,
            "domain must be".into(),
        ),
        (
            "lease TTL too long",
            long_ttl,
            Code::InvalidArgument,
            "lease_ttl_ms must be at most".into(),
        ),
        ("no leases", request(Vec::new()), Code::InvalidArgument, "no leases requested".into()),
        (
            "one bad item in a batch",
            request(one_bad_item),
            Code::InvalidArgument,
            "item 63:".into(),
        ),
        (
            "batch over the command limit",
            request(too_many),
            Code::InvalidArgument,
            format!("at most {LEASE_REQUESTS_PER_COMMAND_MAX}"),
        ),
        (
            "message over the size limit",
            request(huge_message),
            Code::ResourceExhausted,
            "message length too large".into(),
        ),
    ];
    for id in [follower, leader] {
        let mut client = cluster.admin(id).await?;
        for (what, bad, code, fragment) in &cases {
            let status = client.acquire_leases(call(bad.clone())).await.expect_err(what);
            assert_eq!(status.code(), *code, "{what} on node {id}: {status:?}");
            assert!(
                status.message().contains(fragment.as_str()),
                "{what} on node {id}: {:?} lacks {fragment:?}",
                status.message()
            );
        }
        let keys = vec!["x".repeat(10); quotamesh::api::admin::READ_KEYS_MAX + 1];
        let status = client
            .read_keys(call(admin::ReadKeysRequest { keys, ..Default::default() }))
            .await
            .expect_err("read");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

        // Membership calls with bad arguments.
        let add = |node_id, raft_addr: &str| admin::AddNodeRequest {
            node_id,
            raft_addr: raft_addr.to_owned(),
            ..Default::default()
        };
        let status = client.add_node(call(add(0, "127.0.0.9:1"))).await.expect_err("id 0");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        let status = client.add_node(call(add(9, "no-port"))).await.expect_err("address");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("not host:port"), "{status:?}");
        let status = client
            .remove_node(call(admin::RemoveNodeRequest { node_id: 42, ..Default::default() }))
            .await
            .expect_err("not a member");
        assert_eq!(status.code(), Code::NotFound, "{status:?}");
        let billing = admin::RemoveNodeRequest { node_id: 42, group: admin::Group::Billing as i32 };
        let status = client.remove_node(call(billing)).await.expect_err("not a billing member");
        assert_eq!(status.code(), Code::NotFound, "{status:?}");
        assert!(status.message().contains("billing group"), "{status:?}");
        let unknown = admin::RemoveNodeRequest { node_id: 42, group: 7 };
        let status = client.remove_node(call(unknown)).await.expect_err("unknown group");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        let mut long_token = tonic::Request::new(admin::StatusRequest {});
        long_token
            .metadata_mut()
            .insert("authorization", format!("Bearer {}", "t".repeat(60 * 1024)).parse()?);
        let status = client.status(long_token).await.expect_err("60 KiB token");
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("request metadata is"), "{status:?}");
        let status = client.init(call(admin::InitRequest {})).await.expect_err("formed already");
        assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    }
    // A membership change sent to a follower names the leader.
    let status = cluster
        .admin(follower)
        .await?
        .remove_node(call(admin::RemoveNodeRequest { node_id: follower, ..Default::default() }))
        .await
        .expect_err("not the leader");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains(&format!("node {leader} is")), "{status:?}");

    let after = cluster.converged(&[1, 2, 3]).await?;
    assert_eq!(after[0].state_digest, before[0].state_digest, "bad input changed the ledger");
    assert_eq!(after[0].applied_index, before[0].applied_index, "bad input was proposed");
    assert_eq!(after[0].ledger_keys, 1);
    Ok(())
}

// Proves that a node refuses, with a message naming the problem, a data directory of another
// cluster, of another node id, with a corrupt identity file, with a corrupt Raft log, or
// with Raft state but no identity; and that after those refusals the untouched directory
// still starts with the state it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_a_data_directory_that_is_not_its_own() -> Result<()> {
    let mut cluster = Cluster::start(1, ClusterOptions::default()).await?;
    cluster
        .admin(1)
        .await?
        .acquire_leases(call(request(vec![wanted("api_key", "t30-own", 4)])))
        .await?;
    let before = cluster.status(1).await?;
    cluster.node(1).stop()?;
    let node = &cluster.nodes[&1];
    let refusal = |extra: &[&str]| -> String {
        match node.spawn(extra) {
            Ok(_) => panic!("node started with {extra:?}"),
            Err(error) => format!("{error:#}"),
        }
    };

    let error = refusal(&["--cluster-id", "another-region"]);
    assert!(error.contains("belongs to cluster \"test-region\""), "{error}");
    assert!(error.contains("\"another-region\""), "{error}");

    let peers = format!("2={}", node.raft_addr);
    let error = refusal(&["--raft-node-id", "2", "--peers", &peers]);
    assert!(
        error.contains("belongs to Raft node 1") && error.contains("as Raft node 2"),
        "{error}"
    );

    let identity_path = node.data_dir.join(quotamesh::identity::IDENTITY_FILE_NAME);
    let identity = std::fs::read(&identity_path)?;
    std::fs::write(&identity_path, b"{\"format\": 1, \"cluster_id\": ")?;
    let error = refusal(&[]);
    assert!(error.contains("data directory is corrupt"), "{error}");

    std::fs::remove_file(&identity_path)?;
    let error = refusal(&[]);
    assert!(error.contains("no identity.json"), "{error}");
    std::fs::write(&identity_path, &identity)?;

    let log_path = node.data_dir.join("quota").join("raft-log.redb");
    let log = std::fs::read(&log_path)?;
    std::fs::write(&log_path, vec![0x5a; 4096])?;
    let error = refusal(&[]);
    assert!(error.contains("cannot open the Raft log"), "{error}");
    std::fs::write(&log_path, &log)?;

    // Nothing above touched the state: the node comes back as it was.
    cluster.node(1).start()?;
    let after = cluster.converged(&[1]).await?;
    assert_eq!(after[0].state_digest, before.state_digest);
    assert_eq!(after[0].ledger_keys, 1);
    Ok(())
}
