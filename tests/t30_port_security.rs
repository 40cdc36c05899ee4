//! Forged calls on a region's Raft, admin and QUIC (region) ports, as an attacker on the
//! network, a holder of another CA's certificate and a node speaking for another would send
//! them: each is refused and nothing changes (equal digests, terms and leader before and
//! after; the region's slice). Real node processes, real mTLS and QUIC; the forged requests
//! are built with openraft's own types and the region link's own endpoint.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use common::cluster::{Cluster, ClusterOptions, call, ledger_key, wanted};
use common::tls::TestCa;
use quotamesh::api::proto::quotamesh::admin::v1 as admin;
use quotamesh::core::ledger::{LeaseRequest, QuotaCommand};
use quotamesh::core::region::transfer::{SliceKey, TransferId, TransferRequest};
use quotamesh::ledger::proto::GroupRequest;
use quotamesh::ledger::proto::raft_peer_client::RaftPeerClient;
use quotamesh::ledger::{NodeId, QuotaGroup};
use quotamesh::region::RegionPeer;
use quotamesh::region::transport::RegionEndpoint;
use quotamesh::region::wire::{RegionReply, RegionRequest};
use quotamesh::tls::credentials::{Credentials, TlsFiles};
use quotamesh::tls::transport::{PeerConnector, client_config};
use tonic::transport::{Channel, Endpoint};

/// What every node shows of its state: digest, term, leader, applied index.
async fn snapshot(cluster: &Cluster) -> Result<Vec<(u64, u64, Option<u64>, Option<u64>)>> {
    let mut views = Vec::new();
    for id in [1, 2, 3] {
        let status = cluster.status(id).await?;
        let applied = status.applied_index;
        views.push((status.state_digest, status.term, status.leader_id, applied));
    }
    Ok(views)
}

