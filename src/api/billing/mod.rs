//! The billing-debit gRPC service, `quotamesh.billing.v1.Billing`: decode, authenticate,
//! propose or read, encode. The rules are in `crate::core::billing`; replication in
//! `crate::ledger`; the error mapping in `crate::api::status`.
//!
//! ```text
//!  backend ──Debit(key, account, amount)──▶ authenticate (bearer digest) ─▶ authorize tenant
//!     ─▶ validate ─▶ proposer (batches) ─▶ billing Raft group: commit on a majority ─▶ apply
//!     ◀── APPROVED | INSUFFICIENT_FUNDS | DUPLICATE (original result, index, balance)
//!     ◀── UNAVAILABLE when no commit within the deadline (outcome unknown: retry, same key)
//!
//!  GetBalance / ListEntries on the leader:   ensure_linearizable (read index) ─▶ read
//!                           on a follower,   commit an empty command through the leader
//!        or a leader not recovered from      (a barrier), wait until applied here ─▶ read
//!        its restart (RaftGroup::recovered):
//! ```
//!
//! - [`auth`]: bearer tokens and tenant scopes.
//! - [`proposer`]: batching of concurrent operations into commands.
//! - [`tls`]: the billing port's optional TLS and mTLS.

pub mod auth;
pub mod proposer;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::{Request, Response, Status};

use crate::api::proto::quotamesh::billing::v1 as pb;
use crate::core::billing::{
    AccountId, AuditEntry, BillingCommand, BillingLedger, Decision, HoldId, IdempotencyKey,
    Operation, OperationKind, OperationRequest, Outcome,
};
use crate::ledger::{BillingGroup, RaftGroup};
use crate::metrics::Metrics;
use auth::{Authenticator, Principal};
use pb::billing_server::{Billing, BillingServer};
use proposer::{ProposeError, Proposer, ProposerSettings};

/// Reply metadata: the id of the node that answered.
pub const METADATA_NODE: &str = "x-quotamesh-node";
/// Reply metadata: the billing group leader that node knew of when it answered.
pub const METADATA_LEADER: &str = "x-quotamesh-leader";
/// Largest billing request or reply message.
pub const BILLING_MESSAGE_BYTES_MAX: usize = 1024 * 1024;
/// Default page of `ListEntries`.
pub const ENTRIES_PAGE_DEFAULT: u32 = 100;
/// Largest page of `ListEntries`.
pub const ENTRIES_PAGE_MAX: u32 = 1000;
/// Most trail entries one `ListEntries` call looks at (filtered or not), so a caller that
/// sees few tenants cannot make one call scan the whole trail.
pub const ENTRIES_SCANNED_PER_CALL_MAX: u64 = 10_000;

const _: () = assert!(ENTRIES_PAGE_MAX as u64 <= ENTRIES_SCANNED_PER_CALL_MAX);

/// What the service needs from the node.
#[derive(Debug, Clone)]
pub struct BillingSettings {
    /// No commit within this: `UNAVAILABLE`.
    pub deadline: Duration,
    /// `billing.key_retention_ms`.
    pub key_retention_ms: u64,
}

/// The billing service of one node; cheap to clone.
#[derive(Clone)]
pub struct BillingService {
    group: RaftGroup<BillingGroup>,
    proposer: Proposer,
    auth: Arc<Authenticator>,
    settings: BillingSettings,
    metrics: Metrics,
}

impl BillingService {
    /// A service over `group`, starting its proposer task.
    pub fn new(
        group: RaftGroup<BillingGroup>,
        auth: Authenticator,
        settings: BillingSettings,
        metrics: Metrics,
    ) -> Self {
        let proposer = Proposer::start(
            group.clone(),
            ProposerSettings { key_retention_ms: settings.key_retention_ms },
        );
        Self { group, proposer, auth: Arc::new(auth), settings, metrics }
    }

