//! Who is calling the billing API, and which tenants they may touch.
//!
//! Every call carries `authorization: Bearer <token>`. The configuration stores only each
//! token's SHA-256 (`billing.tokens`); the presented token is hashed and compared with
//! every stored digest in constant time, so neither the comparison nor the position of the
//! match reveals how much of a guess was right. A token unknown or absent is
//! `UNAUTHENTICATED`; a known token asking for another tenant's account is
//! `PERMISSION_DENIED` (mapped in `crate::api::status`).

use std::collections::BTreeSet;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{BILLING_ALL_TENANTS, BillingToken};

/// Longest `authorization` value read, in bytes; longer ones are refused unread.
pub const AUTHORIZATION_BYTES_MAX: usize = 4096;

/// Why a call was not authenticated or not authorized. Retrying with the same credentials
/// will not help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `authorization: Bearer` metadata.
    #[error("missing bearer token (authorization: Bearer <token>)")]
    Missing,
    /// The metadata is not a well-formed bearer token.
    #[error("malformed authorization metadata; expected `Bearer <token>`")]
    Malformed,
    /// The token matches no configured token.
    #[error("unknown bearer token")]
    Unknown,
    /// The token may not touch this tenant.
    #[error("caller {caller:?} may not touch tenant {tenant:?}")]
    Forbidden {
        /// The caller's name.
        caller: String,
        /// The tenant asked for.
        tenant: String,
    },
    /// A read-only admin token asked for a change.
    #[error("operator {caller:?} holds a read-only admin token; this call changes the cluster")]
    ReadOnly {
        /// The operator's name.
        caller: String,
    },
}

/// Tenants a caller may touch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantScope {
    /// Every tenant (`"*"` in the configuration): operators, `billing verify`.
    All,
    /// Only these.
    Only(BTreeSet<String>),
}

impl TenantScope {
    /// Whether `tenant` is in scope.
    pub fn allows(&self, tenant: &str) -> bool {
        match self {
            Self::All => true,
            Self::Only(tenants) => tenants.contains(tenant),
        }
    }
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token's configured name: the caller in the audit trail.
    pub name: String,
    /// What it may touch.
    pub scope: TenantScope,
}

impl Principal {
    /// Checks that the caller may touch `tenant`.
    ///
    /// # Errors
    /// [`AuthError::Forbidden`].
    pub fn authorize(&self, tenant: &str) -> Result<(), AuthError> {
        if self.scope.allows(tenant) {
            Ok(())
        } else {
            Err(AuthError::Forbidden { caller: self.name.clone(), tenant: tenant.to_owned() })
        }
    }
}

/// The configured tokens, by digest.
#[derive(Debug, Clone, Default)]
pub struct Authenticator {
    tokens: Vec<([u8; 32], Arc<Principal>)>,
}

/// SHA-256 of a token, as 64 lower-case hex digits (what `billing.tokens.sha256` holds).
pub fn token_sha256_hex(token: &str) -> String {
    Sha256::digest(token.as_bytes()).iter().map(|byte| format!("{byte:02x}")).collect()
}

fn decode_hex(hex: &str) -> Option<[u8; 32]> {
    let mut digest = [0u8; 32];
    if hex.len() != 64 {
        return None;
    }
    for (position, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(position * 2..position * 2 + 2)?, 16).ok()?;
    }
    Some(digest)
}

impl Authenticator {
    /// The authenticator of the configured tokens (validated by `NodeConfig::validate`;
    /// an undecodable digest is skipped, so it matches nothing).
    pub fn new(tokens: &[BillingToken]) -> Self {
        let tokens = tokens
            .iter()
            .filter_map(|token| {
                let digest = configured_digest(&token.sha256)?;
                let scope = if token.tenants.iter().any(|t| t == BILLING_ALL_TENANTS) {
                    TenantScope::All
                } else {
                    TenantScope::Only(token.tenants.iter().cloned().collect())
                };
                Some((digest, Arc::new(Principal { name: token.name.clone(), scope })))
            })
            .collect();
        Self { tokens }
    }

