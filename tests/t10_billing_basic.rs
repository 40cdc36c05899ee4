//! The billing API on a real node: operations with replies, replays, holds (expiry, void,
//! capture racing void), the CLI (operations, audit, verify), and mTLS on the billing port.

use std::process::Command;
use std::time::Duration;

use common::billing::{
    ADMIN_TOKEN, BillingCluster, account, balance, full_trail, open_account, with_token,
};
use quotamesh::api::proto::quotamesh::billing::v1 as pb;
use quotamesh::core::billing::{OperationKind, verify_trail};

fn debit(tenant: &str, amount: u64, key: &str) -> pb::DebitRequest {
    pb::DebitRequest {
        account: Some(account(tenant, "api")),
        amount,
        idempotency_key: key.to_owned(),
    }
}

/// A debit is approved with the balance after and its index; a retry with the same key is
/// DUPLICATE with the original index and balance; a debit beyond `available` is
/// INSUFFICIENT_FUNDS; the trail holds each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debit_replay_and_insufficient_funds() -> anyhow::Result<()> {
    let cluster = BillingCluster::start(1, "")?;
    cluster.wait_for_leader(0).await?;
    let mut client = cluster.client(0).await?;
    open_account(&mut client, "t1", "api", 10, 100).await?;

    let first = client.debit(with_token(debit("t1", 60, "d1"), ADMIN_TOKEN)).await?.into_inner();
    assert_eq!(first.decision(), pb::Decision::Approved);
    assert_eq!((first.balance, first.available), (40, 30));
    let again = client.debit(with_token(debit("t1", 60, "d1"), ADMIN_TOKEN)).await?.into_inner();
    assert_eq!(again.decision(), pb::Decision::Duplicate);
    assert_eq!(again.original_decision(), pb::Decision::Approved);
    assert_eq!((again.ledger_index, again.balance), (first.ledger_index, 40));
    let refused = client.debit(with_token(debit("t1", 31, "d2"), ADMIN_TOKEN)).await?.into_inner();
    assert_eq!(refused.decision(), pb::Decision::InsufficientFunds);
    let reused = client.debit(with_token(debit("t1", 61, "d1"), ADMIN_TOKEN)).await;
    assert_eq!(reused.map(|_| ()).map_err(|s| s.code()), Err(tonic::Code::FailedPrecondition));

    let trail = full_trail(&mut client).await?;
    assert_eq!(trail.iter().filter(|e| e.kind == OperationKind::Debit).count(), 2);
    verify_trail(&trail)?;
    assert_eq!(balance(&mut client, "t1", "api").await?.balance, 40);
    Ok(())
}

fn reserve(amount: u64, ttl_ms: u64, key: &str) -> pb::ReserveRequest {
    pb::ReserveRequest {
        account: Some(account("t1", "api")),
        amount,
        ttl_ms,
        idempotency_key: key.to_owned(),
    }
}

/// Holds: a capture after expiry fails and the hold's amount is available again; a void
/// releases; capture and void of one hold sent at once: exactly one wins, every time, and
/// the trail has exactly one terminal entry per hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_expire_void_and_race() -> anyhow::Result<()> {
    let cluster = BillingCluster::start(1, "")?;
    cluster.wait_for_leader(0).await?;
    let mut client = cluster.client(0).await?;
    open_account(&mut client, "t1", "api", 0, 1000).await?;

    // Expiry: a 200 ms hold, captured after 400 ms.
    let hold = client.reserve(with_token(reserve(600, 200, "r-exp"), ADMIN_TOKEN)).await?;
    let hold = hold.into_inner().hold_id.expect("hold id");
    assert_eq!(balance(&mut client, "t1", "api").await?.available, 400);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let capture = pb::CaptureRequest {
        account: Some(account("t1", "api")),
        hold_id: hold,
        amount: 100,
        idempotency_key: "c-exp".to_owned(),
    };
    let late = client.capture(with_token(capture, ADMIN_TOKEN)).await;
    assert_eq!(late.map(|_| ()).map_err(|s| s.code()), Err(tonic::Code::FailedPrecondition));
    let after = balance(&mut client, "t1", "api").await?;
    assert_eq!((after.balance, after.held, after.available), (1000, 0, 1000));

    // Void releases.
    let hold = client.reserve(with_token(reserve(300, 60_000, "r-void"), ADMIN_TOKEN)).await?;
    let hold = hold.into_inner().hold_id.expect("hold id");
    let void = pb::VoidRequest {
        account: Some(account("t1", "api")),
        hold_id: hold,
        idempotency_key: "v-void".to_owned(),
    };
    let voided = client.void(with_token(void, ADMIN_TOKEN)).await?.into_inner();
    assert_eq!((voided.balance, voided.held), (1000, 0));

    // Capture racing void.
    let mut winners = Vec::new();
    for round in 0..20 {
        let hold = client
            .reserve(with_token(reserve(10, 60_000, &format!("r-race-{round}")), ADMIN_TOKEN))
            .await?
            .into_inner()
            .hold_id
            .expect("hold id");
        let (mut a, mut b) = (client.clone(), client.clone());
        let capture = pb::CaptureRequest {
            account: Some(account("t1", "api")),
            hold_id: hold,
            amount: 10,
            idempotency_key: format!("c-race-{round}"),
        };
        let void = pb::VoidRequest {
            account: Some(account("t1", "api")),
            hold_id: hold,
            idempotency_key: format!("v-race-{round}"),
        };
        let (captured, voided) = tokio::join!(
            a.capture(with_token(capture, ADMIN_TOKEN)),
            b.void(with_token(void, ADMIN_TOKEN))
        );
        let wins = [captured.is_ok(), voided.is_ok()];
        assert_eq!(
            wins.iter().filter(|w| **w).count(),
            1,
            "round {round}: {captured:?} {voided:?}"
        );
        for loser in [captured.err(), voided.err()].into_iter().flatten() {
            assert_eq!(loser.code(), tonic::Code::FailedPrecondition, "{loser:?}");
        }
        winners.push(wins[0]);
    }
    let trail = full_trail(&mut client).await?;
    let accounts = verify_trail(&trail)?;
    let state = balance(&mut client, "t1", "api").await?;
    let from_trail = accounts.values().next().copied().unwrap_or_default();
    assert_eq!((state.balance, state.held), (from_trail.balance, from_trail.held));
    let captures = winners.iter().filter(|w| **w).count() as u64;
    assert_eq!(state.balance, 1000 - 10 * captures);
    Ok(())
}