/// A Raft peer client dialling `address` with `config`.
fn peer_client(
    config: Arc<rustls::ClientConfig>,
    address: &str,
) -> Result<RaftPeerClient<Channel>> {
    let endpoint = Endpoint::from_shared(format!("http://{address}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5));
    let channel =
        endpoint.connect_with_connector_lazy(PeerConnector::new(config, Duration::from_secs(10)));
    Ok(RaftPeerClient::new(channel))
}

/// A client configuration presenting node `id`'s certificate (a gateway's when `gateway`)
/// issued by `issuer`, trusting the CAs in `bundle` (written next to the certificate).
fn credentials_of(
    directory: &Path,
    issuer: &TestCa,
    (id, gateway): (u64, bool),
    bundle: &[&TestCa],
    cluster_id: &str,
) -> Result<Arc<rustls::ClientConfig>> {
    let name = format!("forger-{id}-{gateway}-{}", bundle.len());
    let issued = if gateway {
        issuer.issue_gateway(id, "127.0.0.1")?
    } else {
        issuer.issue(id, "127.0.0.1")?
    };
    let (cert, key) = issuer.write(&name, &issued)?;
    let ca = directory.join(format!("{name}-bundle.pem"));
    let text: String = bundle.iter().map(|ca| ca.authority.cert_pem().to_owned()).collect();
    std::fs::write(&ca, text)?;
    let credentials =
        Credentials::load(TlsFiles { cert, key, ca }, cluster_id, NodeId(id), gateway)?;
    Ok(client_config(&credentials))
}

/// A client configuration that trusts the cluster's CA but presents no certificate.
fn anonymous(ca: &TestCa) -> Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = ca.authority.cert_pem().as_bytes().to_vec();
    for certificate in rustls::pki_types::pem::PemObject::pem_slice_iter(pem.as_slice()) {
        roots.add(certificate?)?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

fn request(group: &str, payload: Vec<u8>) -> tonic::Request<GroupRequest> {
    tonic::Request::new(GroupRequest { group: group.to_owned(), payload })
}

/// A forged Forward: leases on `key` for node `holder`, or (for a gateway speaking for
/// itself, which may lease for itself) a new policy set, which only a voter may propose.
fn forged_forward(holder: u64, key: &str, own: bool) -> Result<Vec<u8>> {
    if own {
        let command = QuotaCommand::ApplyPolicySet {
            now_ms: quotamesh::clock::now_ms(),
            files: vec![("forged.yaml".to_owned(), "domain: forged\n".to_owned())],
            digest: 1_000,
            author: quotamesh::core::ledger::PolicyAuthor {
                applied_by: "forger".to_owned(),
                message: String::new(),
            },
        };
        return forwarded(holder, command);
    }
    let command = QuotaCommand::AcquireLeases {
        now_ms: quotamesh::clock::now_ms(),
        node_id: NodeId(holder),
        requests: vec![LeaseRequest {
            key: key.to_owned(),
            limit: quotamesh::core::rate::LimitSpec {
                algorithm: quotamesh::core::rate::Algorithm::TokenBucket,
                requests_per_window: 1_000_000,
                window_ms: 86_400_000,
                burst_tokens: 1_000_000,
            },
            tokens_wanted: 1000,
            lease_ttl_ms: 60_000,
        }],
    };
    forwarded(holder, command)
}

/// A `Forward` payload that says it comes from node `from`.
fn forwarded(from: u64, command: QuotaCommand) -> Result<Vec<u8>> {
    let forwarded = quotamesh::ledger::ledger_time::Forwarded {
        from: NodeId(from),
        sent_at_ms: quotamesh::clock::now_ms(),
        command,
    };
    Ok(postcard::to_allocvec(&forwarded)?)
}

/// A forged AppendEntries from `leader` in `term`: no entries, but a higher term would
/// depose the real leader if it were accepted.
fn forged_append(leader: u64, term: u64) -> Result<Vec<u8>> {
    let request = openraft::raft::AppendEntriesRequest::<QuotaGroup> {
        vote: openraft::Vote::new_committed(term, NodeId(leader)),
        prev_log_id: None,
        entries: Vec::new(),
        leader_commit: None,
    };
    Ok(postcard::to_allocvec(&request)?)
}

/// A forged Vote for `candidate` in `term`.
fn forged_vote(candidate: u64, term: u64) -> Result<Vec<u8>> {
    let request = openraft::raft::VoteRequest {
        vote: openraft::Vote::new(term, NodeId(candidate)),
        last_log_id: None,
    };
    Ok(postcard::to_allocvec(&request)?)
}

/// Sends the three forged calls through `client`; returns the codes they got (a transport
/// failure, such as a refused handshake, counts as `Unavailable`).
async fn forge_all(
    client: &mut RaftPeerClient<Channel>,
    claimed: u64,
    own: bool,
    key: &str,
    term: u64,
) -> Result<Vec<tonic::Code>> {
    let mut codes = Vec::new();
    let forward = client.forward(request("quota", forged_forward(claimed, key, own)?)).await;
    let append = client.append_entries(request("quota", forged_append(claimed, term)?)).await;
    let vote = client.vote(request("quota", forged_vote(claimed, term)?)).await;
    for result in [forward, append, vote] {
        codes.push(match result {
            Ok(_) => tonic::Code::Ok,
            Err(status) => status.code(),
        });
    }
    Ok(codes)
}

// Proves that on a region with mTLS on (the default for several nodes), Forward,
// AppendEntries and Vote are refused when sent without a certificate, with a certificate of
// another CA, with a valid certificate claiming another node id, and from a gateway's
// certificate (which may lease for itself only); and that none of them changes any node's
// digest, term, leader or log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_raft_calls_are_refused_and_change_nothing() -> Result<()> {
    let cluster = Cluster::start(3, ClusterOptions::default()).await?;
    let leader = cluster.leader().await?;
    let follower = [1, 2, 3].into_iter().find(|id| *id != leader).context("a follower")?;
    // The region serves over mTLS: a grant through a follower is forwarded to the leader.
    let reply = cluster
        .admin(follower)
        .await?
        .acquire_leases(call(admin::AcquireLeasesRequest {
            leases: vec![wanted("api_key", "legit", 5)],
            lease_ttl_ms: 60_000,
        }))
        .await?
        .into_inner();
    assert_eq!(reply.results[0].granted_tokens, 5, "{reply:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = snapshot(&cluster).await?;
    let term = before.iter().map(|view| view.1).max().unwrap_or(0) + 5;

    let directory = cluster.root.path();
    let other_ca = TestCa::new(&directory.join("other"), &cluster.options.cluster_id)?;
    let cluster_id = cluster.options.cluster_id.clone();
    // (who, client configuration, the node id the messages claim, whether the handshake
    // passes so that the service itself must refuse).
    let attackers: Vec<(&str, Arc<rustls::ClientConfig>, u64, bool)> = vec![
        ("no certificate", anonymous(&cluster.ca)?, leader, false),
        (
            "another CA's certificate",
            credentials_of(
                directory,
                &other_ca,
                (leader, false),
                &[&cluster.ca, &other_ca],
                &cluster_id,
            )?,
            leader,
            false,
        ),
        (
            "a non-member's certificate claiming the leader",
            credentials_of(directory, &cluster.ca, (9, false), &[&cluster.ca], &cluster_id)?,
            leader,
            true,
        ),
        (
            "a gateway speaking for itself",
            credentials_of(directory, &cluster.ca, (9, true), &[&cluster.ca], &cluster_id)?,
            9,
            true,
        ),
        (
            "a gateway claiming the leader",
            credentials_of(directory, &cluster.ca, (9, true), &[&cluster.ca], &cluster_id)?,
            leader,
            true,
        ),
        (
            "a member's certificate claiming another member",
            credentials_of(directory, &cluster.ca, (follower, false), &[&cluster.ca], &cluster_id)?,
            leader,
            true,
        ),
    ];
    let mut refused = 0;
    for (who, config, claimed, verified) in attackers {
        for target in [1, 2, 3] {
            let address = cluster.nodes[&target].raft_addr.to_string();
            let mut client = peer_client(Arc::clone(&config), &address)?;
            let key = ledger_key("api_key", &format!("forged-{target}"));
            let own = who.contains("itself");
            let codes = forge_all(&mut client, claimed, own, &key, term).await?;
            for code in &codes {
                // A refused handshake ends the call as a transport failure; a verified peer
                // is refused by the service, before anything reaches Raft.
                let expected = if verified {
                    *code == tonic::Code::PermissionDenied
                } else {
                    matches!(
                        code,
                        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
                    )
                };
                assert!(expected, "{who} to node {target}: {codes:?}");
                refused += 1;
            }
        }
    }
    assert_eq!(refused, 6 * 3 * 3);
    // A plaintext connection to the TLS port gets nowhere either.
    let plain = Endpoint::from_shared(format!("http://{}", cluster.nodes[&leader].raft_addr))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect_lazy();
    let result = RaftPeerClient::new(plain)
        .forward(request("quota", forged_forward(leader, "rl:plain", false)?))
        .await;
    assert!(result.is_err(), "a plaintext Forward was served: {result:?}");

    let after = snapshot(&cluster).await?;
    assert_eq!(after, before, "a forged call changed a node's state, term, leader or log");
    let keys = (1..=3).map(|target| ledger_key("api_key", &format!("forged-{target}"))).collect();
    let read = cluster
        .admin(leader)
        .await?
        .read_keys(call(admin::ReadKeysRequest { keys, ..Default::default() }))
        .await?;
    assert!(
        read.get_ref().entries.iter().all(|entry| entry.leases.is_empty()),
        "a forged grant was applied: {:?}",
        read.get_ref()
    );
    Ok(())
}

/// An admin request carrying `token` (none: no `authorization` at all).
fn with_token<T>(token: Option<&str>, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(Duration::from_secs(5));
    if let Some(token) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().expect("ascii"));
    }
    request
}

// Proves that the admin API refuses calls without a token and with a wrong one as
// UNAUTHENTICATED, reads included, and that a refused change changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_need_the_operator_token() -> Result<()> {
    let cluster = Cluster::start(3, ClusterOptions::default()).await?;
    let leader = cluster.leader().await?;
    let before = snapshot(&cluster).await?;
    for token in [None, Some("wrong-token")] {
        let mut client = cluster.admin(leader).await?;
        let grant = client
            .acquire_leases(with_token(
                token,
                admin::AcquireLeasesRequest {
                    leases: vec![wanted("api_key", "no-token", 5)],
                    lease_ttl_ms: 60_000,
                },
            ))
            .await
            .expect_err("a grant without the token");
        assert_eq!(grant.code(), tonic::Code::Unauthenticated, "{grant:?}");
        let remove = client
            .remove_node(with_token(
                token,
                admin::RemoveNodeRequest { node_id: 3, ..Default::default() },
            ))
            .await
            .expect_err("a removal without the token");
        assert_eq!(remove.code(), tonic::Code::Unauthenticated, "{remove:?}");
        let status =
            client.status(with_token(token, admin::StatusRequest {})).await.expect_err("status");
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    }
    // The CLI without QUOTAMESH_ADMIN_TOKEN is refused the same way.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_quotamesh"))
        .args(["cluster", "remove-node", "--node-id", "3", "--admin-addr"])
        .arg(cluster.nodes[&leader].admin_addr.to_string())
        .env_remove("QUOTAMESH_ADMIN_TOKEN")
        .output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("Unauthenticated"), "{stderr}");
    assert_eq!(snapshot(&cluster).await?, before, "a refused admin call changed something");
    assert_eq!(cluster.voters(leader).await?.len(), 3);
    Ok(())
}

