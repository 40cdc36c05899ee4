//! The suite's clients of the nodes' billing API and Rate Limit Service: one lazily
//! connected gRPC channel per node and API, every call with a timeout (and a bearer token
//! for billing), and the translation of replies into the history's vocabulary (`ok` with
//! what was decided, `fail` when nothing can have been applied, `info` when it may have
//! been). Also the two reads of the final phase (which node leads, and the whole audit
//! trail) and the reads of the quota ledger's keys that the lease checker judges.

use std::time::Duration;

use anyhow::Context;
use tonic::transport::Channel;

use crate::checker::replicas::ReplicaState;
use crate::history::NodeId;
use crate::history::{
    Decision, EntryKind, EventType, Function, KeySample, LedgerSample, OpValue, TrailEntry,
};
use crate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use crate::proto::envoy::service::ratelimit::v3 as rls;
use crate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use crate::proto::quotamesh::admin::v1 as admin;
use crate::proto::quotamesh::admin::v1::admin_client::AdminClient;
use crate::proto::quotamesh::billing::v1 as pb;
use crate::workload::bank::TENANT;
use pb::billing_client::BillingClient;

/// A call's timeout: a node's shipped billing deadline (`[billing] deadline_ms`, 1 s) and a
/// second for the network and a loaded machine. Past it the outcome of a mutation is unknown.
pub const CALL_TIMEOUT: Duration = Duration::from_millis(2_000);
/// Connecting to a node: a stopped or killed one fails fast.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(1_000);
/// Reply metadata naming the billing group's leader as the answering node sees it.
const METADATA_LEADER: &str = "x-quotamesh-leader";
/// Entries per `ListEntries` page (the API's maximum).
const PAGE_SIZE: u32 = 1_000;
/// `ReadKeys` pages of one ledger read (4,096 keys a page): the workloads make a handful.
const LEDGER_PAGES_MAX: usize = 16;

/// A lazy channel to `address` (`host:port`) with the suite's timeouts.
fn channel(address: &str) -> anyhow::Result<Channel> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .with_context(|| format!("address {address}"))?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(CALL_TIMEOUT);
    Ok(endpoint.connect_lazy())
}

