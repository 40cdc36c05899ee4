//! The billing ledger's state machine: pure, deterministic apply of debit commands.
//!
//! This file owns the contractual side of a region (DESIGN.md section 6): accounts per
//! (tenant, meter) with a balance and a floor, two-phase holds, idempotency keys and the
//! append-only audit trail. It does no IO, reads no clock and draws no random number: every
//! command carries the time its leader stamped (`ledger_time.rs`), and apply uses
//! `max(last_seen_ms, now_ms)`, so every replica that applies the same commands in the same order reaches the same state
//! ([`BillingLedger::digest`] compares them). Replication and the encoding of records are
//! `src/ledger/billing.rs`'s; the gRPC mapping is `src/api/billing/`'s.
//!
//! # Money
//! Amounts are integers in the meter's unit (`u64`), every sum is checked. An account holds
//! `balance` (posted), `held` (the sum of its open holds) and `floor`; what a debit or a
//! reserve may take is `available = balance - held - floor`, so no debit, reserve or capture
//! ever leaves `balance - held` below the floor. (A new account starts at 0, below a
//! non-zero floor: only credits move it up.) One amount is at most
//! [`AMOUNT_MAX`] (`i64::MAX`): a negative number sent as unsigned is refused, not
//! mistaken for a huge debit.
//!
//! # Holds
//! `Reserve(amount, ttl_ms)` moves nothing yet: it adds `amount` to `held` and answers a
//! [`HoldId`]. `Capture(hold, amount <= held amount)` debits `amount` and releases the hold;
//! `Void(hold)` releases it. A hold not resolved by `created + ttl_ms` (ledger time) expires:
//! at the start of the first command whose time reaches it, it is released with an
//! `Expire` entry in the trail, so expiry is a step of the log, equal on every replica.
//! A hold is resolved at most once; a resolved hold is remembered (for a clear error) for as
//! long as idempotency keys are.
//!
//! # Idempotency
//! Every operation carries a client key, scoped to the account's tenant (two tenants never
//! see each other's keys). The first operation under a key that commits a result
//! (`Approved` or `InsufficientFunds`) stores that result; a later operation with the same
//! key and the same parameters gets the stored result back, marked `replayed`, and changes
//! nothing; the same key with other parameters is refused ([`OperationError::KeyReused`]).
//! A refused operation (an error, e.g. unknown account) stores nothing, so a retry after the
//! cause is fixed may succeed. A key is kept for the `key_retention_ms` the command carries
//! (the node's setting, 24 h by default) after its first commit, then forgotten by a
//! deterministic sweep at the start of the first command whose time reaches it (every due
//! key, oldest first; each key is swept once, so the work is bounded by the commits that
//! made the keys): a retry later than that applies again.
//!
//! # Storage
//! A key's record is the trail entry that committed it, so keys are not stored apart: the
//! trail is handed out (and stored) as one [`TrailBlock`] per command, with the command's
//! retention, and [`BillingLedger::from_parts`] rebuilds the keys from it. One store write
//! per command instead of two per operation is what lets a batch of a thousand debits
//! commit in one step.
//!
//! # Audit trail
//! Every committed result and every hold expiry appends one [`AuditEntry`] (sequence, ledger
//! index, time, caller, key, operation, amounts, balance and held before and after). Entries
//! are never changed or removed. [`verify_trail`] recomputes every account from the trail
//! alone and fails on the first inconsistency (`quotamesh billing verify`).
//!
//! # Bad input
//! Each operation is checked on its own: a bad one gets an error value and changes nothing,
//! the others of the command proceed.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::core::digest::Fnv1a;

/// Largest amount of one operation: `i64::MAX`, so a negative number cast to `u64` by a
/// client is refused instead of being read as a huge amount.
pub const AMOUNT_MAX: u64 = i64::MAX as u64;
/// Longest tenant name, in bytes.
pub const TENANT_BYTES_MAX: usize = 128;
/// Longest meter name, in bytes.
pub const METER_BYTES_MAX: usize = 128;
/// Longest idempotency key, in bytes.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 128;
/// Longest caller name (the authenticated token's name), in bytes.
pub const CALLER_BYTES_MAX: usize = 64;
/// Longest hold TTL: 30 days.
pub const HOLD_TTL_MS_MAX: u64 = 30 * 24 * 3600 * 1000;
/// Shortest key retention a command may carry: one minute.
pub const KEY_RETENTION_MS_MIN: u64 = 60 * 1000;
/// Longest key retention a command may carry: 30 days.
pub const KEY_RETENTION_MS_MAX: u64 = 30 * 24 * 3600 * 1000;
/// Default key retention: 24 hours.
pub const KEY_RETENTION_MS_DEFAULT: u64 = 24 * 3600 * 1000;
/// Most operations in one command; the billing service batches concurrent requests.
pub const OPERATIONS_PER_COMMAND_MAX: usize = 1024;
/// Most accounts the ledger holds.
pub const ACCOUNTS_MAX: usize = 1_000_000;
/// Most holds remembered at once (open, and resolved ones kept for clear errors).
pub const HOLDS_MAX: usize = 1_000_000;
/// Most idempotency keys remembered at once; a new key beyond it is refused, never evicted
/// early (evicting early would break exactly-once).
pub const KEYS_MAX: usize = 10_000_000;
/// Most audit entries. The trail lives in memory and in every snapshot; beyond this bound
/// the ledger refuses new operations (fail-closed) until the trail is archived (not yet
/// built). About 150 bytes each in memory.
pub const AUDIT_ENTRIES_MAX: u64 = 4_000_000;
/// Most resolved holds forgotten by one command, so one apply does bounded work;
/// forgetting late only keeps them longer (they are stored records, equal on every replica).
pub const SWEEP_PER_COMMAND_MAX: usize = 4096;
/// The caller named in the trail for entries the ledger makes itself (hold expiry).
pub const LEDGER_CALLER: &str = "ledger";

const _: () = assert!(KEY_RETENTION_MS_MIN <= KEY_RETENTION_MS_DEFAULT);
const _: () = assert!(KEY_RETENTION_MS_DEFAULT <= KEY_RETENTION_MS_MAX);
const _: () = assert!(SWEEP_PER_COMMAND_MAX > 0);
const _: () = assert!(LEDGER_CALLER.len() <= CALLER_BYTES_MAX);