// Proves that with `admin.tls` the admin port speaks TLS only, and that an operator
// certificate of the cluster's CA authenticates a caller without a token, a node's
// certificate does not, and a token still does without any client certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_certificates_authenticate_on_a_tls_admin_port() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let root = scratch.path();
    let ca = TestCa::new(root, "local")?;
    let policy = common::write_file(root, "policy.yaml", common::cluster::CLUSTER_POLICY);
    let operator = ca.authority.issue_operator("alice", quotamesh::clock::now_ms(), 1)?;
    let (operator_cert, operator_key) = ca.write("operator-alice", &operator)?;
    let (node_cert, node_key) = ca.write("node-7", &ca.issue(7, "127.0.0.1")?)?;
    let config = root.join("node.toml");
    std::fs::write(
        &config,
        format!(
            "{}\n[admin]\ntls = true\n{}",
            ca.node_section(1, "127.0.0.1", false)?,
            common::tls::admin_section()
        ),
    )?;
    let admin_addr = format!("127.0.0.1:{}", common::free_port());
    let config_flag = config.display().to_string();
    let _node = common::NodeProcess::start_with(
        &policy,
        &root.join("data"),
        &["--config", &config_flag, "--admin-addr", &admin_addr],
    )?;
    let status = |extra: &[&Path], token: Option<&str>| -> Result<(bool, String)> {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_quotamesh"));
        command.args(["cluster", "status", "--admin-addr", &admin_addr]);
        command.env_remove("QUOTAMESH_ADMIN_TOKEN");
        if let Some(token) = token {
            command.env("QUOTAMESH_ADMIN_TOKEN", token);
        }
        if let [ca_cert, rest @ ..] = extra {
            command.arg("--ca-cert").arg(ca_cert);
            if let [cert, key] = rest {
                command.arg("--client-cert").arg(cert).arg("--client-key").arg(key);
            }
        }
        let output = command.output()?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        Ok((output.status.success(), text))
    };
    let bundle = ca.bundle();
    let (served, text) = status(&[&bundle, &operator_cert, &operator_key], None)?;
    assert!(served, "an operator certificate was refused: {text}");
    let (served, text) = status(&[&bundle, &node_cert, &node_key], None)?;
    assert!(!served && text.contains("Unauthenticated"), "a node certificate served: {text}");
    let (served, text) = status(&[&bundle], Some(common::tls::ADMIN_TOKEN))?;
    assert!(served, "a token without a client certificate was refused: {text}");
    let (served, text) = status(&[], Some(common::tls::ADMIN_TOKEN))?;
    assert!(!served, "plaintext reached a TLS admin port: {text}");
    Ok(())
}