    /// The tonic service with the message size limits set both ways.
    pub fn into_server(self) -> BillingServer<Self> {
        BillingServer::new(self)
            .max_decoding_message_size(BILLING_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(BILLING_MESSAGE_BYTES_MAX)
    }

    /// The caller's deadline: the node's, or the client's `grpc-timeout` if shorter.
    fn deadline<T>(&self, request: &Request<T>) -> Instant {
        let client = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|value| value.to_str().ok())
            .and_then(parse_grpc_timeout);
        let budget = client.map_or(self.settings.deadline, |c| c.min(self.settings.deadline));
        Instant::now() + budget
    }

    /// A reply carrying which node answered and whom it follows, so clients and fault tests
    /// learn the leader without scraping logs.
    fn stamped<T>(&self, result: Result<Response<T>, Status>) -> Result<Response<T>, Status> {
        let stamp = |metadata: &mut tonic::metadata::MetadataMap| {
            if let Ok(value) = self.group.node_id().to_string().parse() {
                metadata.insert(METADATA_NODE, value);
            }
            if let Some(leader) = self.group.leader()
                && let Ok(value) = leader.to_string().parse()
            {
                metadata.insert(METADATA_LEADER, value);
            }
        };
        match result {
            Ok(mut response) => {
                stamp(response.metadata_mut());
                Ok(response)
            }
            Err(mut status) => {
                stamp(status.metadata_mut());
                Err(status)
            }
        }
    }

    fn principal<T>(&self, request: &Request<T>) -> Result<Arc<Principal>, Status> {
        Ok(self.auth.authenticate(request.metadata())?)
    }

    /// Authenticates, authorizes, validates and proposes one operation.
    async fn operate<T>(
        &self,
        request: &Request<T>,
        key: &str,
        operation: OperationRequest,
    ) -> Result<Response<pb::OperationReply>, Status> {
        let principal = self.principal(request)?;
        operation.account().check().map_err(|e| Status::invalid_argument(e.to_string()))?;
        principal.authorize(&operation.account().tenant)?;
        let key = IdempotencyKey(key.to_owned());
        key.check().map_err(|e| Status::invalid_argument(e.to_string()))?;
        operation.check().map_err(|e| Status::invalid_argument(e.to_string()))?;
        let deadline = self.deadline(request);
        let operation = Operation { caller: principal.name.clone(), key, request: operation };
        let result = self.proposer.propose(operation, deadline).await;
        let label = match &result {
            Ok(outcome) if outcome.replayed => "duplicate",
            Ok(outcome) => match outcome.decision {
                Decision::Approved => "approved",
                Decision::InsufficientFunds => "insufficient_funds",
            },
            Err(ProposeError::Refused(_) | ProposeError::Rejected(_)) => "refused",
            Err(ProposeError::Overloaded) => "overloaded",
            Err(ProposeError::Unavailable(_) | ProposeError::Stopped) => "unavailable",
        };
        self.metrics.billing_operations.with_label_values(&[label]).inc();
        let outcome = result.map_err(Status::from)?;
        Ok(Response::new(operation_reply(&outcome)))
    }

