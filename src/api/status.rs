//! The one place where errors become gRPC statuses.
//!
//! Storage, quorum or overload trouble reaches Envoy as `UNAVAILABLE`, so the filter's
//! `failure_mode_deny` decides; never as an RLS `UNKNOWN` code, which Envoy lets through.

use tonic::Status;

use crate::actors::shard::ShardError;
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
    /// The encoded request is too large.
    #[error("request is {0} bytes; at most {max} allowed", max = super::rls::REQUEST_BYTES_MAX)]
    TooLarge(usize),
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
            Self::TooLarge(_) => "too_large",
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
            WriteError::TooLarge { .. } => Status::invalid_argument(error.to_string()),
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