/// A region of one voter, east, slicing a global limit 50/50 with west.
const SLICED_POLICY: &str = "\
domain: port-security
descriptors:
  - key: global
    rate_limit: {unit: second, requests_per_unit: 100}
    regions: {east: 50%, west: 50%}
";
/// The gauges of east's slice of [`SLICED_POLICY`]'s limit and of its tokens in flight.
const EAST_SLICE: &str =
    "quotamesh_region_slice_tokens{region=\"east\",rule=\"port-security/global#0\"}";
const EAST_IN_FLIGHT: &str = "quotamesh_region_in_flight_tokens{rule=\"port-security/global#0\"}";
const REFUSED: &str = "quotamesh_region_connections_refused_total";

/// A QUIC endpoint of region `region` dialling east at `east`, with a certificate of node 7
/// (a gateway's when `gateway`) issued by `issuer`, trusting the cluster's CA and `issuer`
/// (so that a refusal is east's, not the endpoint's own).
fn region_endpoint(
    cluster: &Cluster,
    issuer: &TestCa,
    (region, gateway): (&str, bool),
    east: std::net::SocketAddr,
) -> Result<RegionEndpoint> {
    let hosts = ["127.0.0.1".to_owned()];
    let now_ms = quotamesh::clock::now_ms();
    let issued = if gateway {
        issuer.authority.issue_gateway(region, NodeId(7), &hosts, now_ms, 1)?
    } else {
        issuer.authority.issue_node(region, NodeId(7), &hosts, now_ms, 1)?
    };
    let name = format!("region-{region}-{gateway}");
    let (cert, key) = issuer.write(&name, &issued)?;
    let ca = issuer.directory.join(format!("{name}-bundle.pem"));
    let bundle = [cluster.ca.authority.cert_pem(), issuer.authority.cert_pem()].concat();
    std::fs::write(&ca, bundle)?;
    let credentials = Arc::new(Credentials::load(
        TlsFiles { cert, key, ca },
        &cluster.options.cluster_id,
        NodeId(7),
        gateway,
    )?);
    let peers = [RegionPeer { name: "east".to_owned(), quic_addr: east }];
    Ok(RegionEndpoint::bind("127.0.0.1:0".parse()?, &credentials, region, &peers)?)
}