    /// Runs `read` on a state that reflects every commit made before this call: read index
    /// on the leader, a committed barrier from a follower (or from a leader not yet
    /// recovered from its restart, `RaftGroup::recovered`). Returns the applied index too.
    async fn read_linearizable<T>(
        &self,
        deadline: Instant,
        read: impl FnOnce(&BillingLedger) -> T,
    ) -> Result<(T, u64), Status> {
        let unavailable = |why: &str| {
            Status::unavailable(format!("no linearizable read within the deadline: {why}"))
        };
        let remaining = || deadline.saturating_duration_since(Instant::now());
        let mut leader_read_done = false;
        // A leader that has not applied what its log held at its start may have kept its
        // leadership across a crash without knowing what was committed: a barrier tells it.
        if self.group.leader() == Some(self.group.node_id()) && self.group.recovered() {
            match tokio::time::timeout(remaining(), self.group.ensure_linearizable()).await {
                Err(_) => return Err(unavailable("leadership not confirmed by a quorum")),
                Ok(Ok(_)) => leader_read_done = true,
                // Leadership moved, or no quorum answered: try the barrier through whoever
                // leads now; it fails within the deadline if nobody does.
                Ok(Err(error)) => tracing::debug!(%error, "read index refused; using a barrier"),
            }
        }
        if !leader_read_done {
            let barrier = BillingCommand {
                now_ms: crate::clock::now_ms(),
                key_retention_ms: self.settings.key_retention_ms,
                operations: Vec::new(),
            };
            let committed = self
                .group
                .write(barrier, remaining())
                .await
                .map_err(|error| unavailable(&error.to_string()))?;
            self.group
                .wait(remaining())
                .applied_index_at_least(Some(committed.ledger_index), "billing read barrier")
                .await
                .map_err(|error| unavailable(&error.to_string()))?;
        }
        let applied = self.group.last_applied_index().unwrap_or(0);
        Ok((self.group.read(read), applied))
    }
}

/// Parses gRPC's `grpc-timeout` header: up to 8 digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.checked_mul(3600)?),
        "M" => Duration::from_secs(amount.checked_mul(60)?),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

fn account_of(account: Option<pb::Account>) -> Result<AccountId, Status> {
    let account = account.ok_or_else(|| Status::invalid_argument("account is required"))?;
    Ok(AccountId { tenant: account.tenant, meter: account.meter })
}

fn account_pb(account: &AccountId) -> pb::Account {
    pb::Account { tenant: account.tenant.clone(), meter: account.meter.clone() }
}

fn decision_pb(decision: Decision) -> pb::Decision {
    match decision {
        Decision::Approved => pb::Decision::Approved,
        Decision::InsufficientFunds => pb::Decision::InsufficientFunds,
    }
}

fn operation_reply(outcome: &Outcome) -> pb::OperationReply {
    let original = decision_pb(outcome.decision);
    let decision = if outcome.replayed { pb::Decision::Duplicate } else { original };
    pb::OperationReply {
        decision: decision as i32,
        original_decision: original as i32,
        balance: outcome.balance_after,
        held: outcome.held_after,
        available: outcome
            .balance_after
            .saturating_sub(outcome.held_after)
            .saturating_sub(outcome.floor),
        floor: outcome.floor,
        ledger_index: outcome.ledger_index,
        entry_sequence: outcome.entry_sequence,
        hold_id: outcome.hold.map(|hold| hold.0),
    }
}

fn kind_pb(kind: OperationKind) -> pb::OperationKind {
    match kind {
        OperationKind::CreateAccount => pb::OperationKind::CreateAccount,
        OperationKind::Credit => pb::OperationKind::Credit,
        OperationKind::Debit => pb::OperationKind::Debit,
        OperationKind::Reserve => pb::OperationKind::Reserve,
        OperationKind::Capture => pb::OperationKind::Capture,
        OperationKind::Void => pb::OperationKind::Void,
        OperationKind::Expire => pb::OperationKind::Expire,
    }
}

/// The wire form of a trail entry.
pub fn entry_pb(entry: &AuditEntry) -> pb::Entry {
    pb::Entry {
        sequence: entry.sequence,
        ledger_index: entry.ledger_index,
        time_ms: entry.time_ms,
        caller: entry.caller.clone(),
        idempotency_key: entry.key.as_ref().map(|key| key.0.clone()).unwrap_or_default(),
        operation: kind_pb(entry.kind) as i32,
        account: Some(account_pb(&entry.account)),
        amount: entry.amount,
        hold_id: entry.hold.map(|hold| hold.0),
        ttl_ms: entry.ttl_ms,
        decision: decision_pb(entry.decision) as i32,
        balance_before: entry.balance_before,
        balance_after: entry.balance_after,
        held_before: entry.held_before,
        held_after: entry.held_after,
    }
}