fn cli(cluster: &BillingCluster, arguments: &[&str]) -> anyhow::Result<(bool, String, String)> {
    let output = Command::new(env!("CARGO_BIN_EXE_quotamesh"))
        .arg("billing")
        .arg("--endpoint")
        .arg(format!("http://{}", cluster.nodes[0].billing_addr))
        .args(arguments)
        .env("QUOTAMESH_BILLING_TOKEN", ADMIN_TOKEN)
        .output()?;
    Ok((
        output.status.success(),
        String::from_utf8(output.stdout)?,
        String::from_utf8(output.stderr)?,
    ))
}

/// The CLI: operations print the decision and balance (or JSON); a refused operation exits
/// 1 with the gRPC code; `audit --since` prints JSON lines; `verify` passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_operates_audits_and_verifies() -> anyhow::Result<()> {
    let cluster = BillingCluster::start(1, "")?;
    cluster.wait_for_leader(0).await?;
    let (ok, out, _) = cli(&cluster, &["create-account", "t1", "api", "--key", "c"])?;
    assert!(ok && out.starts_with("APPROVED"), "{out}");
    let (ok, out, _) = cli(&cluster, &["credit", "t1", "api", "500", "--key", "f"])?;
    assert!(ok && out.contains("balance 500"), "{out}");
    let (ok, out, _) = cli(&cluster, &["--json", "debit", "t1", "api", "120", "--key", "d"])?;
    let reply: serde_json::Value = serde_json::from_str(&out)?;
    assert!(ok);
    assert_eq!(reply["decision"], "APPROVED");
    assert_eq!(reply["balance"], 380);
    let (ok, out, _) = cli(&cluster, &["debit", "t1", "api", "120", "--key", "d"])?;
    assert!(ok && out.starts_with("DUPLICATE (replay of APPROVED)"), "{out}");
    let (ok, _, err) = cli(&cluster, &["debit", "t1", "api", "0", "--key", "z"])?;
    assert!(!ok && err.contains("InvalidArgument"), "{err}");
    let (ok, out, _) = cli(&cluster, &["balance", "t1", "api"])?;
    assert!(ok && out.contains("balance 380"), "{out}");
    let (ok, out, _) = cli(&cluster, &["history", "t1", "api"])?;
    assert!(ok && out.lines().count() == 3, "{out}");

    let (ok, out, _) = cli(&cluster, &["audit", "--since", "0"])?;
    assert!(ok);
    let lines: Vec<serde_json::Value> =
        out.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    assert_eq!(lines.len(), 3);
    let debit_index = lines[2]["ledger_index"].as_u64().unwrap_or(0);
    let (ok, out, _) = cli(&cluster, &["audit", "--since", &debit_index.to_string()])?;
    assert!(ok && out.lines().count() == 1, "{out}");
    let (ok, out, err) = cli(&cluster, &["verify"])?;
    assert!(ok && out.contains("every balance matches"), "{out} {err}");
    Ok(())
}