// Proves that a region's QUIC port, where the other regions' rebalancers call, refuses a
// peer presenting a certificate of another CA (naming the peer region), a certificate of
// the cluster's CA naming a region that is not a peer, and a gateway's certificate of the
// peer region: each call fails, the node counts each refused connection, and its slice is
// unchanged by the credit they sent; a voter of the peer region is served on the same port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_region_port_refuses_other_cas_strangers_and_gateways() -> Result<()> {
    let quic: std::net::SocketAddr =
        format!("127.0.0.1:{}", common::free_port_on("127.0.0.1")?).parse()?;
    // West is named but never runs: the node's own calls to it fail, so every connection
    // east sees is one of this test's.
    let west: std::net::SocketAddr =
        format!("127.0.0.1:{}", common::free_port_on("127.0.0.1")?).parse()?;
    let options = ClusterOptions {
        policy: Some(SLICED_POLICY.to_owned()),
        region: Some("east".to_owned()),
        config_extra: format!("[[regions]]\nname = \"west\"\nquic_addr = \"{west}\"\n"),
        node_environment: [(1, vec![("QUOTAMESH_QUIC_ADDR", quic.to_string())])].into(),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(1, options).await?;
    let node = cluster.nodes[&1].process.as_ref().context("running")?;
    let gauges = || -> Result<(f64, f64, f64)> {
        let metrics = node.metrics()?;
        Ok((
            common::metric_value(&metrics, EAST_SLICE),
            common::metric_value(&metrics, EAST_IN_FLIGHT),
            common::metric_value(&metrics, REFUSED),
        ))
    };
    let started = std::time::Instant::now();
    while gauges()?.0 != 50.0 {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(30), "no slice: {:?}", gauges()?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let other_ca = TestCa::new(&cluster.root.path().join("other"), &cluster.options.cluster_id)?;
    let credit = RegionRequest::Transfer(TransferRequest::Credit {
        id: TransferId { donor: "west".to_owned(), serial: 1 },
        key: SliceKey::of("port-security", "global", 0),
        tokens: 50,
        global_tokens: 100,
        settled_below: 1,
    });
    let refused_peers = [
        ("another CA's certificate naming the peer region", &other_ca, ("west", false)),
        ("a certificate naming a region that is not a peer", &cluster.ca, ("north", false)),
        ("a gateway's certificate of the peer region", &cluster.ca, ("west", true)),
    ];
    for (who, issuer, holder) in refused_peers {
        let endpoint = region_endpoint(&cluster, issuer, holder, quic)?;
        let reply = endpoint.call("east", &credit).await;
        assert!(reply.is_err(), "{who}: {reply:?}");
        endpoint.close();
    }
    // The control: a voter of west, on the same port, reads east's views.
    let endpoint = region_endpoint(&cluster, &cluster.ca, ("west", false), quic)?;
    let reply = endpoint.call("east", &RegionRequest::Views { after: None }).await?;
    assert!(
        matches!(&reply, RegionReply::Views { views, .. } if views.len() == 1 && views[0].view.slice_tokens == 50),
        "a peer region's voter was not served: {reply:?}"
    );
    endpoint.close();

    // The counter is exported each rebalancer interval (1 s).
    let started = std::time::Instant::now();
    while gauges()?.2 < 3.0 {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(10),
            "refused connections not counted: {:?}",
            gauges()?
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (slice, in_flight, refused) = gauges()?;
    assert_eq!((slice, in_flight), (50.0, 0.0), "a refused peer's credit changed the slice");
    eprintln!("east refused {refused} QUIC connections");
    Ok(())
}
