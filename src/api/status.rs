//! The one place where errors become gRPC statuses.
//!
//! Storage, quorum or overload trouble reaches Envoy as `UNAVAILABLE`, so the filter's
//! `failure_mode_deny` decides; never as an RLS `UNKNOWN` code, which Envoy lets through.
//!
//! Billing: a refused operation maps to the code that says why (`INVALID_ARGUMENT`,
//! `NOT_FOUND`, `ALREADY_EXISTS`, `FAILED_PRECONDITION`, `RESOURCE_EXHAUSTED`); an operation
//! without a commit is `UNAVAILABLE` (fail-closed, outcome unknown); a command the group
//! refuses as such was not applied and never will be: `RESOURCE_EXHAUSTED` when too large
//! (the gRPC convention), `FAILED_PRECONDITION` when the leader cannot read it; credentials
//! map to `UNAUTHENTICATED` and `PERMISSION_DENIED`.

use tonic::Status;

use crate::actors::shard::ShardError;
use crate::api::billing::auth::AuthError;
use crate::api::billing::proposer::ProposeError;
use crate::core::billing::OperationError;
use crate::ledger::{MembershipError, WriteError};

/// Why a `ShouldRateLimit` request was refused before any state was touched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidRequest {
    /// The domain is empty.
    #[error("domain must not be empty")]
    EmptyDomain,
    /// The domain is longer than allowed.
    #[error("domain is {0} bytes; at most {max} allowed", max = super::rls::FIELD_BYTES_MAX)]
    DomainTooLong(usize),
    /// No descriptors.
    #[error("at least one descriptor is required")]
    NoDescriptors,
    /// Too many descriptors.
    #[error("{0} descriptors; at most {max} allowed", max = super::rls::DESCRIPTORS_MAX)]
    TooManyDescriptors(usize),
    /// A descriptor has no entries.
    #[error("descriptor {0} has no entries")]
    EmptyDescriptor(usize),
    /// A descriptor has too many entries.
    #[error("descriptor {descriptor} has {entries} entries; at most {max} allowed", max = super::rls::ENTRIES_MAX)]
    TooManyEntries {
        /// Descriptor index.
        descriptor: usize,
        /// Its entry count.
        entries: usize,
    },
    /// An entry key is empty.
    #[error("descriptor {descriptor} entry {entry}: key must not be empty")]
    EmptyKey {
        /// Descriptor index.
        descriptor: usize,
        /// Entry index.
        entry: usize,
    },
    /// An entry key or value is too long.
    #[error("descriptor {descriptor} entry {entry}: {field} is {length} bytes; at most {max} allowed", max = super::rls::FIELD_BYTES_MAX)]
    FieldTooLong {
        /// Descriptor index.
        descriptor: usize,
        /// Entry index.
        entry: usize,
        /// `key` or `value`.
        field: &'static str,
        /// Its length.
        length: usize,
    },
    /// A descriptor's limit override cannot be applied.
    #[error("descriptor {descriptor}: limit override {reason}")]
    BadOverride {
        /// Descriptor index.
        descriptor: usize,
        /// What is wrong with it.
        reason: String,
    },
}

impl InvalidRequest {
    /// A short label for metrics.
    pub fn reason_label(&self) -> &'static str {
        match self {
            Self::EmptyDomain | Self::DomainTooLong(_) => "bad_domain",
            Self::NoDescriptors | Self::TooManyDescriptors(_) => "bad_descriptor_count",
            Self::EmptyDescriptor(_) | Self::TooManyEntries { .. } => "bad_entry_count",
            Self::EmptyKey { .. } | Self::FieldTooLong { .. } => "bad_entry",
            Self::BadOverride { .. } => "bad_override",
        }
    }
}

impl From<InvalidRequest> for Status {
    fn from(error: InvalidRequest) -> Self {
        Status::invalid_argument(error.to_string())
    }
}

impl From<ShardError> for Status {
    fn from(error: ShardError) -> Self {
        Status::unavailable(error.to_string())
    }
}

/// A ledger write that failed. Only outcomes known not to have applied the command are
/// definite codes; `UNAVAILABLE` and `DEADLINE_EXCEEDED` mean "unknown": the command may have
/// been applied, and a client must not count it as failed.
impl From<WriteError> for Status {
    fn from(error: WriteError) -> Self {
        match error {
            // The gRPC convention for a message over a size limit.
            WriteError::TooLarge { .. } => Status::resource_exhausted(error.to_string()),
            WriteError::Refused { .. } => Status::failed_precondition(error.to_string()),
            WriteError::Timeout => Status::deadline_exceeded(error.to_string()),
            WriteError::NoLeader | WriteError::LeaderLost { .. } | WriteError::Stopped(_) => {
                Status::unavailable(error.to_string())
            }
        }
    }
}

/// A membership change or group query that failed.
pub fn membership_status(error: MembershipError) -> Status {
    match error {
        MembershipError::AlreadyInitialized => Status::already_exists(error.to_string()),
        MembershipError::NotLeader { .. } | MembershipError::Refused(_) => {
            Status::failed_precondition(error.to_string())
        }
        MembershipError::Stopped(_) => Status::unavailable(error.to_string()),
    }
}

impl From<OperationError> for Status {
    fn from(error: OperationError) -> Self {
        let message = error.to_string();
        match error {
            OperationError::Invalid(_) | OperationError::Command(_) => {
                Status::invalid_argument(message)
            }
            OperationError::AccountNotFound(_) | OperationError::HoldNotFound { .. } => {
                Status::not_found(message)
            }
            OperationError::AccountExists(_) => Status::already_exists(message),
            OperationError::KeyReused { .. }
            | OperationError::HoldExpired(_)
            | OperationError::HoldResolved { .. }
            | OperationError::CaptureExceedsHold { .. }
            | OperationError::BalanceOverflow { .. } => Status::failed_precondition(message),
            OperationError::Full(_) => Status::resource_exhausted(message),
        }
    }
}

impl From<ProposeError> for Status {
    fn from(error: ProposeError) -> Self {
        match error {
            ProposeError::Refused(refused) => refused.into(),
            ProposeError::Rejected(rejected) => rejected.into(),
            ProposeError::Unavailable(_) | ProposeError::Stopped => {
                Status::unavailable(error.to_string())
            }
            ProposeError::Overloaded => Status::resource_exhausted(error.to_string()),
        }
    }
}

impl From<AuthError> for Status {
    fn from(error: AuthError) -> Self {
        match error {
            AuthError::Missing | AuthError::Malformed | AuthError::Unknown => {
                Status::unauthenticated(error.to_string())
            }
            AuthError::Forbidden { .. } | AuthError::ReadOnly { .. } => {
                Status::permission_denied(error.to_string())
            }
        }
    }
}