/// An account: one meter of one tenant.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AccountId {
    /// The tenant that owns the account; tokens are granted per tenant.
    pub tenant: String,
    /// What the account counts (e.g. `api-calls`, `gpu-seconds`).
    pub meter: String,
}

impl AccountId {
    /// An account id from its parts (not validated; see [`AccountId::check`]).
    pub fn new(tenant: impl Into<String>, meter: impl Into<String>) -> Self {
        Self { tenant: tenant.into(), meter: meter.into() }
    }

    /// Checks both parts: 1 to [`TENANT_BYTES_MAX`] / [`METER_BYTES_MAX`] bytes of
    /// `[A-Za-z0-9._:-]`.
    ///
    /// # Errors
    /// [`InvalidOperation::Account`] naming the bad part.
    pub fn check(&self) -> Result<(), InvalidOperation> {
        check_name("tenant", &self.tenant, TENANT_BYTES_MAX)?;
        check_name("meter", &self.meter, METER_BYTES_MAX)
    }
}

impl std::fmt::Display for AccountId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.tenant, self.meter)
    }
}

fn check_name(field: &'static str, name: &str, bytes_max: usize) -> Result<(), InvalidOperation> {
    let valid_byte = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-');
    if name.is_empty() || name.len() > bytes_max || !name.bytes().all(valid_byte) {
        return Err(InvalidOperation::Account { field: field.to_owned(), bytes_max });
    }
    Ok(())
}

/// A hold made by `Reserve`, unique in the ledger (a counter, never reused).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct HoldId(pub u64);

impl std::fmt::Display for HoldId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A client's idempotency key: 1 to [`IDEMPOTENCY_KEY_BYTES_MAX`] bytes of visible ASCII.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IdempotencyKey(pub String);

impl IdempotencyKey {
    /// Checks length and characters.
    ///
    /// # Errors
    /// [`InvalidOperation::Key`].
    pub fn check(&self) -> Result<(), InvalidOperation> {
        let key = &self.0;
        if key.is_empty()
            || key.len() > IDEMPOTENCY_KEY_BYTES_MAX
            || !key.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(InvalidOperation::Key { bytes: key.len() });
        }
        Ok(())
    }
}

impl std::fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// What a client asks for; together with the key, the parameters a replay must match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum OperationRequest {
    /// Opens an account with a zero balance.
    CreateAccount {
        /// The account.
        account: AccountId,
        /// The balance never goes below this (0 by default).
        floor: u64,
    },
    /// Adds to the balance (a top-up or grant).
    Credit {
        /// The account.
        account: AccountId,
        /// 1 to [`AMOUNT_MAX`].
        amount: u64,
    },
    /// Takes from the balance when `available` allows, else `InsufficientFunds`.
    Debit {
        /// The account.
        account: AccountId,
        /// 1 to [`AMOUNT_MAX`].
        amount: u64,
    },
    /// Holds an amount for later capture, when `available` allows.
    Reserve {
        /// The account.
        account: AccountId,
        /// 1 to [`AMOUNT_MAX`].
        amount: u64,
        /// The hold expires this long after it is committed (ledger time).
        ttl_ms: u64,
    },
    /// Debits up to the held amount and releases the hold.
    Capture {
        /// The hold's account (authorization is per tenant, so it is named).
        account: AccountId,
        /// The hold.
        hold: HoldId,
        /// 1 to the held amount.
        amount: u64,
    },
    /// Releases a hold without debiting.
    Void {
        /// The hold's account.
        account: AccountId,
        /// The hold.
        hold: HoldId,
    },
}

impl OperationRequest {
    /// The account the operation touches.
    pub fn account(&self) -> &AccountId {
        match self {
            Self::CreateAccount { account, .. }
            | Self::Credit { account, .. }
            | Self::Debit { account, .. }
            | Self::Reserve { account, .. }
            | Self::Capture { account, .. }
            | Self::Void { account, .. } => account,
        }
    }

    /// The operation's kind.
    pub fn kind(&self) -> OperationKind {
        match self {
            Self::CreateAccount { .. } => OperationKind::CreateAccount,
            Self::Credit { .. } => OperationKind::Credit,
            Self::Debit { .. } => OperationKind::Debit,
            Self::Reserve { .. } => OperationKind::Reserve,
            Self::Capture { .. } => OperationKind::Capture,
            Self::Void { .. } => OperationKind::Void,
        }
    }

    /// Checks what can be checked without state: names, amounts, TTL.
    ///
    /// # Errors
    /// [`InvalidOperation`] naming the bad field.
    pub fn check(&self) -> Result<(), InvalidOperation> {
        self.account().check()?;
        let amount = match self {
            Self::CreateAccount { floor, .. } => {
                return if *floor > AMOUNT_MAX {
                    Err(InvalidOperation::Floor(*floor))
                } else {
                    Ok(())
                };
            }
            Self::Void { .. } => return Ok(()),
            Self::Reserve { ttl_ms, amount, .. } => {
                if *ttl_ms == 0 || *ttl_ms > HOLD_TTL_MS_MAX {
                    return Err(InvalidOperation::HoldTtl(*ttl_ms));
                }
                *amount
            }
            Self::Credit { amount, .. } | Self::Debit { amount, .. } => *amount,
            Self::Capture { amount, .. } => *amount,
        };
        if amount == 0 || amount > AMOUNT_MAX {
            return Err(InvalidOperation::Amount(amount));
        }
        Ok(())
    }
}

/// The kinds of audit entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum OperationKind {
    /// `CreateAccount`.
    CreateAccount,
    /// `Credit`.
    Credit,
    /// `Debit`.
    Debit,
    /// `Reserve`.
    Reserve,
    /// `Capture`.
    Capture,
    /// `Void`.
    Void,
    /// A hold released by the ledger when its TTL ran out.
    Expire,
}

impl OperationKind {
    /// The lower-case name used in JSON and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CreateAccount => "create_account",
            Self::Credit => "credit",
            Self::Debit => "debit",
            Self::Reserve => "reserve",
            Self::Capture => "capture",
            Self::Void => "void",
            Self::Expire => "expire",
        }
    }
}

/// One client operation inside a command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Operation {
    /// Who asked (the authenticated token's name), for the trail.
    pub caller: String,
    /// The client's idempotency key.
    pub key: IdempotencyKey,
    /// What is asked.
    pub request: OperationRequest,
}

