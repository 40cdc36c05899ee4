//! `quotamesh billing ...`: a client of a node's billing API (`quotamesh.billing.v1`).
//!
//! Operations (`create-account`, `credit`, `debit`, `reserve`, `capture`, `void`) print the
//! decision, the balance after and the ledger index; each carries an idempotency key
//! (`--key`, or a generated one that is printed, so a retry after an unknown outcome can
//! reuse it). `balance` and `history` read; `audit --since INDEX` exports the trail as JSON
//! lines; `verify` recomputes every balance from the trail and fails on any mismatch.
//! `hash-token` prints the SHA-256 a node's configuration stores for a token.
//! `--json` prints one JSON object per result instead of a sentence.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use serde_json::json;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::api::billing::auth::token_sha256_hex;
use crate::api::billing::{ENTRIES_PAGE_MAX, entry_from_pb};
use crate::api::proto::quotamesh::billing::v1 as pb;
use crate::core::billing::{AccountId, AuditEntry, verify_trail};
use pb::billing_client::BillingClient;

/// Connection and output options of `quotamesh billing`, accepted before or after the
/// subcommand (`global`).
#[derive(Debug, Args)]
pub struct BillingArgs {
    /// The node's billing endpoint (`http://` or, with TLS, `https://`).
    #[arg(
        long,
        global = true,
        env = "QUOTAMESH_BILLING_ENDPOINT",
        default_value = "http://127.0.0.1:8082"
    )]
    pub endpoint: String,
    /// Bearer token (prefer the variable: flags show in process lists).
    #[arg(long, global = true, env = "QUOTAMESH_BILLING_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// CA certificate (PEM) that signed the node's certificate.
    #[arg(long, global = true, env = "QUOTAMESH_BILLING_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// Client certificate (PEM), for a node that requires mTLS.
    #[arg(long, global = true, env = "QUOTAMESH_BILLING_CLIENT_CERT", requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    /// Client private key (PEM).
    #[arg(long, global = true, env = "QUOTAMESH_BILLING_CLIENT_KEY", requires = "client_cert")]
    pub client_key: Option<PathBuf>,
    /// Name expected in the node's certificate [default: the endpoint's host].
    #[arg(long, global = true)]
    pub tls_domain: Option<String>,
    /// Deadline of each call to the node, in milliseconds; an operation past it has an
    /// unknown outcome (exit code 4: retry with the same --key).
    #[arg(long, global = true, default_value_t = 5000)]
    pub timeout_ms: u64,
    /// Print JSON instead of sentences.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: BillingCommand,
}

/// An account on the command line.
#[derive(Debug, Clone, Args)]
pub struct AccountArgs {
    /// The tenant.
    pub tenant: String,
    /// The meter.
    pub meter: String,
}

impl AccountArgs {
    fn to_pb(&self) -> pb::Account {
        pb::Account { tenant: self.tenant.clone(), meter: self.meter.clone() }
    }
}