/// The CLI's exit codes tell a script what happened (0 approved, 3 insufficient funds, also
/// when replayed, 1 refused), connection options are accepted after the subcommand too, and
/// history prints RFC 3339 times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_exit_codes_and_options_anywhere() -> anyhow::Result<()> {
    let cluster = BillingCluster::start(1, "")?;
    cluster.wait_for_leader(0).await?;
    let endpoint = format!("http://{}", cluster.nodes[0].billing_addr);
    // Options last, after the subcommand's own arguments.
    let run = |arguments: &[&str]| -> anyhow::Result<(Option<i32>, String)> {
        let output = Command::new(env!("CARGO_BIN_EXE_quotamesh"))
            .arg("billing")
            .args(arguments)
            .args(["--endpoint", &endpoint, "--timeout-ms", "5000"])
            .env("QUOTAMESH_BILLING_TOKEN", ADMIN_TOKEN)
            .env_remove("QUOTAMESH_BILLING_ENDPOINT")
            .output()?;
        Ok((output.status.code(), String::from_utf8(output.stdout)?))
    };
    assert_eq!(run(&["create-account", "t2", "api", "--key", "c"])?.0, Some(0));
    assert_eq!(run(&["credit", "t2", "api", "100", "--key", "f"])?.0, Some(0));
    let (code, out) = run(&["debit", "t2", "api", "150", "--key", "d1"])?;
    assert_eq!(code, Some(3), "a refused debit is no success: {out}");
    assert!(out.starts_with("INSUFFICIENT_FUNDS"), "{out}");
    let (code, out) = run(&["debit", "t2", "api", "150", "--key", "d1", "--json"])?;
    assert_eq!(code, Some(3), "its replay neither: {out}");
    let (code, _) = run(&["debit", "t2", "api", "50", "--key", "d2"])?;
    assert_eq!(code, Some(0));
    let (code, _) = run(&["debit", "nobody", "api", "5", "--key", "d3"])?;
    assert_eq!(code, Some(1), "a refusal (no such account) exits 1");
    let (code, out) = run(&["history", "t2", "api"])?;
    assert_eq!(code, Some(0));
    let first = out.lines().next().unwrap_or_default();
    let time = first.split(" at ").nth(1).and_then(|rest| rest.split(' ').next()).unwrap_or("");
    assert!(
        time.len() == 24 && time.ends_with('Z') && time.as_bytes()[10] == b'T',
        "history shows RFC 3339 times: {first}"
    );
    Ok(())
}

/// With `client_ca` set the billing port is mTLS: a client with a certificate from that CA
/// is served, one without a certificate is refused at the handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_on_the_billing_port() -> anyhow::Result<()> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    quotamesh::api::billing::tls::install_crypto_provider();
    let directory = tempfile::tempdir()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |name: &str| -> anyhow::Result<(String, String)> {
        let key = KeyPair::generate()?;
        let cert = CertificateParams::new(vec![name.to_owned()])?.signed_by(&key, &issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    };
    let (server_cert, server_key) = leaf("localhost")?;
    let (client_cert, client_key) = leaf("client")?;
    let write = |name: &str, text: &str| -> anyhow::Result<String> {
        let path = directory.path().join(name);
        std::fs::write(&path, text)?;
        Ok(path.to_string_lossy().into_owned())
    };
    let ca = write("ca.pem", &ca_cert.pem())?;
    let tls = format!(
        "[billing.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{ca}\"\n",
        write("server.pem", &server_cert)?,
        write("server.key", &server_key)?
    );
    // The TLS table must come last in the file: the harness appends tokens after extras,
    // so put it through a config where tokens precede it.
    let cluster = BillingCluster::start_with_trailer(1, &tls)?;
    let port = cluster.nodes[0].billing_addr.rsplit(':').next().unwrap_or_default().to_owned();
    let endpoint = format!("https://localhost:{port}");
    let client_cert_path = write("client.pem", &client_cert)?;
    let client_key_path = write("client.key", &client_key)?;

    let run = |with_cert: bool| -> anyhow::Result<std::process::Output> {
        let mut command = Command::new(env!("CARGO_BIN_EXE_quotamesh"));
        command
            .args(["billing", "--endpoint", &endpoint, "--ca-cert", &ca])
            .env("QUOTAMESH_BILLING_TOKEN", ADMIN_TOKEN);
        if with_cert {
            command.args(["--client-cert", &client_cert_path, "--client-key", &client_key_path]);
        }
        Ok(command.args(["create-account", "t1", "api", "--key", "tls"]).output()?)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let served = run(true)?;
        if served.status.success() {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "mTLS client refused: {}",
            String::from_utf8_lossy(&served.stderr)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let refused = run(false)?;
    assert!(!refused.status.success(), "a client without a certificate was served");
    Ok(())
}