/// A command of the billing group's log: a batch of operations, applied in order.
///
/// An empty batch changes nothing but time: a follower commits one as a read barrier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BillingCommand {
    /// Ledger time, stamped by the leader that proposed it (`ledger_time.rs`); what the
    /// proposer puts here is overwritten.
    pub now_ms: u64,
    /// How long keys first committed by this command are kept (the proposer's setting,
    /// carried in the log so every replica forgets them at the same point).
    pub key_retention_ms: u64,
    /// At most [`OPERATIONS_PER_COMMAND_MAX`].
    pub operations: Vec<Operation>,
}

/// A committed result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// Applied.
    Approved,
    /// Not applied: `available` was below the amount. Committed and remembered like an
    /// approval, so a retry cannot flip it.
    InsufficientFunds,
}

/// What an operation committed (or, `replayed`, what it had committed first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// The result of the original commit.
    pub decision: Decision,
    /// True when this answer replays the result stored under the key; nothing was applied.
    pub replayed: bool,
    /// The account's balance right after the original commit.
    pub balance_after: u64,
    /// The account's held amount right after the original commit.
    pub held_after: u64,
    /// The account's floor.
    pub floor: u64,
    /// The log index of the original commit.
    pub ledger_index: u64,
    /// The trail entry of the original commit.
    pub entry_sequence: u64,
    /// The hold a `Reserve` made.
    pub hold: Option<HoldId>,
}

/// Why an operation was refused before any state was looked at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum InvalidOperation {
    /// A tenant or meter name is empty, too long or has other characters.
    #[error("{field} must be 1 to {bytes_max} bytes of [A-Za-z0-9._:-]")]
    Account {
        /// `tenant` or `meter`.
        field: String,
        /// Its bound.
        bytes_max: usize,
    },
    /// The idempotency key is empty, too long or not visible ASCII.
    #[error(
        "idempotency key must be 1 to {IDEMPOTENCY_KEY_BYTES_MAX} bytes of visible ASCII, got {bytes} bytes"
    )]
    Key {
        /// Its length.
        bytes: usize,
    },
    /// An amount is 0 or above [`AMOUNT_MAX`] (a negative number sent as unsigned lands there).
    #[error("amount must be between 1 and {AMOUNT_MAX}, got {0}")]
    Amount(u64),
    /// A floor above [`AMOUNT_MAX`].
    #[error("floor must be at most {AMOUNT_MAX}, got {0}")]
    Floor(u64),
    /// A hold TTL of 0 or above [`HOLD_TTL_MS_MAX`].
    #[error("hold TTL must be between 1 and {HOLD_TTL_MS_MAX} ms, got {0} ms")]
    HoldTtl(u64),
    /// The caller name is empty or too long.
    #[error("caller must be 1 to {CALLER_BYTES_MAX} bytes")]
    Caller,
}

/// Why an operation was refused; it changed nothing and stored nothing under its key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum OperationError {
    /// Bad input.
    #[error(transparent)]
    Invalid(#[from] InvalidOperation),
    /// The command carried more than [`OPERATIONS_PER_COMMAND_MAX`] operations or a key
    /// retention out of range; none of its operations was applied.
    #[error("the command is malformed: {0}")]
    Command(String),
    /// The key was used before with other parameters.
    #[error("idempotency key {key:?} was used before for a different {previous:?} operation")]
    KeyReused {
        /// The key.
        key: String,
        /// What it was used for.
        previous: OperationKind,
    },
    /// No such account.
    #[error("account {0} does not exist")]
    AccountNotFound(AccountId),
    /// `CreateAccount` for an account that exists (under another key).
    #[error("account {0} already exists")]
    AccountExists(AccountId),
    /// No such hold on this account (never made, or forgotten long after it was resolved).
    #[error("hold {hold} does not exist on account {account}")]
    HoldNotFound {
        /// The hold.
        hold: HoldId,
        /// The account named.
        account: AccountId,
    },
    /// The hold expired before this operation; its amount was released.
    #[error("hold {0} expired")]
    HoldExpired(HoldId),
    /// The hold was already captured or voided.
    #[error("hold {hold} was already {state}")]
    HoldResolved {
        /// The hold.
        hold: HoldId,
        /// `captured` or `voided`.
        state: String,
    },
    /// A capture above the held amount.
    #[error("capture of {amount} exceeds the {held} held by hold {hold}")]
    CaptureExceedsHold {
        /// The hold.
        hold: HoldId,
        /// What was asked.
        amount: u64,
        /// What is held.
        held: u64,
    },
    /// A credit that would take the balance past `u64::MAX`.
    #[error("credit of {amount} would overflow the balance {balance} of {account}")]
    BalanceOverflow {
        /// The account.
        account: AccountId,
        /// Its balance.
        balance: u64,
        /// The credit asked.
        amount: u64,
    },
    /// A bound of the ledger is reached ([`ACCOUNTS_MAX`], [`HOLDS_MAX`], [`KEYS_MAX`],
    /// [`AUDIT_ENTRIES_MAX`]); nothing was applied.
    #[error("the billing ledger is full: {0}")]
    Full(String),
}

/// What applying one command answers: one result per operation, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BillingResponse {
    /// The command's log index (0 for entries that carry no command).
    pub ledger_index: u64,
    /// One per operation.
    pub outcomes: Vec<Result<Outcome, OperationError>>,
}

/// One account's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Account {
    /// Posted balance.
    pub balance: u64,
    /// Sum of the open holds.
    pub held: u64,
    /// The balance never goes below this.
    pub floor: u64,
}

impl Account {
    /// What a debit or reserve may take: `balance - held - floor`.
    pub fn available(&self) -> u64 {
        self.balance.saturating_sub(self.held).saturating_sub(self.floor)
    }
}

/// Where a hold stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HoldState {
    /// Counted in the account's `held` until `expires_at_ms`.
    Open,
    /// Captured for this amount.
    Captured(u64),
    /// Voided.
    Voided,
    /// Released at expiry.
    Expired,
}

/// A hold and what became of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    /// Its account.
    pub account: AccountId,
    /// The amount held.
    pub amount: u64,
    /// Ledger time at which an open hold expires.
    pub expires_at_ms: u64,
    /// Where it stands.
    pub state: HoldState,
    /// Ledger time after which a resolved hold is forgotten (0 while open).
    pub forget_at_ms: u64,
}