/// Subcommands of `quotamesh billing`.
#[derive(Debug, Subcommand)]
pub enum BillingCommand {
    /// Open an account with a zero balance.
    CreateAccount {
        #[command(flatten)]
        account: AccountArgs,
        /// Debits never take the balance below this.
        #[arg(long, default_value_t = 0)]
        floor: u64,
        /// Idempotency key [default: generated and printed].
        #[arg(long)]
        key: Option<String>,
    },
    /// Add to an account's balance.
    Credit {
        #[command(flatten)]
        account: AccountArgs,
        /// Amount, in the meter's unit.
        amount: u64,
        /// Idempotency key [default: generated and printed].
        #[arg(long)]
        key: Option<String>,
    },
    /// Take from an account's balance if it allows.
    Debit {
        #[command(flatten)]
        account: AccountArgs,
        /// Amount, in the meter's unit.
        amount: u64,
        /// Idempotency key [default: generated and printed].
        #[arg(long)]
        key: Option<String>,
    },
    /// Hold an amount for a later capture.
    Reserve {
        #[command(flatten)]
        account: AccountArgs,
        /// Amount, in the meter's unit.
        amount: u64,
        /// The hold expires this long after its commit.
        #[arg(long)]
        ttl_ms: u64,
        /// Idempotency key [default: generated and printed].
        #[arg(long)]
        key: Option<String>,
    },
    /// Debit up to a hold's amount and release it.
    Capture {
        #[command(flatten)]
        account: AccountArgs,
        /// The hold id `reserve` printed.
        hold: u64,
        /// Amount, at most the held amount.
        amount: u64,
        /// Idempotency key [default: generated and printed].
        #[arg(long)]
        key: Option<String>,
    },
    /// Release a hold.
    Void {
        #[command(flatten)]
        account: AccountArgs,
        /// The hold id `reserve` printed.
        hold: u64,
        /// Idempotency key [default: generated and printed].
        #[arg(long)]
        key: Option<String>,
    },
    /// An account's balance (linearizable read).
    Balance {
        #[command(flatten)]
        account: AccountArgs,
    },
    /// An account's audit entries, oldest first.
    History {
        #[command(flatten)]
        account: AccountArgs,
        /// Start at this ledger index.
        #[arg(long, default_value_t = 0)]
        since: u64,
        /// Most entries shown.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Export the audit trail (every account the token may see) as JSON lines.
    Audit {
        /// Start at this ledger index.
        #[arg(long, default_value_t = 0)]
        since: u64,
    },
    /// Recompute every balance from the trail and compare with the ledger; exit 1 on any
    /// mismatch. Needs a token for every tenant (`tenants = ["*"]`) to see the whole trail.
    Verify,
    /// Print the SHA-256 of a token read from standard input, for `billing.tokens.sha256`.
    HashToken,
}

/// Runs a billing subcommand. A gRPC error (a refused operation, `UNAVAILABLE`, bad
/// credentials) prints its code and message on stderr and exits 1.
///
/// # Errors
/// The client TLS settings of a CLI command: trust `ca` (else the system's roots), present
/// `identity` (certificate and key files) when given, check `domain` instead of the host.
///
/// # Errors
/// When a file cannot be read.
pub fn client_tls(
    ca: Option<&std::path::Path>,
    identity: Option<(&std::path::Path, &std::path::Path)>,
    domain: Option<&str>,
) -> anyhow::Result<ClientTlsConfig> {
    crate::api::billing::tls::install_crypto_provider();
    let read = |path: &std::path::Path| {
        std::fs::read(path).with_context(|| format!("read {}", path.display()))
    };
    let mut tls = ClientTlsConfig::new();
    if let Some(ca) = ca {
        tls = tls.ca_certificate(Certificate::from_pem(read(ca)?));
    }
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    if let Some(domain) = domain {
        tls = tls.domain_name(domain.to_owned());
    }
    Ok(tls)
}

/// Connection, TLS-file and output failures.
pub async fn run(arguments: BillingArgs) -> anyhow::Result<ExitCode> {
    match run_command(arguments).await {
        Err(error) => match error.downcast_ref::<tonic::Status>() {
            Some(status) => {
                eprintln!("error: {:?}: {}", status.code(), status.message());
                Ok(ExitCode::from(exit_code_of(status.code())))
            }
            None => Err(error),
        },
        done => done,
    }
}

/// The exit code of a call that failed with `code`: an unknown outcome is told apart from a
/// refusal, because only the first may have applied (retry it with the same key).
fn exit_code_of(code: tonic::Code) -> u8 {
    match code {
        tonic::Code::Unavailable
        | tonic::Code::DeadlineExceeded
        | tonic::Code::Cancelled
        | tonic::Code::Unknown => super::EXIT_UNKNOWN_OUTCOME,
        _ => super::EXIT_FAILED,
    }
}

async fn run_command(arguments: BillingArgs) -> anyhow::Result<ExitCode> {
    if let BillingCommand::HashToken = arguments.command {
        let mut token = String::new();
        std::io::stdin().lock().read_line(&mut token).context("read the token from stdin")?;
        println!("{}", token_sha256_hex(token.trim_end_matches(['\r', '\n'])));
        return Ok(ExitCode::SUCCESS);
    }
    let client = Client::connect(&arguments).await?;
    let json = arguments.json;
    match arguments.command {
        BillingCommand::CreateAccount { account, floor, key } => {
            let key = key.unwrap_or_else(generated_key);
            let request = pb::CreateAccountRequest {
                account: Some(account.to_pb()),
                floor,
                idempotency_key: key.clone(),
            };
            let reply = client.billing().create_account(client.request(request)).await?;
            return Ok(print_operation(
                "create-account",
                &account,
                &key,
                &reply.into_inner(),
                json,
            ));
        }
        BillingCommand::Credit { account, amount, key } => {
            let key = key.unwrap_or_else(generated_key);
            let request = pb::CreditRequest {
                account: Some(account.to_pb()),
                amount,
                idempotency_key: key.clone(),
            };
            let reply = client.billing().credit(client.request(request)).await?;
            return Ok(print_operation("credit", &account, &key, &reply.into_inner(), json));
        }
        BillingCommand::Debit { account, amount, key } => {
            let key = key.unwrap_or_else(generated_key);
            let request = pb::DebitRequest {
                account: Some(account.to_pb()),
                amount,
                idempotency_key: key.clone(),
            };
            let reply = client.billing().debit(client.request(request)).await?;
            return Ok(print_operation("debit", &account, &key, &reply.into_inner(), json));
        }
        BillingCommand::Reserve { account, amount, ttl_ms, key } => {
            let key = key.unwrap_or_else(generated_key);
            let request = pb::ReserveRequest {
                account: Some(account.to_pb()),
                amount,
                ttl_ms,
                idempotency_key: key.clone(),
            };
            let reply = client.billing().reserve(client.request(request)).await?;
            return Ok(print_operation("reserve", &account, &key, &reply.into_inner(), json));
        }
        BillingCommand::Capture { account, hold, amount, key } => {
            let key = key.unwrap_or_else(generated_key);
            let request = pb::CaptureRequest {
                account: Some(account.to_pb()),
                hold_id: hold,
                amount,
                idempotency_key: key.clone(),
            };
            let reply = client.billing().capture(client.request(request)).await?;
            return Ok(print_operation("capture", &account, &key, &reply.into_inner(), json));
        }
        BillingCommand::Void { account, hold, key } => {
            let key = key.unwrap_or_else(generated_key);
            let request = pb::VoidRequest {
                account: Some(account.to_pb()),
                hold_id: hold,
                idempotency_key: key.clone(),
            };
            let reply = client.billing().void(client.request(request)).await?;
            return Ok(print_operation("void", &account, &key, &reply.into_inner(), json));
        }
        BillingCommand::Balance { account } => {
            let request = pb::GetBalanceRequest { account: Some(account.to_pb()) };
            let reply = client.billing().get_balance(client.request(request)).await?.into_inner();
            if json {
                println!(
                    "{}",
                    json!({"tenant": account.tenant, "meter": account.meter, "balance": reply.balance,
                        "held": reply.held, "available": reply.available, "floor": reply.floor,
                        "ledger_index": reply.ledger_index})
                );
            } else {
                println!(
                    "{}/{}: balance {}, held {}, available {}, floor {} (ledger index {})",
                    account.tenant,
                    account.meter,
                    reply.balance,
                    reply.held,
                    reply.available,
                    reply.floor,
                    reply.ledger_index
                );
            }
        }
        BillingCommand::History { account, since, limit } => {
            let entries = client.entries(Some(account.to_pb()), since, limit).await?;
            for entry in &entries {
                if json {
                    println!("{}", serde_json::to_string(entry)?);
                } else {
                    println!("{}", describe_entry(entry));
                }
            }
        }
        BillingCommand::Audit { since } => {
            let entries = client.entries(None, since, usize::MAX).await?;
            let mut out = std::io::stdout().lock();
            for entry in &entries {
                writeln!(out, "{}", serde_json::to_string(entry)?)?;
            }
        }
        BillingCommand::Verify => return client.verify(json).await,
        BillingCommand::HashToken => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// A fresh key for a one-shot command: the time and the process id, unique per machine
/// for commands that are not run twice in one millisecond by one process.
fn generated_key() -> String {
    format!("cli-{}-{}", crate::clock::now_ms(), std::process::id())
}

fn decision_name(decision: i32) -> &'static str {
    match pb::Decision::try_from(decision) {
        Ok(pb::Decision::Approved) => "APPROVED",
        Ok(pb::Decision::InsufficientFunds) => "INSUFFICIENT_FUNDS",
        Ok(pb::Decision::Duplicate) => "DUPLICATE",
        Ok(pb::Decision::Unspecified) | Err(_) => "UNSPECIFIED",
    }
}

/// Prints an operation's answer; its exit code says whether the operation was approved.
fn print_operation(
    operation: &str,
    account: &AccountArgs,
    key: &str,
    reply: &pb::OperationReply,
    json: bool,
) -> ExitCode {
    let decision = decision_name(reply.decision);
    let original = decision_name(reply.original_decision);
    let refused = decision == "INSUFFICIENT_FUNDS"
        || (decision == "DUPLICATE" && original == "INSUFFICIENT_FUNDS");
    let code =
        ExitCode::from(if refused { super::EXIT_INSUFFICIENT_FUNDS } else { super::EXIT_OK });
    if json {
        println!(
            "{}",
            json!({"operation": operation, "tenant": account.tenant, "meter": account.meter,
                "key": key, "decision": decision, "original_decision": original,
                "balance": reply.balance, "held": reply.held, "available": reply.available,
                "floor": reply.floor, "ledger_index": reply.ledger_index,
                "entry_sequence": reply.entry_sequence, "hold_id": reply.hold_id})
        );
        return code;
    }
    let replay =
        if decision == "DUPLICATE" { format!(" (replay of {original})") } else { String::new() };
    let hold = reply.hold_id.map(|hold| format!(", hold {hold}")).unwrap_or_default();
    println!(
        "{decision}{replay}: {operation} on {}/{}{hold}: balance {}, held {}, available {} \
         (ledger index {}, key {key})",
        account.tenant,
        account.meter,
        reply.balance,
        reply.held,
        reply.available,
        reply.ledger_index
    );
    code
}

fn describe_entry(entry: &AuditEntry) -> String {
    let hold = entry.hold.map(|hold| format!(" hold {hold}")).unwrap_or_default();
    let key = entry.key.as_ref().map_or("-".to_owned(), ToString::to_string);
    format!(
        "#{} index {} at {} by {} key {}: {} {} on {}{hold} -> {:?}: balance {} -> {}, held {} -> {}",
        entry.sequence,
        entry.ledger_index,
        crate::core::rfc3339::format_epoch_ms(entry.time_ms),
        entry.caller,
        key,
        entry.kind.as_str(),
        entry.amount,
        entry.account,
        entry.decision,
        entry.balance_before,
        entry.balance_after,
        entry.held_before,
        entry.held_after
    )
}

/// A connected billing client with its token and timeout.
pub struct Client {
    channel: Channel,
    token: Option<String>,
    timeout: Duration,
}

impl Client {
    /// Connects as the arguments say.
    ///
    /// # Errors
    /// Unreadable TLS files or an endpoint that cannot be reached.
    pub async fn connect(arguments: &BillingArgs) -> anyhow::Result<Self> {
        let timeout = Duration::from_millis(arguments.timeout_ms);
        let mut endpoint = Endpoint::from_shared(arguments.endpoint.clone())
            .context("invalid --endpoint")?
            .connect_timeout(timeout)
            .timeout(timeout);
        if arguments.ca_cert.is_some() || arguments.client_cert.is_some() {
            endpoint = endpoint.tls_config(client_tls(
                arguments.ca_cert.as_deref(),
                arguments.client_cert.as_deref().zip(arguments.client_key.as_deref()),
                arguments.tls_domain.as_deref(),
            )?)?;
        }
        let channel = endpoint.connect().await.with_context(|| {
            format!("cannot connect to the billing endpoint {}", arguments.endpoint)
        })?;
        Ok(Self { channel, token: arguments.token.clone(), timeout })
    }

    fn billing(&self) -> BillingClient<Channel> {
        BillingClient::new(self.channel.clone())
    }

    fn request<T>(&self, body: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(body);
        request.set_timeout(self.timeout);
        if let Some(token) = &self.token
            && let Ok(value) = format!("Bearer {token}").parse()
        {
            request.metadata_mut().insert("authorization", value);
        }
        request
    }

    /// Up to `limit` entries from ledger index `since`, following pages.
    async fn entries(
        &self,
        account: Option<pb::Account>,
        since: u64,
        limit: usize,
    ) -> anyhow::Result<Vec<AuditEntry>> {
        let mut entries = Vec::new();
        let mut page_token = 0;
        loop {
            let request = pb::ListEntriesRequest {
                account: account.clone(),
                since_ledger_index: since,
                page_token,
                page_size: ENTRIES_PAGE_MAX,
            };
            let reply = self.billing().list_entries(self.request(request)).await?.into_inner();
            for entry in &reply.entries {
                if entries.len() >= limit {
                    return Ok(entries);
                }
                entries.push(entry_from_pb(entry).map_err(anyhow::Error::msg)?);
            }
            if !reply.more {
                return Ok(entries);
            }
            page_token = reply.next_page_token;
        }
    }

    /// `billing verify`: the trail recomputed against the ledger's balances.
    async fn verify(&self, json: bool) -> anyhow::Result<ExitCode> {
        // The trail may grow while we read balances; read again until a pass sees balances
        // no newer than its trail (bounded, for a ledger that never rests).
        for _ in 0..10 {
            let entries = self.entries(None, 0, usize::MAX).await?;
            let recomputed = match verify_trail(&entries) {
                Ok(accounts) => accounts,
                Err(error) => return Ok(report_failure(&format!("{error}"), json)),
            };
            let trail_index = entries.last().map_or(0, |entry| entry.ledger_index);
            let mut balances = BTreeMap::new();
            let mut newest_read = 0;
            for account in recomputed.keys() {
                let request = pb::GetBalanceRequest {
                    account: Some(pb::Account {
                        tenant: account.tenant.clone(),
                        meter: account.meter.clone(),
                    }),
                };
                let reply = self.billing().get_balance(self.request(request)).await?.into_inner();
                newest_read = newest_read.max(reply.ledger_index);
                balances.insert(account.clone(), reply);
            }
            let changed_since = self.entries(None, trail_index + 1, 1).await?;
            if !changed_since.is_empty() && newest_read > trail_index {
                continue;
            }
            let mismatches: Vec<String> = recomputed
                .iter()
                .filter_map(|(account, from_trail): (&AccountId, _)| {
                    let ledger = balances.get(account)?;
                    ((ledger.balance, ledger.held) != (from_trail.balance, from_trail.held)).then(
                        || {
                            format!(
                                "{account}: ledger balance {} held {}, trail balance {} held {}",
                                ledger.balance, ledger.held, from_trail.balance, from_trail.held
                            )
                        },
                    )
                })
                .collect();
            if !mismatches.is_empty() {
                return Ok(report_failure(&mismatches.join("; "), json));
            }
            if json {
                println!(
                    "{}",
                    json!({"verified": true, "entries": entries.len(), "accounts": recomputed.len(),
                        "ledger_index": trail_index})
                );
            } else {
                println!(
                    "verified {} entries over {} accounts up to ledger index {trail_index}: \
                     every balance matches the trail",
                    entries.len(),
                    recomputed.len()
                );
            }
            return Ok(ExitCode::SUCCESS);
        }
        bail!("the trail kept growing during 10 verification passes; try again when quieter")
    }
}

fn report_failure(reason: &str, json: bool) -> ExitCode {
    if json {
        println!("{}", json!({"verified": false, "reason": reason}));
    } else {
        eprintln!("verification FAILED: {reason}");
    }
    ExitCode::FAILURE
}