/// A trail entry read back from the wire, for `billing audit` and `billing verify`.
///
/// # Errors
/// A message naming the field that does not decode.
pub fn entry_from_pb(entry: &pb::Entry) -> Result<AuditEntry, String> {
    let account = entry.account.as_ref().ok_or("entry without an account")?;
    let kind = match pb::OperationKind::try_from(entry.operation) {
        Ok(pb::OperationKind::CreateAccount) => OperationKind::CreateAccount,
        Ok(pb::OperationKind::Credit) => OperationKind::Credit,
        Ok(pb::OperationKind::Debit) => OperationKind::Debit,
        Ok(pb::OperationKind::Reserve) => OperationKind::Reserve,
        Ok(pb::OperationKind::Capture) => OperationKind::Capture,
        Ok(pb::OperationKind::Void) => OperationKind::Void,
        Ok(pb::OperationKind::Expire) => OperationKind::Expire,
        Ok(pb::OperationKind::Unspecified) | Err(_) => {
            return Err(format!("entry {}: unknown operation {}", entry.sequence, entry.operation));
        }
    };
    let decision = match pb::Decision::try_from(entry.decision) {
        Ok(pb::Decision::Approved) => Decision::Approved,
        Ok(pb::Decision::InsufficientFunds) => Decision::InsufficientFunds,
        _ => return Err(format!("entry {}: unknown decision {}", entry.sequence, entry.decision)),
    };
    Ok(AuditEntry {
        sequence: entry.sequence,
        ledger_index: entry.ledger_index,
        time_ms: entry.time_ms,
        caller: entry.caller.clone(),
        key: (!entry.idempotency_key.is_empty())
            .then(|| IdempotencyKey(entry.idempotency_key.clone())),
        kind,
        account: AccountId { tenant: account.tenant.clone(), meter: account.meter.clone() },
        amount: entry.amount,
        hold: entry.hold_id.map(HoldId),
        ttl_ms: entry.ttl_ms,
        decision,
        balance_before: entry.balance_before,
        balance_after: entry.balance_after,
        held_before: entry.held_before,
        held_after: entry.held_after,
    })
}

#[tonic::async_trait]
impl Billing for BillingService {
    async fn create_account(
        &self,
        request: Request<pb::CreateAccountRequest>,
    ) -> Result<Response<pb::OperationReply>, Status> {
        let body = request.get_ref().clone();
        let account = account_of(body.account)?;
        let operation = OperationRequest::CreateAccount { account, floor: body.floor };
        self.stamped(self.operate(&request, &body.idempotency_key, operation).await)
    }

    async fn credit(
        &self,
        request: Request<pb::CreditRequest>,
    ) -> Result<Response<pb::OperationReply>, Status> {
        let body = request.get_ref().clone();
        let account = account_of(body.account)?;
        let operation = OperationRequest::Credit { account, amount: body.amount };
        self.stamped(self.operate(&request, &body.idempotency_key, operation).await)
    }

    async fn debit(
        &self,
        request: Request<pb::DebitRequest>,
    ) -> Result<Response<pb::OperationReply>, Status> {
        let body = request.get_ref().clone();
        let account = account_of(body.account)?;
        let operation = OperationRequest::Debit { account, amount: body.amount };
        self.stamped(self.operate(&request, &body.idempotency_key, operation).await)
    }