/// The record kept under a (tenant, key), in memory; rebuilt from its trail entry on load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// The parameters of the original operation.
    pub request: OperationRequest,
    /// Its committed outcome (`replayed` false).
    pub outcome: Outcome,
    /// Ledger time after which the key is forgotten.
    pub forget_at_ms: u64,
}

/// One entry of the audit trail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Position in the trail, from 0, without gaps.
    pub sequence: u64,
    /// The log index of the command that made it.
    pub ledger_index: u64,
    /// Ledger time of that command.
    pub time_ms: u64,
    /// Who asked ([`LEDGER_CALLER`] for expiries).
    pub caller: String,
    /// The client's key (`None` for expiries).
    pub key: Option<IdempotencyKey>,
    /// What happened.
    pub kind: OperationKind,
    /// The account.
    pub account: AccountId,
    /// The amount asked (the floor for `CreateAccount`, the held amount for `Void` and
    /// `Expire`).
    pub amount: u64,
    /// The hold concerned, if any.
    pub hold: Option<HoldId>,
    /// The TTL a `Reserve` asked for.
    pub ttl_ms: Option<u64>,
    /// The result.
    pub decision: Decision,
    /// Balance before.
    pub balance_before: u64,
    /// Balance after.
    pub balance_after: u64,
    /// Held amount before.
    pub held_before: u64,
    /// Held amount after.
    pub held_after: u64,
}

/// Small bookkeeping values stored as one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LedgerClock {
    /// Ledger time: the greatest `now_ms` applied.
    pub last_seen_ms: u64,
    /// The next hold id to hand out.
    pub next_hold: u64,
}

/// The trail entries one command appended, with the key retention it carried (which says
/// when the keys of these entries are forgotten).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrailBlock {
    /// The command's `key_retention_ms`.
    pub key_retention_ms: u64,
    /// Its entries, in order, without gaps.
    pub entries: Vec<AuditEntry>,
}

/// What changed since the last [`BillingLedger::take_changes`]: `None` values were removed.
#[derive(Debug, Default)]
pub struct BillingChanges {
    /// The clock record, when it changed.
    pub clock: Option<LedgerClock>,
    /// Changed accounts.
    pub accounts: Vec<(AccountId, Option<Account>)>,
    /// Changed holds.
    pub holds: Vec<(HoldId, Option<Hold>)>,
    /// New trail entries, one block per command that appended any.
    pub blocks: Vec<TrailBlock>,
}

/// Why a ledger could not be rebuilt from its records.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("inconsistent billing records: {0}")]
pub struct LoadError(pub String);

/// The billing ledger of a region.
#[derive(Debug, Clone, Default)]
pub struct BillingLedger {
    clock: LedgerClock,
    accounts: BTreeMap<AccountId, Account>,
    holds: BTreeMap<HoldId, Hold>,
    /// Open holds by expiry, for the sweep.
    open_by_expiry: BTreeSet<(u64, HoldId)>,
    /// Resolved holds by forget time, for the sweep.
    resolved_by_forget: BTreeSet<(u64, HoldId)>,
    keys: BTreeMap<(String, IdempotencyKey), KeyRecord>,
    keys_by_forget: BTreeSet<(u64, String, IdempotencyKey)>,
    trail: Vec<AuditEntry>,
    changed_clock: bool,
    changed_accounts: BTreeSet<AccountId>,
    changed_holds: BTreeSet<HoldId>,
    /// Trail ranges (start, end, retention) appended by commands since `take_changes`.
    untaken_blocks: Vec<(usize, usize, u64)>,
}