    /// Finds the caller of a request from its metadata.
    ///
    /// # Errors
    /// [`AuthError::Missing`], [`AuthError::Malformed`] or [`AuthError::Unknown`].
    pub fn authenticate(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<Arc<Principal>, AuthError> {
        let presented = presented_digest(metadata)?;
        find_digest(&self.tokens, &presented).cloned().ok_or(AuthError::Unknown)
    }
}

/// The SHA-256 of the bearer token in `authorization` metadata.
///
/// # Errors
/// [`AuthError::Missing`] or [`AuthError::Malformed`].
pub(crate) fn presented_digest(
    metadata: &tonic::metadata::MetadataMap,
) -> Result<[u8; 32], AuthError> {
    let value = metadata.get("authorization").ok_or(AuthError::Missing)?;
    if value.len() > AUTHORIZATION_BYTES_MAX {
        return Err(AuthError::Malformed);
    }
    let value = value.to_str().map_err(|_| AuthError::Malformed)?;
    let (scheme, token) = value.split_once(' ').ok_or(AuthError::Malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(AuthError::Malformed);
    }
    Ok(Sha256::digest(token.trim().as_bytes()).into())
}

/// The entry whose digest is `presented`, comparing with every digest in constant time
/// whatever matched, so timing says nothing of which did or how much of a guess was right.
pub(crate) fn find_digest<'a, T>(
    table: &'a [([u8; 32], T)],
    presented: &[u8; 32],
) -> Option<&'a T> {
    let mut found = None;
    for (digest, entry) in table {
        if bool::from(digest.ct_eq(presented)) {
            found = Some(entry);
        }
    }
    found
}

/// The digest of a configured `sha256` (validated by `NodeConfig::validate`); `None` for an
/// undecodable one, which then matches nothing.
pub(crate) fn configured_digest(hex: &str) -> Option<[u8; 32]> {
    decode_hex(&hex.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(value: &str) -> tonic::metadata::MetadataMap {
        let mut map = tonic::metadata::MetadataMap::new();
        map.insert("authorization", value.parse().expect("ascii"));
        map
    }

    fn authenticator() -> Authenticator {
        Authenticator::new(&[
            BillingToken {
                name: "svc".to_owned(),
                sha256: token_sha256_hex("secret-1"),
                tenants: vec!["t1".to_owned()],
            },
            BillingToken {
                name: "ops".to_owned(),
                sha256: token_sha256_hex("secret-2").to_ascii_uppercase(),
                tenants: vec!["*".to_owned()],
            },
        ])
    }

    /// A known token maps to its caller and scope; wrong, malformed or absent ones do not.
    #[test]
    fn tokens_authenticate_by_digest() {
        let auth = authenticator();
        let svc = auth.authenticate(&metadata("Bearer secret-1")).expect("known");
        assert_eq!(svc.name, "svc");
        assert!(svc.authorize("t1").is_ok());
        assert!(matches!(svc.authorize("t2"), Err(AuthError::Forbidden { .. })));
        let ops = auth.authenticate(&metadata("bearer secret-2")).expect("upper-case digest");
        assert!(ops.authorize("anyone").is_ok());
        assert_eq!(auth.authenticate(&metadata("Bearer secret-3")), Err(AuthError::Unknown));
        assert_eq!(auth.authenticate(&metadata("Basic secret-1")), Err(AuthError::Malformed));
        assert_eq!(auth.authenticate(&metadata("Bearer ")), Err(AuthError::Malformed));
        assert_eq!(
            auth.authenticate(&tonic::metadata::MetadataMap::new()),
            Err(AuthError::Missing)
        );
    }

    /// The digest is SHA-256 in lower-case hex (the test vector of "test").
    #[test]
    fn digest_is_sha256_hex() {
        assert_eq!(
            token_sha256_hex("test"),
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
        );
    }
}
