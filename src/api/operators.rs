//! Who may call the admin API: operators, each with a bearer token whose SHA-256 the
//! configuration stores (`[[admin.tokens]]`), compared in constant time exactly as the
//! billing API's tokens are (`crate::api::billing::auth`), or, on an admin port served over
//! TLS (`admin.tls`), with an operator certificate of the cluster's CA, which counts as a
//! full token.
//!
//! ```text
//!  call            no or unknown token     read-only token       token
//!  Status/ReadKeys UNAUTHENTICATED (served  served                served
//!                  when admin.read_open)
//!  anything else   UNAUTHENTICATED          PERMISSION_DENIED     served
//! ```

use std::sync::Arc;

use crate::api::billing::auth::{AuthError, configured_digest, find_digest, presented_digest};
use crate::config::AdminConfig;
use crate::tls::{Holder, PeerIdentity};

/// What a call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Changes nothing (status, reads).
    Read,
    /// Changes the cluster or its ledger (membership, leases by hand).
    Change,
}

/// An authenticated operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    /// The token's configured name.
    pub name: String,
    /// Reads only.
    pub read_only: bool,
}

/// The configured operators, by digest.
#[derive(Debug, Clone, Default)]
pub struct Operators {
    tokens: Vec<([u8; 32], Arc<Operator>)>,
    read_open: bool,
}

impl Operators {
    /// The operators of `[admin]` (validated by `NodeConfig::validate`; an undecodable
    /// digest is skipped, so it matches nothing).
    pub fn new(config: &AdminConfig) -> Self {
        let tokens = config
            .tokens
            .iter()
            .filter_map(|token| {
                let operator = Operator { name: token.name.clone(), read_only: token.read_only };
                Some((configured_digest(&token.sha256)?, Arc::new(operator)))
            })
            .collect();
        Self { tokens, read_open: config.read_open }
    }

    /// Checks that a call with this metadata (and, over TLS, this verified client
    /// `certificate`) may have `access`; returns the operator, or `None` for an open read
    /// without a token.
    ///
    /// # Errors
    /// [`AuthError`]: `Missing`, `Malformed` or `Unknown` (UNAUTHENTICATED), `ReadOnly`
    /// (PERMISSION_DENIED).
    pub fn authorize(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        certificate: Option<&PeerIdentity>,
        access: Access,
    ) -> Result<Option<Arc<Operator>>, AuthError> {
        if let Some(PeerIdentity { holder: Holder::Operator { name }, .. }) = certificate {
            return Ok(Some(Arc::new(Operator { name: name.clone(), read_only: false })));
        }
        if access == Access::Read && self.read_open && metadata.get("authorization").is_none() {
            return Ok(None);
        }
        let presented = presented_digest(metadata)?;
        let operator = find_digest(&self.tokens, &presented).ok_or(AuthError::Unknown)?;
        if access == Access::Change && operator.read_only {
            return Err(AuthError::ReadOnly { caller: operator.name.clone() });
        }
        Ok(Some(Arc::clone(operator)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::billing::auth::token_sha256_hex;
    use crate::config::AdminToken;

    fn metadata(token: Option<&str>) -> tonic::metadata::MetadataMap {
        let mut map = tonic::metadata::MetadataMap::new();
        if let Some(token) = token {
            map.insert("authorization", format!("Bearer {token}").parse().expect("ascii"));
        }
        map
    }

    impl Operators {
        fn authorize_token(
            &self,
            metadata: &tonic::metadata::MetadataMap,
            access: Access,
        ) -> Result<Option<Arc<Operator>>, AuthError> {
            self.authorize(metadata, None, access)
        }
    }

    /// An operator certificate serves as a full token; a node's certificate does not.
    #[test]
    fn operator_certificates_count_as_tokens() {
        let operators = Operators::new(&AdminConfig::default());
        let identity = |holder| PeerIdentity { cluster_id: "c".to_owned(), holder };
        let alice = identity(Holder::Operator { name: "alice".to_owned() });
        let granted = operators.authorize(&metadata(None), Some(&alice), Access::Change);
        assert_eq!(granted.expect("operator").map(|o| o.name.clone()).as_deref(), Some("alice"));
        let node =
            identity(Holder::Node { region: "r".to_owned(), node_id: crate::ledger::NodeId(1) });
        assert_eq!(
            operators.authorize(&metadata(None), Some(&node), Access::Read),
            Err(AuthError::Missing)
        );
    }

    /// Changes need a full token; reads need a token unless opened; a read-only token may
    /// read but not change; unknown tokens are refused either way.
    #[test]
    fn tokens_decide_access() {
        let token = |name: &str, secret: &str, read_only: bool| AdminToken {
            name: name.to_owned(),
            sha256: token_sha256_hex(secret),
            read_only,
        };
        let mut config = AdminConfig {
            read_open: false,
            tls: false,
            tokens: vec![token("ops", "s1", false), token("viewer", "s2", true)],
        };
        let operators = Operators::new(&config);
        let ops = operators.authorize_token(&metadata(Some("s1")), Access::Change).expect("ops");
        assert_eq!(ops.map(|o| o.name.clone()).as_deref(), Some("ops"));
        assert!(operators.authorize_token(&metadata(Some("s2")), Access::Read).is_ok());
        assert!(matches!(
            operators.authorize_token(&metadata(Some("s2")), Access::Change),
            Err(AuthError::ReadOnly { .. })
        ));
        assert_eq!(
            operators.authorize_token(&metadata(Some("s3")), Access::Change),
            Err(AuthError::Unknown)
        );
        assert_eq!(
            operators.authorize_token(&metadata(None), Access::Read),
            Err(AuthError::Missing)
        );
        config.read_open = true;
        let operators = Operators::new(&config);
        assert_eq!(operators.authorize_token(&metadata(None), Access::Read), Ok(None));
        assert_eq!(
            operators.authorize_token(&metadata(None), Access::Change),
            Err(AuthError::Missing)
        );
    }
}