impl BillingLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuilds a ledger from stored parts (what [`Self::take_changes`] handed out).
    ///
    /// The idempotency keys are rebuilt from the trail: every keyed entry whose key is not
    /// yet forgotten at the clock's time (the sweep forgets every due key at the start of a
    /// command, so this is exactly the set a running replica holds).
    ///
    /// # Errors
    /// [`LoadError`] when the parts contradict each other (trail gaps, holds of unknown
    /// accounts, `held` sums that do not match the open holds).
    pub fn from_parts(
        clock: LedgerClock,
        accounts: impl IntoIterator<Item = (AccountId, Account)>,
        holds: impl IntoIterator<Item = (HoldId, Hold)>,
        blocks: impl IntoIterator<Item = TrailBlock>,
    ) -> Result<Self, LoadError> {
        let mut ledger = Self { clock, ..Self::default() };
        ledger.accounts = accounts.into_iter().collect();
        let mut held_sums: BTreeMap<AccountId, u64> = BTreeMap::new();
        for (id, hold) in holds {
            if !ledger.accounts.contains_key(&hold.account) {
                return Err(LoadError(format!("hold {id} of unknown account {}", hold.account)));
            }
            match hold.state {
                HoldState::Open => {
                    let sum = held_sums.entry(hold.account.clone()).or_default();
                    *sum = sum.checked_add(hold.amount).ok_or_else(|| {
                        LoadError(format!("held amounts of {} overflow", hold.account))
                    })?;
                    ledger.open_by_expiry.insert((hold.expires_at_ms, id));
                }
                HoldState::Captured(_) | HoldState::Voided | HoldState::Expired => {
                    ledger.resolved_by_forget.insert((hold.forget_at_ms, id));
                }
            }
            ledger.holds.insert(id, hold);
        }
        for (id, account) in &ledger.accounts {
            let held = held_sums.get(id).copied().unwrap_or(0);
            if account.held != held {
                return Err(LoadError(format!(
                    "account {id} holds {} but its open holds sum to {held}",
                    account.held
                )));
            }
        }
        for block in blocks {
            for entry in block.entries {
                let position = ledger.trail.len();
                if entry.sequence != position as u64 {
                    return Err(LoadError(format!(
                        "trail entry {} found at position {position}",
                        entry.sequence
                    )));
                }
                let forget_at_ms = entry.time_ms.saturating_add(block.key_retention_ms);
                if forget_at_ms > ledger.clock.last_seen_ms
                    && let Some(key) = entry.key.clone()
                    && let Some(request) = request_of(&entry)
                {
                    let floor = ledger.accounts.get(&entry.account).map_or(0, |a| a.floor);
                    let outcome = outcome_of(&entry, floor);
                    let id = (entry.account.tenant.clone(), key);
                    ledger.keys_by_forget.insert((forget_at_ms, id.0.clone(), id.1.clone()));
                    if let Some(previous) =
                        ledger.keys.insert(id.clone(), KeyRecord { request, outcome, forget_at_ms })
                    {
                        ledger.keys_by_forget.remove(&(previous.forget_at_ms, id.0, id.1));
                    }
                }
                ledger.trail.push(entry);
            }
        }
        Ok(ledger)
    }

    /// Applies one committed command at log index `ledger_index`.
    pub fn apply(&mut self, ledger_index: u64, command: &BillingCommand) -> BillingResponse {
        if command.operations.len() > OPERATIONS_PER_COMMAND_MAX
            || !(KEY_RETENTION_MS_MIN..=KEY_RETENTION_MS_MAX).contains(&command.key_retention_ms)
        {
            // Refused as a whole before anything, even time, moves.
            let reason = format!(
                "{} operations (at most {OPERATIONS_PER_COMMAND_MAX}), key retention {} ms \
                 (between {KEY_RETENTION_MS_MIN} and {KEY_RETENTION_MS_MAX})",
                command.operations.len(),
                command.key_retention_ms
            );
            let outcomes = command
                .operations
                .iter()
                .map(|_| Err(OperationError::Command(reason.clone())))
                .collect();
            return BillingResponse { ledger_index, outcomes };
        }
        let trail_before = self.trail.len();
        let now_ms = self.advance(command.now_ms);
        self.expire_holds(ledger_index, now_ms, command.key_retention_ms);
        self.forget_expired(now_ms);
        let outcomes = command
            .operations
            .iter()
            .map(|operation| {
                self.apply_operation(ledger_index, now_ms, command.key_retention_ms, operation)
            })
            .collect();
        if self.trail.len() > trail_before {
            self.untaken_blocks.push((trail_before, self.trail.len(), command.key_retention_ms));
        }
        BillingResponse { ledger_index, outcomes }
    }

    fn advance(&mut self, now_ms: u64) -> u64 {
        if now_ms > self.clock.last_seen_ms {
            self.clock.last_seen_ms = now_ms;
            self.changed_clock = true;
        }
        self.clock.last_seen_ms
    }

    /// Releases every open hold whose time has come, in (expiry, id) order.
    fn expire_holds(&mut self, ledger_index: u64, now_ms: u64, retention_ms: u64) {
        while let Some(&(expires_at_ms, id)) = self.open_by_expiry.first() {
            if expires_at_ms > now_ms {
                break;
            }
            self.open_by_expiry.pop_first();
            self.release_hold(ledger_index, now_ms, id, HoldState::Expired, None, retention_ms);
        }
    }

    /// Forgets every key past its time, and resolved holds past theirs (a bounded number),
    /// oldest first.
    fn forget_expired(&mut self, now_ms: u64) {
        // All due keys, not a bounded number: a replica rebuilt from the trail holds exactly
        // the keys not yet due, so a running one must too.
        while let Some((forget_at_ms, _, _)) = self.keys_by_forget.first() {
            if *forget_at_ms > now_ms {
                break;
            }
            if let Some((_, tenant, key)) = self.keys_by_forget.pop_first() {
                self.keys.remove(&(tenant, key));
            }
        }
        for _ in 0..SWEEP_PER_COMMAND_MAX {
            match self.resolved_by_forget.first() {
                Some(&(forget_at_ms, id)) if forget_at_ms <= now_ms => {
                    self.resolved_by_forget.pop_first();
                    self.holds.remove(&id);
                    self.changed_holds.insert(id);
                }
                _ => break,
            }
        }
    }

    /// Ends an open hold (already out of `open_by_expiry`): releases its amount, debits
    /// `captured` if any, records the trail entry, and keeps the hold as resolved.
    fn release_hold(
        &mut self,
        ledger_index: u64,
        now_ms: u64,
        id: HoldId,
        state: HoldState,
        caller_and_key: Option<(&str, &IdempotencyKey)>,
        retention_ms: u64,
    ) -> Option<AuditEntry> {
        let hold = self.holds.get_mut(&id)?;
        let account_id = hold.account.clone();
        let account = self.accounts.get_mut(&account_id)?;
        let before = *account;
        let captured = match state {
            HoldState::Captured(amount) => amount,
            HoldState::Open | HoldState::Voided | HoldState::Expired => 0,
        };
        // Invariants: an open hold is counted in `held`, and `held <= balance - floor`.
        account.held = account.held.checked_sub(hold.amount).expect("an open hold is in held");
        account.balance =
            account.balance.checked_sub(captured).expect("a capture never exceeds its hold");
        let after = *account;
        let forget_at_ms = now_ms.saturating_add(retention_ms);
        hold.state = state;
        hold.forget_at_ms = forget_at_ms;
        let (kind, amount) = match state {
            HoldState::Captured(amount) => (OperationKind::Capture, amount),
            HoldState::Voided => (OperationKind::Void, hold.amount),
            HoldState::Open | HoldState::Expired => (OperationKind::Expire, hold.amount),
        };
        self.resolved_by_forget.insert((forget_at_ms, id));
        self.changed_holds.insert(id);
        self.changed_accounts.insert(account_id.clone());
        let (caller, key) = match caller_and_key {
            Some((caller, key)) => (caller.to_owned(), Some(key.clone())),
            None => (LEDGER_CALLER.to_owned(), None),
        };
        Some(self.append_entry(AuditEntry {
            sequence: 0,
            ledger_index,
            time_ms: now_ms,
            caller,
            key,
            kind,
            account: account_id,
            amount,
            hold: Some(id),
            ttl_ms: None,
            decision: Decision::Approved,
            balance_before: before.balance,
            balance_after: after.balance,
            held_before: before.held,
            held_after: after.held,
        }))
    }

    fn append_entry(&mut self, mut entry: AuditEntry) -> AuditEntry {
        entry.sequence = self.trail.len() as u64;
        self.trail.push(entry.clone());
        entry
    }

    fn apply_operation(
        &mut self,
        ledger_index: u64,
        now_ms: u64,
        retention_ms: u64,
        operation: &Operation,
    ) -> Result<Outcome, OperationError> {
        if operation.caller.is_empty() || operation.caller.len() > CALLER_BYTES_MAX {
            return Err(InvalidOperation::Caller.into());
        }
        operation.key.check()?;
        let request = &operation.request;
        request.check()?;
        let key_id = (request.account().tenant.clone(), operation.key.clone());
        if let Some(record) = self.keys.get(&key_id) {
            if record.request == *request {
                return Ok(Outcome { replayed: true, ..record.outcome });
            }
            return Err(OperationError::KeyReused {
                key: operation.key.0.clone(),
                previous: record.request.kind(),
            });
        }
        if self.keys.len() >= KEYS_MAX {
            return Err(OperationError::Full("idempotency keys".to_owned()));
        }
        // An operation appends at most one entry, and a capture or void of an expired hold
        // one more; refuse while there is no room for both.
        if self.trail.len() as u64 + 2 > AUDIT_ENTRIES_MAX {
            return Err(OperationError::Full("audit trail".to_owned()));
        }
        let caller_and_key = (operation.caller.as_str(), &operation.key);
        let entry = match request {
            OperationRequest::CreateAccount { account, floor } => {
                self.create_account(account, *floor)?;
                let before = Account { balance: 0, held: 0, floor: *floor };
                self.entry_from(
                    ledger_index,
                    now_ms,
                    caller_and_key,
                    request,
                    *floor,
                    None,
                    Decision::Approved,
                    before,
                )
            }
            OperationRequest::Credit { account, amount } => {
                let current = self.account(account)?;
                let balance = current.balance.checked_add(*amount).ok_or_else(|| {
                    OperationError::BalanceOverflow {
                        account: account.clone(),
                        balance: current.balance,
                        amount: *amount,
                    }
                })?;
                let before = current;
                self.set_account(account, Account { balance, ..current });
                self.entry_from(
                    ledger_index,
                    now_ms,
                    caller_and_key,
                    request,
                    *amount,
                    None,
                    Decision::Approved,
                    before,
                )
            }
            OperationRequest::Debit { account, amount } => {
                let current = self.account(account)?;
                let decision = if current.available() >= *amount {
                    let balance = current.balance - amount;
                    self.set_account(account, Account { balance, ..current });
                    Decision::Approved
                } else {
                    Decision::InsufficientFunds
                };
                self.entry_from(
                    ledger_index,
                    now_ms,
                    caller_and_key,
                    request,
                    *amount,
                    None,
                    decision,
                    current,
                )
            }
            OperationRequest::Reserve { account, amount, ttl_ms } => {
                let current = self.account(account)?;
                if current.available() < *amount {
                    self.entry_from(
                        ledger_index,
                        now_ms,
                        caller_and_key,
                        request,
                        *amount,
                        None,
                        Decision::InsufficientFunds,
                        current,
                    )
                } else {
                    if self.holds.len() >= HOLDS_MAX {
                        return Err(OperationError::Full("holds".to_owned()));
                    }
                    let id = HoldId(self.clock.next_hold);
                    self.clock.next_hold += 1;
                    self.changed_clock = true;
                    let expires_at_ms = now_ms.saturating_add(*ttl_ms);
                    self.holds.insert(
                        id,
                        Hold {
                            account: account.clone(),
                            amount: *amount,
                            expires_at_ms,
                            state: HoldState::Open,
                            forget_at_ms: 0,
                        },
                    );
                    self.open_by_expiry.insert((expires_at_ms, id));
                    self.changed_holds.insert(id);
                    // available >= amount, so held + amount <= balance - floor: no overflow.
                    let held = current.held + amount;
                    self.set_account(account, Account { held, ..current });
                    self.entry_from(
                        ledger_index,
                        now_ms,
                        caller_and_key,
                        request,
                        *amount,
                        Some(id),
                        Decision::Approved,
                        current,
                    )
                }
            }
            OperationRequest::Capture { account, hold, amount } => {
                let held = self.open_hold(account, *hold)?;
                if *amount > held {
                    return Err(OperationError::CaptureExceedsHold {
                        hold: *hold,
                        amount: *amount,
                        held,
                    });
                }
                self.resolve_open_hold(
                    ledger_index,
                    now_ms,
                    *hold,
                    HoldState::Captured(*amount),
                    caller_and_key,
                    retention_ms,
                )
            }
            OperationRequest::Void { account, hold } => {
                self.open_hold(account, *hold)?;
                self.resolve_open_hold(
                    ledger_index,
                    now_ms,
                    *hold,
                    HoldState::Voided,
                    caller_and_key,
                    retention_ms,
                )
            }
        };
        let outcome = outcome_of(&entry, self.accounts.get(&entry.account).map_or(0, |a| a.floor));
        let forget_at_ms = now_ms.saturating_add(retention_ms);
        self.keys_by_forget.insert((forget_at_ms, key_id.0.clone(), key_id.1.clone()));
        self.keys.insert(key_id, KeyRecord { request: request.clone(), outcome, forget_at_ms });
        Ok(outcome)
    }

    fn create_account(&mut self, account: &AccountId, floor: u64) -> Result<(), OperationError> {
        if self.accounts.contains_key(account) {
            return Err(OperationError::AccountExists(account.clone()));
        }
        if self.accounts.len() >= ACCOUNTS_MAX {
            return Err(OperationError::Full("accounts".to_owned()));
        }
        self.set_account(account, Account { balance: 0, held: 0, floor });
        Ok(())
    }

    fn account(&self, account: &AccountId) -> Result<Account, OperationError> {
        self.accounts
            .get(account)
            .copied()
            .ok_or_else(|| OperationError::AccountNotFound(account.clone()))
    }

    fn set_account(&mut self, id: &AccountId, account: Account) {
        self.accounts.insert(id.clone(), account);
        self.changed_accounts.insert(id.clone());
    }

    /// The held amount of an open hold of `account`; a resolved hold is an error.
    fn open_hold(&self, account: &AccountId, id: HoldId) -> Result<u64, OperationError> {
        let Some(hold) = self.holds.get(&id).filter(|hold| hold.account == *account) else {
            return Err(OperationError::HoldNotFound { hold: id, account: account.clone() });
        };
        // The sweep at the start of the command released every hold past its expiry, so an
        // open hold here is still valid at this command's time.
        match hold.state {
            HoldState::Open => Ok(hold.amount),
            HoldState::Expired => Err(OperationError::HoldExpired(id)),
            HoldState::Captured(_) => {
                Err(OperationError::HoldResolved { hold: id, state: "captured".to_owned() })
            }
            HoldState::Voided => {
                Err(OperationError::HoldResolved { hold: id, state: "voided".to_owned() })
            }
        }
    }

    fn resolve_open_hold(
        &mut self,
        ledger_index: u64,
        now_ms: u64,
        id: HoldId,
        state: HoldState,
        caller_and_key: (&str, &IdempotencyKey),
        retention_ms: u64,
    ) -> AuditEntry {
        let expires_at_ms = self.holds.get(&id).map_or(0, |hold| hold.expires_at_ms);
        self.open_by_expiry.remove(&(expires_at_ms, id));
        self.release_hold(ledger_index, now_ms, id, state, Some(caller_and_key), retention_ms)
            .expect("an open hold has its account")
    }

    // Every argument is one field of the entry; a struct for them would only rename it.
    #[allow(clippy::too_many_arguments)]
    fn entry_from(
        &mut self,
        ledger_index: u64,
        now_ms: u64,
        (caller, key): (&str, &IdempotencyKey),
        request: &OperationRequest,
        amount: u64,
        hold: Option<HoldId>,
        decision: Decision,
        before: Account,
    ) -> AuditEntry {
        let after = self.accounts.get(request.account()).copied().unwrap_or_default();
        self.append_entry(AuditEntry {
            sequence: 0,
            ledger_index,
            time_ms: now_ms,
            caller: caller.to_owned(),
            key: Some(key.clone()),
            kind: request.kind(),
            account: request.account().clone(),
            amount,
            hold,
            ttl_ms: match request {
                OperationRequest::Reserve { ttl_ms, .. } => Some(*ttl_ms),
                _ => None,
            },
            decision,
            balance_before: before.balance,
            balance_after: after.balance,
            held_before: before.held,
            held_after: after.held,
        })
    }

    /// Returns and forgets what changed since the last call.
    pub fn take_changes(&mut self) -> BillingChanges {
        let clock = std::mem::take(&mut self.changed_clock).then_some(self.clock);
        let accounts = std::mem::take(&mut self.changed_accounts)
            .into_iter()
            .map(|id| {
                let account = self.accounts.get(&id).copied();
                (id, account)
            })
            .collect();
        let holds = std::mem::take(&mut self.changed_holds)
            .into_iter()
            .map(|id| (id, self.holds.get(&id).cloned()))
            .collect();
        let blocks = std::mem::take(&mut self.untaken_blocks)
            .into_iter()
            .map(|(start, end, key_retention_ms)| TrailBlock {
                key_retention_ms,
                entries: self.trail[start..end].to_vec(),
            })
            .collect();
        BillingChanges { clock, accounts, holds, blocks }
    }

    /// Ledger time: the greatest `now_ms` applied.
    pub fn last_seen_ms(&self) -> u64 {
        self.clock.last_seen_ms
    }

    /// One account.
    pub fn account_state(&self, account: &AccountId) -> Option<Account> {
        self.accounts.get(account).copied()
    }

    /// All accounts in id order.
    pub fn accounts(&self) -> impl Iterator<Item = (&AccountId, &Account)> {
        self.accounts.iter()
    }

    /// One hold.
    pub fn hold(&self, id: HoldId) -> Option<&Hold> {
        self.holds.get(&id)
    }

    /// The record under a tenant's key, if still kept.
    pub fn key_record(&self, tenant: &str, key: &IdempotencyKey) -> Option<&KeyRecord> {
        self.keys.get(&(tenant.to_owned(), key.clone()))
    }

    /// How many keys are kept.
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// The whole trail, in order.
    pub fn trail(&self) -> &[AuditEntry] {
        &self.trail
    }

    /// The position of the first entry made at or after log index `ledger_index`.
    pub fn first_entry_at(&self, ledger_index: u64) -> u64 {
        self.trail.partition_point(|entry| entry.ledger_index < ledger_index) as u64
    }

    /// A digest of the whole state (FNV-1a over a canonical encoding): equal on replicas
    /// that applied the same commands, and unchanged by a save and reload.
    pub fn digest(&self) -> u64 {
        let mut digest = Fnv1a::default();
        digest.write_encoded(&self.clock);
        for (id, account) in &self.accounts {
            digest.write_encoded(&(id, account));
        }
        for (id, hold) in &self.holds {
            digest.write_encoded(&(id, hold));
        }
        for (id, record) in &self.keys {
            digest.write_encoded(&(id, record));
        }
        for entry in &self.trail {
            digest.write_encoded(entry);
        }
        digest.finish()
    }
}