    async fn reserve(
        &self,
        request: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::OperationReply>, Status> {
        let body = request.get_ref().clone();
        let account = account_of(body.account)?;
        let operation =
            OperationRequest::Reserve { account, amount: body.amount, ttl_ms: body.ttl_ms };
        self.stamped(self.operate(&request, &body.idempotency_key, operation).await)
    }

    async fn capture(
        &self,
        request: Request<pb::CaptureRequest>,
    ) -> Result<Response<pb::OperationReply>, Status> {
        let body = request.get_ref().clone();
        let account = account_of(body.account)?;
        let operation =
            OperationRequest::Capture { account, hold: HoldId(body.hold_id), amount: body.amount };
        self.stamped(self.operate(&request, &body.idempotency_key, operation).await)
    }

    async fn void(
        &self,
        request: Request<pb::VoidRequest>,
    ) -> Result<Response<pb::OperationReply>, Status> {
        let body = request.get_ref().clone();
        let account = account_of(body.account)?;
        let operation = OperationRequest::Void { account, hold: HoldId(body.hold_id) };
        self.stamped(self.operate(&request, &body.idempotency_key, operation).await)
    }

    async fn get_balance(
        &self,
        request: Request<pb::GetBalanceRequest>,
    ) -> Result<Response<pb::BalanceReply>, Status> {
        self.stamped(self.balance(request).await)
    }

    async fn list_entries(
        &self,
        request: Request<pb::ListEntriesRequest>,
    ) -> Result<Response<pb::ListEntriesReply>, Status> {
        self.stamped(self.entries(request).await)
    }
}

impl BillingService {
    async fn balance(
        &self,
        request: Request<pb::GetBalanceRequest>,
    ) -> Result<Response<pb::BalanceReply>, Status> {
        let principal = self.principal(&request)?;
        let account = account_of(request.get_ref().account.clone())?;
        account.check().map_err(|e| Status::invalid_argument(e.to_string()))?;
        principal.authorize(&account.tenant)?;
        let deadline = self.deadline(&request);
        let (state, ledger_index) =
            self.read_linearizable(deadline, |ledger| ledger.account_state(&account)).await?;
        let state =
            state.ok_or_else(|| Status::not_found(format!("account {account} does not exist")))?;
        Ok(Response::new(pb::BalanceReply {
            account: Some(account_pb(&account)),
            balance: state.balance,
            held: state.held,
            available: state.available(),
            floor: state.floor,
            ledger_index,
        }))
    }

    async fn entries(
        &self,
        request: Request<pb::ListEntriesRequest>,
    ) -> Result<Response<pb::ListEntriesReply>, Status> {
        let principal = self.principal(&request)?;
        let body = request.get_ref().clone();
        let account = match body.account {
            Some(account) => {
                let account = account_of(Some(account))?;
                account.check().map_err(|e| Status::invalid_argument(e.to_string()))?;
                principal.authorize(&account.tenant)?;
                Some(account)
            }
            None => None,
        };
        let page_size = match body.page_size {
            0 => ENTRIES_PAGE_DEFAULT,
            size if size <= ENTRIES_PAGE_MAX => size,
            size => {
                return Err(Status::invalid_argument(format!(
                    "page_size must be at most {ENTRIES_PAGE_MAX}, got {size}"
                )));
            }
        } as usize;
        let deadline = self.deadline(&request);
        let ((entries, next, more), ledger_index) = self
            .read_linearizable(deadline, |ledger| {
                let trail = ledger.trail();
                let start = body.page_token.max(ledger.first_entry_at(body.since_ledger_index));
                let end =
                    start.saturating_add(ENTRIES_SCANNED_PER_CALL_MAX).min(trail.len() as u64);
                let mut entries = Vec::new();
                let mut next = start;
                for entry in trail.get(start as usize..end as usize).unwrap_or(&[]) {
                    if entries.len() >= page_size {
                        break;
                    }
                    next = entry.sequence + 1;
                    let visible = match &account {
                        Some(account) => entry.account == *account,
                        None => principal.scope.allows(&entry.account.tenant),
                    };
                    if visible {
                        entries.push(entry_pb(entry));
                    }
                }
                if entries.len() < page_size {
                    next = end.max(start);
                }
                (entries, next, next < trail.len() as u64)
            })
            .await?;
        Ok(Response::new(pb::ListEntriesReply {
            entries,
            next_page_token: next,
            more,
            ledger_index,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gRPC timeouts parse in every unit; malformed ones are ignored.
    #[test]
    fn grpc_timeout_parses() {
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("m"), None);
        assert_eq!(parse_grpc_timeout("123456789m"), None);
        assert_eq!(parse_grpc_timeout("5x"), None);
    }
}