/// A request with the call timeout and `token` as its bearer token.
fn authorized<T>(body: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(body);
    request.set_timeout(CALL_TIMEOUT);
    if let Ok(value) = format!("Bearer {token}").parse() {
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// The clients of every node, by position: billing (voters only), RLS and admin (the
/// voters, then the gateways).
#[derive(Clone)]
pub struct Clients {
    pub billing: BillingNodes,
    rls: Vec<RateLimitServiceClient<Channel>>,
    admin: Vec<AdminClient<Channel>>,
    admin_token: String,
}

impl Clients {
    /// Lazy channels to the nodes' billing, RLS and admin addresses.
    ///
    /// # Errors
    /// An address is not a valid URI.
    pub fn new(
        billing: &[String],
        rls: &[String],
        admin: &[String],
        billing_token: &str,
        admin_token: &str,
    ) -> anyhow::Result<Self> {
        let rls = rls
            .iter()
            .map(|address| Ok(RateLimitServiceClient::new(channel(address)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let admin = admin
            .iter()
            .map(|address| Ok(AdminClient::new(channel(address)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self {
            billing: BillingNodes::new(billing, billing_token)?,
            rls,
            admin,
            admin_token: admin_token.to_owned(),
        })
    }

    /// Both groups' applied index and state digest on node `position` (admin `Status`);
    /// unknown indexes when it does not answer.
    pub async fn replica_states(&self, position: usize) -> Vec<ReplicaState> {
        let node = NodeId(position as u64 + 1);
        let mut client = self.admin[position].clone();
        let request = authorized(admin::StatusRequest {}, &self.admin_token);
        let status = client.status(request).await.ok().map(tonic::Response::into_inner);
        let billing = status.as_ref().and_then(|status| status.billing.as_ref());
        let state = |group: &str, applied_index, state_digest| ReplicaState {
            node,
            group: group.to_owned(),
            applied_index,
            state_digest,
        };
        vec![
            state(
                "quota",
                status.as_ref().and_then(|status| status.applied_index),
                status.as_ref().map_or(0, |status| status.state_digest),
            ),
            state(
                "billing",
                billing.and_then(|billing| billing.applied_index),
                billing.map_or(0, |billing| billing.state_digest),
            ),
        ]
    }

    /// Every key of the quota ledger as node `position` has applied it (admin `ReadKeys`
    /// listing, page by page); `None` when it does not answer, has applied nothing yet, or
    /// moved on between pages (the next read catches up).
    pub async fn ledger_sample(
        &self,
        position: usize,
        time_ns: impl Fn() -> u64,
    ) -> Option<LedgerSample> {
        let mut client = self.admin[position].clone();
        let mut sample: Option<LedgerSample> = None;
        let mut after = String::new();
        for _ in 0..LEDGER_PAGES_MAX {
            let body = admin::ReadKeysRequest { keys: Vec::new(), after, max_keys: 0 };
            let page =
                client.read_keys(authorized(body, &self.admin_token)).await.ok()?.into_inner();
            let applied_index = page.applied_index?;
            let keys = page.entries.into_iter().map(|entry| KeySample {
                key: entry.key,
                algorithm: entry.algorithm,
                capacity_tokens: entry.capacity_tokens,
                requests_per_window: entry.requests_per_window,
                window_ms: entry.window_ms,
                since_ms: entry.totals_since_ms,
                granted_tokens: entry.granted_tokens,
                charged_tokens: entry.charged_tokens,
                returned_tokens: entry.returned_tokens,
            });
            match &mut sample {
                None => {
                    sample = Some(LedgerSample {
                        time_ns: 0,
                        node: NodeId(position as u64 + 1),
                        applied_index,
                        ledger_time_ms: page.ledger_time_ms,
                        keys: keys.collect(),
                    });
                }
                Some(sample) if sample.applied_index == applied_index => sample.keys.extend(keys),
                Some(_) => return None,
            }
            if page.next_after.is_empty() {
                return sample.map(|sample| LedgerSample { time_ns: time_ns(), ..sample });
            }
            after = page.next_after;
        }
        None
    }

    /// The voters (the nodes with a billing API and replicas).
    pub fn len(&self) -> usize {
        self.billing.len()
    }

    pub fn is_empty(&self) -> bool {
        self.billing.is_empty()
    }

    /// Sends an operation to node `position`; returns how it ended and what came back.
    pub async fn call(
        &self,
        position: usize,
        f: Function,
        value: &OpValue,
    ) -> (EventType, OpValue) {
        match f {
            Function::Check => self.check(position, value).await,
            Function::Acquire => self.acquire(position, value).await,
            _ => self.billing.call(position, f, value).await,
        }
    }

    /// One lease grant of `value.amount` tokens on the lease workload's key
    /// `value.descriptor` for `value.ttl_ms`, held by node `position` (admin
    /// `AcquireLeases`). Each call is a grant of its own: an unknown one is `info`.
    async fn acquire(&self, position: usize, value: &OpValue) -> (EventType, OpValue) {
        use crate::workload::leases::{DESCRIPTOR_KEY, DOMAIN};
        let mut client = self.admin[position].clone();
        let wanted = admin::LeaseWanted {
            domain: DOMAIN.to_owned(),
            entries: vec![admin::DescriptorEntry {
                key: DESCRIPTOR_KEY.to_owned(),
                value: value.descriptor.clone().unwrap_or_default(),
            }],
            tokens_wanted: value.amount.unwrap_or(0),
        };
        let lease_ttl_ms = value.ttl_ms.unwrap_or(0);
        let body = admin::AcquireLeasesRequest { leases: vec![wanted], lease_ttl_ms };
        let mut reply = value.clone();
        match client.acquire_leases(authorized(body, &self.admin_token)).await {
            Ok(response) => {
                let Some(result) = response.into_inner().results.into_iter().next() else {
                    reply.error = Some("no result for the one lease asked".to_owned());
                    return (EventType::Info, reply);
                };
                if !result.error.is_empty() {
                    // The ledger refused the item; nothing changed for it.
                    reply.error = Some(result.error);
                    return (EventType::Fail, reply);
                }
                reply.granted = Some(result.granted_tokens);
                reply.remaining = Some(result.remaining_tokens);
                reply.ledger_time_ms = result
                    .lease_expires_at_ms
                    .map(|expires_at_ms| expires_at_ms.saturating_sub(lease_ttl_ms));
                (EventType::Ok, reply)
            }
            Err(status) => {
                reply.error = Some(format!("{:?}: {}", status.code(), status.message()));
                (classify(status.code(), connection_refused(&status), true), reply)
            }
        }
    }

    /// One hit on `value.descriptor`'s key. Any error is `info`: the node may have taken a
    /// token before it failed, and Envoy would have let the request through or not by its
    /// own `failure_mode_deny`.
    async fn check(&self, position: usize, value: &OpValue) -> (EventType, OpValue) {
        let mut client = self.rls[position].clone();
        let descriptor = RateLimitDescriptor {
            entries: vec![Entry {
                key: value.descriptor.clone().unwrap_or_default(),
                value: crate::workload::rls::KEY_VALUE.to_owned(),
            }],
            limit: None,
            hits_addend: None,
        };
        let mut request = tonic::Request::new(rls::RateLimitRequest {
            domain: crate::workload::rls::DOMAIN.to_owned(),
            descriptors: vec![descriptor],
            hits_addend: 0,
        });
        request.set_timeout(CALL_TIMEOUT);
        let mut reply = value.clone();
        match client.should_rate_limit(request).await {
            Ok(response) => match response.into_inner().overall_code() {
                rls::rate_limit_response::Code::Ok => {
                    reply.admitted = Some(true);
                    (EventType::Ok, reply)
                }
                rls::rate_limit_response::Code::OverLimit => {
                    reply.admitted = Some(false);
                    (EventType::Ok, reply)
                }
                rls::rate_limit_response::Code::Unknown => {
                    reply.error = Some("overall code UNKNOWN".to_owned());
                    (EventType::Info, reply)
                }
            },
            Err(status) => {
                reply.error = Some(format!("{:?}: {}", status.code(), status.message()));
                (EventType::Info, reply)
            }
        }
    }
}

/// Billing clients of every node of the cluster, by position.
#[derive(Clone)]
pub struct BillingNodes {
    clients: Vec<BillingClient<Channel>>,
    token: String,
}

impl BillingNodes {
    /// Lazy channels to `addresses` (`host:port`); nothing is dialled until the first call.
    ///
    /// # Errors
    /// An address is not a valid URI.
    pub fn new(addresses: &[String], token: &str) -> anyhow::Result<Self> {
        let clients = addresses
            .iter()
            .map(|address| Ok(BillingClient::new(channel(address)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self { clients, token: token.to_owned() })
    }

    pub fn len(&self) -> usize {
        self.clients.len()
    }

    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    fn request<T>(&self, body: T) -> tonic::Request<T> {
        authorized(body, &self.token)
    }

    fn account(meter: &str) -> Option<pb::Account> {
        Some(pb::Account { tenant: TENANT.to_owned(), meter: meter.to_owned() })
    }

    /// Sends an operation to node `position`; returns how it ended and what came back.
    async fn call(&self, position: usize, f: Function, value: &OpValue) -> (EventType, OpValue) {
        let mut client = self.clients[position].clone();
        let account = Self::account(&value.account);
        let amount = value.amount.unwrap_or(0);
        let idempotency_key = value.key.clone().unwrap_or_default();
        let result = match f {
            Function::CreateAccount => {
                let body = pb::CreateAccountRequest { account, floor: amount, idempotency_key };
                client.create_account(self.request(body)).await
            }
            Function::Credit => {
                let body = pb::CreditRequest { account, amount, idempotency_key };
                client.credit(self.request(body)).await
            }
            Function::Debit => {
                let body = pb::DebitRequest { account, amount, idempotency_key };
                client.debit(self.request(body)).await
            }
            Function::Reserve => {
                let ttl_ms = value.ttl_ms.unwrap_or(0);
                let body = pb::ReserveRequest { account, amount, ttl_ms, idempotency_key };
                client.reserve(self.request(body)).await
            }
            Function::Capture => {
                let hold_id = value.hold_id.unwrap_or(0);
                let body = pb::CaptureRequest { account, hold_id, amount, idempotency_key };
                client.capture(self.request(body)).await
            }
            Function::Void => {
                let hold_id = value.hold_id.unwrap_or(0);
                let body = pb::VoidRequest { account, hold_id, idempotency_key };
                client.void(self.request(body)).await
            }
            Function::Read => return self.read(position, value).await,
            Function::Check | Function::Acquire => {
                let mut reply = value.clone();
                reply.error = Some(format!("{f:?} is no billing call"));
                return (EventType::Fail, reply);
            }
        };
        let mut reply = value.clone();
        match result {
            Ok(response) => {
                let response = response.into_inner();
                reply.decision = Some(match response.original_decision() {
                    pb::Decision::InsufficientFunds => Decision::InsufficientFunds,
                    _ => Decision::Approved,
                });
                reply.duplicate = response.decision() == pb::Decision::Duplicate;
                reply.balance = Some(response.balance);
                reply.ledger_index = Some(response.ledger_index);
                reply.hold_id = response.hold_id.or(reply.hold_id);
                (EventType::Ok, reply)
            }
            Err(status) => {
                let event_type = classify(status.code(), connection_refused(&status), true);
                reply.refused = matches!(
                    status.code(),
                    tonic::Code::FailedPrecondition | tonic::Code::NotFound
                );
                reply.error = Some(format!("{:?}: {}", status.code(), status.message()));
                (event_type, reply)
            }
        }
    }

    /// A linearizable balance read through node `position`.
    async fn read(&self, position: usize, value: &OpValue) -> (EventType, OpValue) {
        let mut client = self.clients[position].clone();
        let body = pb::GetBalanceRequest { account: Self::account(&value.account) };
        let mut reply = value.clone();
        match client.get_balance(self.request(body)).await {
            Ok(response) => {
                let response = response.into_inner();
                reply.balance = Some(response.balance);
                reply.ledger_index = Some(response.ledger_index);
                (EventType::Ok, reply)
            }
            Err(status) => {
                reply.error = Some(format!("{:?}: {}", status.code(), status.message()));
                (classify(status.code(), connection_refused(&status), false), reply)
            }
        }
    }

    /// The billing group's leader as node `position` sees it (from any reply's metadata,
    /// a `NOT_FOUND` one included), if it answers and knows one.
    pub async fn leader_seen_by(&self, position: usize) -> Option<u64> {
        let mut client = self.clients[position].clone();
        let body = pb::GetBalanceRequest { account: Self::account("leader-probe") };
        let metadata = match client.get_balance(self.request(body)).await {
            Ok(response) => response.metadata().clone(),
            Err(status) => status.metadata().clone(),
        };
        metadata.get(METADATA_LEADER)?.to_str().ok()?.parse().ok()
    }

    /// The whole audit trail through node `position`, page by page.
    ///
    /// # Errors
    /// A page could not be read (the caller retries).
    pub async fn trail(&self, position: usize) -> anyhow::Result<Vec<TrailEntry>> {
        let mut client = self.clients[position].clone();
        let mut entries = Vec::new();
        let mut page_token = 0;
        loop {
            let body = pb::ListEntriesRequest {
                account: None,
                since_ledger_index: 0,
                page_token,
                page_size: PAGE_SIZE,
            };
            let page = client.list_entries(self.request(body)).await?.into_inner();
            entries.extend(page.entries.iter().map(trail_entry));
            if !page.more {
                return Ok(entries);
            }
            page_token = page.next_page_token;
        }
    }
}

fn trail_entry(entry: &pb::Entry) -> TrailEntry {
    let kind = match entry.operation() {
        pb::OperationKind::CreateAccount => EntryKind::CreateAccount,
        pb::OperationKind::Credit => EntryKind::Credit,
        pb::OperationKind::Debit => EntryKind::Debit,
        pb::OperationKind::Reserve => EntryKind::Reserve,
        pb::OperationKind::Capture => EntryKind::Capture,
        pb::OperationKind::Void => EntryKind::Void,
        pb::OperationKind::Expire => EntryKind::Expire,
        pb::OperationKind::Unspecified => EntryKind::Other,
    };
    TrailEntry {
        sequence: entry.sequence,
        ledger_index: entry.ledger_index,
        time_ms: entry.time_ms,
        kind,
        account: entry.account.as_ref().map(|account| account.meter.clone()).unwrap_or_default(),
        key: entry.idempotency_key.clone(),
        amount: entry.amount,
        decision: match entry.decision() {
            pb::Decision::InsufficientFunds => Decision::InsufficientFunds,
            _ => Decision::Approved,
        },
        balance_before: entry.balance_before,
        balance_after: entry.balance_after,
        held_before: entry.held_before,
        held_after: entry.held_after,
        hold_id: entry.hold_id,
        ttl_ms: entry.ttl_ms,
    }
}

/// How an error reply ends an operation. Only codes that promise nothing was applied, and a
/// refused connection (the request never left), are `fail`; for a mutation anything else
/// (UNAVAILABLE, DEADLINE_EXCEEDED, a broken connection) is `info`. A read changes nothing,
/// so its errors are `fail`.
pub fn classify(code: tonic::Code, connection_refused: bool, mutation: bool) -> EventType {
    use tonic::Code;
    let definite = matches!(
        code,
        Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::FailedPrecondition
            | Code::PermissionDenied
            | Code::Unauthenticated
            | Code::ResourceExhausted
    );
    if definite || connection_refused || !mutation { EventType::Fail } else { EventType::Info }
}

/// Whether the call failed because the connection was refused.
fn connection_refused(status: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::ConnectionRefused
        {
            return true;
        }
        source = error.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mutation that may have committed is never `fail`; a definite refusal never `info`.
    #[test]
    fn unknown_outcomes_are_info() {
        for code in [tonic::Code::Unavailable, tonic::Code::DeadlineExceeded, tonic::Code::Unknown]
        {
            assert_eq!(classify(code, false, true), EventType::Info, "{code:?}");
            assert_eq!(classify(code, true, true), EventType::Fail, "{code:?} refused");
            assert_eq!(classify(code, false, false), EventType::Fail, "{code:?} read");
        }
        for code in [tonic::Code::FailedPrecondition, tonic::Code::NotFound] {
            assert_eq!(classify(code, false, true), EventType::Fail, "{code:?}");
        }
    }
}