/// The request a keyed trail entry committed (`None` for a ledger-made expiry).
fn request_of(entry: &AuditEntry) -> Option<OperationRequest> {
    let account = entry.account.clone();
    let amount = entry.amount;
    Some(match entry.kind {
        OperationKind::CreateAccount => OperationRequest::CreateAccount { account, floor: amount },
        OperationKind::Credit => OperationRequest::Credit { account, amount },
        OperationKind::Debit => OperationRequest::Debit { account, amount },
        OperationKind::Reserve => {
            OperationRequest::Reserve { account, amount, ttl_ms: entry.ttl_ms? }
        }
        OperationKind::Capture => OperationRequest::Capture { account, hold: entry.hold?, amount },
        OperationKind::Void => OperationRequest::Void { account, hold: entry.hold? },
        OperationKind::Expire => return None,
    })
}

/// The outcome a trail entry answered when it was committed.
fn outcome_of(entry: &AuditEntry, floor: u64) -> Outcome {
    Outcome {
        decision: entry.decision,
        replayed: false,
        balance_after: entry.balance_after,
        held_after: entry.held_after,
        floor,
        ledger_index: entry.ledger_index,
        entry_sequence: entry.sequence,
        hold: if entry.kind == OperationKind::Reserve { entry.hold } else { None },
    }
}

