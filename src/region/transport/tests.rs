//! The region link over real QUIC on loopback: mutual TLS under one cluster CA, a credit
//! applied once however often it is sent, a region that speaks for another refused,
//! strangers refused, and a peer that is down failing calls at once after its first timeout
//! or its first failed call.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::core::ledger::NodeId;
use crate::core::region::transfer::{
    Received, RegionCommand, RegionLedger, RegionResponse, Slice, SliceKey, TransferId,
    TransferRequest,
};
use crate::tls::authority::Authority;
use crate::tls::credentials::TlsFiles;

/// Credentials of a voter of `region`, issued by `authority`, written under `directory`.
fn credentials(
    directory: &std::path::Path,
    authority: &Authority,
    region: &str,
) -> anyhow::Result<Arc<Credentials>> {
    let files = TlsFiles {
        cert: directory.join(format!("{region}.pem")),
        key: directory.join(format!("{region}.key")),
        ca: directory.join(format!("{region}-ca.pem")),
    };
    let issued = authority.issue_node(
        region,
        NodeId(1),
        &["127.0.0.1".to_owned()],
        crate::clock::now_ms(),
        1,
    )?;
    std::fs::write(&files.cert, &issued.cert_pem)?;
    std::fs::write(&files.key, &issued.key_pem)?;
    std::fs::write(&files.ca, authority.cert_pem())?;
    Ok(Credentials::load(files, authority.cluster_id(), NodeId(1), false)?)
}

fn peer(name: &str, quic_addr: SocketAddr) -> RegionPeer {
    RegionPeer { name: name.to_owned(), quic_addr }
}

/// A handler applying requests to an in-memory region ledger, as the rebalancer applies them
/// through its Raft group.
fn ledger_handler(ledger: Arc<Mutex<RegionLedger>>) -> Handler {
    Arc::new(move |_region, request| {
        let RegionRequest::Transfer(request) = request else {
            let reply = RegionReply::Views { views: Vec::new(), more: false };
            return Box::pin(async move { reply });
        };
        let command = RegionCommand::Receive(request);
        let response = ledger.lock().expect("not poisoned").apply(&command, 0);
        let reply = match response {
            RegionResponse::Received(outcome) => RegionReply::Received(outcome),
            RegionResponse::AlreadySettled => RegionReply::AlreadySettled,
            other => RegionReply::refused(format!("{other:?}"), false),
        };
        Box::pin(async move { reply })
    })
}

#[tokio::test]
async fn regions_credit_over_mutual_tls_and_refuse_strangers() -> anyhow::Result<()> {
    crate::tls::install_crypto_provider();
    let directory = tempfile::tempdir()?;
    let authority = Authority::generate("c", crate::clock::now_ms(), 1)?;
    let loopback: SocketAddr = "127.0.0.1:0".parse()?;
    let unused: SocketAddr = "127.0.0.1:9".parse()?;

    // Region b holds a slice of 40 of a global 100 and accepts region a only.
    let key = SliceKey::of("d", "k", 0);
    let ledger = Arc::new(Mutex::new(RegionLedger::default()));
    let adopt =
        RegionCommand::Adopt { key: key.clone(), slice: Slice { global_tokens: 100, tokens: 40 } };
    assert_eq!(ledger.lock().expect("not poisoned").apply(&adopt, 0), RegionResponse::Adopted);
    let b = RegionEndpoint::bind(
        loopback,
        &credentials(directory.path(), &authority, "b")?,
        "b",
        &[peer("a", unused)],
    )?;
    let server = b.serve(ledger_handler(Arc::clone(&ledger)));
    let b_addr = b.local_addr()?;

    let a = RegionEndpoint::bind(
        loopback,
        &credentials(directory.path(), &authority, "a")?,
        "a",
        &[peer("b", b_addr)],
    )?;
    let id = TransferId { donor: "a".to_owned(), serial: 1 };
    let credit = RegionRequest::Transfer(TransferRequest::Credit {
        id: id.clone(),
        key: key.clone(),
        tokens: 25,
        global_tokens: 100,
        settled_below: 1,
    });
    for _ in 0..3 {
        assert_eq!(a.call("b", &credit).await?, RegionReply::Received(Received::Credited));
    }
    assert_eq!(
        ledger.lock().expect("not poisoned").slice(&key).map(|slice| slice.tokens),
        Some(65),
        "credited once"
    );
    let link = a.link("b").expect("a configured peer");
    assert!(link.is_connected().await && link.rtt().await.is_some());

    // A region speaks only for its own transfers.
    let spoofed = RegionRequest::Transfer(TransferRequest::Cancel {
        id: TransferId { donor: "x".to_owned(), serial: 1 },
        settled_below: 1,
    });
    assert!(matches!(a.call("b", &spoofed).await?, RegionReply::Refused { retry: false, .. }));

    // A voter of a region b does not list, and one of another cluster's CA, are refused.
    let stranger = RegionEndpoint::bind(
        loopback,
        &credentials(directory.path(), &authority, "s")?,
        "s",
        &[peer("b", b_addr)],
    )?;
    let request = RegionRequest::Transfer(TransferRequest::Cancel {
        id: TransferId { donor: "s".to_owned(), serial: 1 },
        settled_below: 1,
    });
    assert!(stranger.call("b", &request).await.is_err(), "a region b does not list");
    let other_authority = Authority::generate("c", crate::clock::now_ms(), 1)?;
    let other_directory = tempfile::tempdir()?;
    let forger = RegionEndpoint::bind(
        loopback,
        &credentials(other_directory.path(), &other_authority, "a")?,
        "a",
        &[peer("b", b_addr)],
    )?;
    assert!(forger.call("b", &credit).await.is_err(), "a certificate of another CA");
    assert_eq!(
        ledger.lock().expect("not poisoned").slice(&key).map(|slice| slice.tokens),
        Some(65)
    );

    // A peer that is down: the first call gives up within the connect timeout, the next
    // fails at once while the link backs off.
    let silent = std::net::UdpSocket::bind(loopback)?;
    let lonely = RegionEndpoint::bind(
        loopback,
        &credentials(directory.path(), &authority, "a")?,
        "a",
        &[peer("z", silent.local_addr()?)],
    )?;
    let request = RegionRequest::Transfer(TransferRequest::Cancel {
        id: TransferId { donor: "a".to_owned(), serial: 1 },
        settled_below: 1,
    });
    let started = Instant::now();
    assert!(matches!(lonely.call("z", &request).await, Err(CallError::Connect { .. })));
    assert!(started.elapsed() < CONNECT_TIMEOUT + Duration::from_secs(1));
    let started = Instant::now();
    assert!(matches!(lonely.call("z", &request).await, Err(CallError::BackingOff { .. })));
    assert!(started.elapsed() < Duration::from_millis(100), "no wait while backing off");
    assert!(matches!(lonely.call("y", &request).await, Err(CallError::UnknownRegion(_))));

    // A peer gone while its connection was open: the failed call backs off too, so the
    // next call fails at once instead of waiting out a connect (or a call) timeout.
    b.close();
    // (The close may reach a's link before the call, which then fails to reconnect.)
    assert!(matches!(
        a.call("b", &credit).await,
        Err(CallError::Exchange { .. } | CallError::Connect { .. })
    ));
    let started = Instant::now();
    assert!(matches!(a.call("b", &credit).await, Err(CallError::BackingOff { .. })));
    assert!(started.elapsed() < Duration::from_millis(100), "no wait after a failed call");

    for endpoint in [&a, &b, &stranger, &forger, &lonely] {
        endpoint.close();
    }
    server.abort();
    Ok(())
}