/// Why a trail does not add up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("trail entry {sequence}: {reason}")]
pub struct TrailError {
    /// The first entry found wrong.
    pub sequence: u64,
    /// What is wrong with it.
    pub reason: String,
}

/// An account as recomputed from the trail alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TrailAccount {
    /// Balance after the account's last entry.
    pub balance: u64,
    /// Held amount after its last entry.
    pub held: u64,
    /// Its floor (from `CreateAccount`).
    pub floor: u64,
}

/// Recomputes every account from a trail, checking each entry against the rules: entries
/// numbered without gaps; an account's first entry is its creation; each entry's `before`
/// is the previous entry's `after`; `after` follows from the operation and its amount;
/// no debit, reserve or capture leaves `balance - held` below the floor; an `Approved` debit
/// or reserve fit `available`, an `InsufficientFunds` one did not; every hold is made once,
/// resolved at most once, captured for at most its amount; no key has two entries on one
/// tenant within [`KEY_RETENTION_MS_MIN`]. The trail must start at sequence 0.
///
/// # Errors
/// [`TrailError`] at the first entry that breaks a rule.
pub fn verify_trail<'a>(
    entries: impl IntoIterator<Item = &'a AuditEntry>,
) -> Result<BTreeMap<AccountId, TrailAccount>, TrailError> {
    let mut accounts: BTreeMap<AccountId, TrailAccount> = BTreeMap::new();
    let mut open_holds: BTreeMap<HoldId, (AccountId, u64)> = BTreeMap::new();
    let mut resolved_holds: BTreeSet<HoldId> = BTreeSet::new();
    let mut key_times: BTreeMap<(String, IdempotencyKey), u64> = BTreeMap::new();
    for (position, entry) in entries.into_iter().enumerate() {
        let fail = |reason: String| TrailError { sequence: entry.sequence, reason };
        if entry.sequence != position as u64 {
            return Err(fail(format!("expected sequence {position}")));
        }
        if let Some(key) = &entry.key {
            // A key may come back only after it was forgotten, which is never sooner than
            // the shortest retention.
            let id = (entry.account.tenant.clone(), key.clone());
            if let Some(first_ms) = key_times.insert(id, entry.time_ms)
                && entry.time_ms < first_ms.saturating_add(KEY_RETENTION_MS_MIN)
            {
                return Err(fail(format!(
                    "key {key} has a second entry on tenant {} within the retention",
                    entry.account.tenant
                )));
            }
        }
        let previous = match (entry.kind, accounts.get(&entry.account)) {
            (OperationKind::CreateAccount, Some(_)) => {
                return Err(fail(format!("account {} created twice", entry.account)));
            }
            (OperationKind::CreateAccount, None) => {
                TrailAccount { floor: entry.amount, ..TrailAccount::default() }
            }
            (_, None) => {
                return Err(fail(format!("account {} used before creation", entry.account)));
            }
            (_, Some(account)) => *account,
        };
        if (entry.balance_before, entry.held_before) != (previous.balance, previous.held) {
            return Err(fail(format!(
                "before is balance {} held {}, but the previous entry left balance {} held {}",
                entry.balance_before, entry.held_before, previous.balance, previous.held
            )));
        }
        let available =
            previous.balance.saturating_sub(previous.held).saturating_sub(previous.floor);
        let mut expected = previous;
        let insufficient = entry.decision == Decision::InsufficientFunds;
        match entry.kind {
            OperationKind::CreateAccount => {}
            OperationKind::Credit => {
                expected.balance = previous
                    .balance
                    .checked_add(entry.amount)
                    .ok_or_else(|| fail("credit overflows".to_owned()))?;
            }
            OperationKind::Debit | OperationKind::Reserve => {
                if insufficient {
                    if entry.amount <= available {
                        return Err(fail(format!(
                            "refused for insufficient funds although {available} was available"
                        )));
                    }
                } else if entry.amount > available {
                    return Err(fail(format!(
                        "approved {} with only {available} available",
                        entry.amount
                    )));
                } else if entry.kind == OperationKind::Debit {
                    expected.balance = previous.balance - entry.amount;
                } else {
                    expected.held = previous.held + entry.amount;
                    let hold =
                        entry.hold.ok_or_else(|| fail("reserve without a hold".to_owned()))?;
                    if resolved_holds.contains(&hold)
                        || open_holds.insert(hold, (entry.account.clone(), entry.amount)).is_some()
                    {
                        return Err(fail(format!("hold {hold} made twice")));
                    }
                }
            }
            OperationKind::Capture | OperationKind::Void | OperationKind::Expire => {
                let hold = entry.hold.ok_or_else(|| fail("no hold named".to_owned()))?;
                let Some((account, held)) = open_holds.remove(&hold) else {
                    return Err(fail(format!("hold {hold} is not open")));
                };
                if account != entry.account {
                    return Err(fail(format!("hold {hold} belongs to {account}")));
                }
                resolved_holds.insert(hold);
                expected.held = previous
                    .held
                    .checked_sub(held)
                    .ok_or_else(|| fail("held goes negative".to_owned()))?;
                match entry.kind {
                    OperationKind::Capture => {
                        if entry.amount > held {
                            return Err(fail(format!(
                                "captured {} of a {held} hold",
                                entry.amount
                            )));
                        }
                        expected.balance = previous
                            .balance
                            .checked_sub(entry.amount)
                            .ok_or_else(|| fail("balance goes negative".to_owned()))?;
                    }
                    _ if entry.amount != held => {
                        return Err(fail(format!("released {} of a {held} hold", entry.amount)));
                    }
                    _ => {}
                }
            }
        }
        if insufficient
            && entry.kind != OperationKind::Debit
            && entry.kind != OperationKind::Reserve
        {
            return Err(fail(format!("{} cannot be refused for funds", entry.kind.as_str())));
        }
        if (entry.balance_after, entry.held_after) != (expected.balance, expected.held) {
            return Err(fail(format!(
                "after is balance {} held {}, but {} {} from balance {} held {} gives balance {} held {}",
                entry.balance_after,
                entry.held_after,
                entry.kind.as_str(),
                entry.amount,
                previous.balance,
                previous.held,
                expected.balance,
                expected.held
            )));
        }
        let takes = matches!(
            entry.kind,
            OperationKind::Debit | OperationKind::Reserve | OperationKind::Capture
        ) && !insufficient;
        if takes && expected.balance.saturating_sub(expected.held) < expected.floor
            || expected.held > 0 && expected.held > expected.balance.saturating_sub(expected.floor)
        {
            return Err(fail(format!(
                "balance {} held {} breaks the floor {}",
                expected.balance, expected.held, expected.floor
            )));
        }
        accounts.insert(entry.account.clone(), expected);
    }
    Ok(accounts)
}

#[cfg(test)]
#[path = "billing_tests.rs"]
mod tests;
