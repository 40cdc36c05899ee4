//! Who a node's peers are: the cluster's own certificate authority, the certificates it
//! issues, and mutual TLS on the links between nodes.
//!
//! Every certificate names its holder in one URI subject-alternative name, which the other
//! side parses back after the handshake (DESIGN.md, threat model):
//!
//! ```text
//!  quotamesh://<cluster_id>/ca                     the cluster's CA
//!  quotamesh://<cluster_id>/<region>/node/<id>     a voter: its Raft node id in that cluster
//!  quotamesh://<cluster_id>/<region>/gateway/<id>  a gateway: leases for itself, never votes
//!  quotamesh://<cluster_id>/operator/<name>        an operator (admin API client)
//! ```
//!
//! A peer is accepted only with a certificate chaining to a CA of the configured bundle
//! whose identity names this node's cluster; what a peer may then do with its node id
//! (speak for that id only, forward only what that id may forward) is decided by
//! `crate::ledger::service`.
//!
//! - [`authority`]: `quotamesh cluster certs init` and `issue` (rcgen).
//! - [`credentials`]: the PEM files a node is configured with, reloaded when they change, and
//!   the rustls verifiers and certificate resolvers that read the current ones.
//! - [`transport`]: the TLS listener under tonic (each connection carrying its peer's
//!   identity) and the connector of the client side.

pub mod authority;
pub mod credentials;
pub mod transport;

use crate::core::ledger::NodeId;

/// The URI scheme of every identity this module issues.
pub const IDENTITY_SCHEME: &str = "quotamesh://";
/// Longest identity URI read from a certificate, in bytes.
const IDENTITY_URI_BYTES_MAX: usize = 512;
/// Longest operator or region name, in bytes.
pub const NAME_BYTES_MAX: usize = 128;

/// Installs rustls's ring provider as the process default (a second call does nothing).
/// Call before building any TLS object (dependencies.md gotcha 6).
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The ring provider every TLS object here is built with, whatever the process default is.
pub(crate) fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}

/// What a certificate says its holder is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// The cluster's certificate authority.
    Authority,
    /// A voter (or a node that may become one) of region `region`, Raft node `node_id`.
    Node {
        /// The node's region.
        region: String,
        /// Its Raft node id.
        node_id: NodeId,
    },
    /// A gateway of region `region` (`role = "gateway"`): it may lease in its own name, but
    /// never send Raft messages or propose anything else.
    Gateway {
        /// The gateway's region.
        region: String,
        /// Its Raft node id (the ledger counts its leases under it).
        node_id: NodeId,
    },
    /// An operator of the admin API.
    Operator {
        /// The operator's name (written in logs).
        name: String,
    },
}

/// The identity a certificate names: a cluster and a holder in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    /// The cluster (`cluster_id`) the certificate was issued for.
    pub cluster_id: String,
    /// Who holds it.
    pub holder: Holder,
}

/// Why a certificate's identity could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The certificate is not DER X.509.
    #[error("the certificate does not parse: {0}")]
    Undecodable(String),
    /// No `quotamesh://` URI among its subject-alternative names.
    #[error("the certificate names no quotamesh identity (a quotamesh:// URI SAN)")]
    Missing,
    /// More than one `quotamesh://` URI: ambiguous, so refused.
    #[error("the certificate names more than one quotamesh identity")]
    Ambiguous,
    /// The URI is not one of the forms above.
    #[error("malformed quotamesh identity {0:?}")]
    Malformed(String),
    /// The identity names another cluster.
    #[error("the certificate is for cluster {presented:?}, not {expected:?}")]
    OtherCluster {
        /// The cluster it names.
        presented: String,
        /// Ours.
        expected: String,
    },
}

/// Whether `name` is usable in an identity: 1 to [`NAME_BYTES_MAX`] bytes of
/// `[A-Za-z0-9._-]` (the cluster id's alphabet, so the URI needs no escaping).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl PeerIdentity {
    /// The identity URI of this identity.
    pub fn uri(&self) -> String {
        let cluster = &self.cluster_id;
        match &self.holder {
            Holder::Authority => format!("{IDENTITY_SCHEME}{cluster}/ca"),
            Holder::Node { region, node_id } => {
                format!("{IDENTITY_SCHEME}{cluster}/{region}/node/{node_id}")
            }
            Holder::Gateway { region, node_id } => {
                format!("{IDENTITY_SCHEME}{cluster}/{region}/gateway/{node_id}")
            }
            Holder::Operator { name } => format!("{IDENTITY_SCHEME}{cluster}/operator/{name}"),
        }
    }

    /// Parses an identity URI.
    ///
    /// # Errors
    /// [`IdentityError::Malformed`] when it is not one of the three forms.
    pub fn parse_uri(uri: &str) -> Result<Self, IdentityError> {
        let malformed = || IdentityError::Malformed(uri.chars().take(128).collect());
        if uri.len() > IDENTITY_URI_BYTES_MAX {
            return Err(malformed());
        }
        let rest = uri.strip_prefix(IDENTITY_SCHEME).ok_or_else(malformed)?;
        let parts: Vec<&str> = rest.split('/').collect();
        let (cluster, holder) = match parts.as_slice() {
            [cluster, "ca"] => (cluster, Holder::Authority),
            [cluster, "operator", name] if valid_name(name) => {
                (cluster, Holder::Operator { name: (*name).to_owned() })
            }
            [cluster, region, kind @ ("node" | "gateway"), id] if valid_name(region) => {
                let node_id = id.parse::<u64>().ok().filter(|id| *id > 0).ok_or_else(malformed)?;
                let (region, node_id) = ((*region).to_owned(), NodeId(node_id));
                let holder = if *kind == "node" {
                    Holder::Node { region, node_id }
                } else {
                    Holder::Gateway { region, node_id }
                };
                (cluster, holder)
            }
            _ => return Err(malformed()),
        };
        if !valid_name(cluster) {
            return Err(malformed());
        }
        Ok(Self { cluster_id: (*cluster).to_owned(), holder })
    }

    /// Reads the identity out of a DER certificate (its one `quotamesh://` URI SAN). The
    /// certificate's chain is not checked here: that is the TLS handshake's.
    ///
    /// # Errors
    /// [`IdentityError`] when the certificate does not parse or names no single identity.
    pub fn from_certificate(der: &[u8]) -> Result<Self, IdentityError> {
        use x509_parser::extensions::GeneralName;
        let (_, certificate) = x509_parser::parse_x509_certificate(der)
            .map_err(|error| IdentityError::Undecodable(error.to_string()))?;
        let names = certificate
            .subject_alternative_name()
            .map_err(|error| IdentityError::Undecodable(error.to_string()))?
            .ok_or(IdentityError::Missing)?;
        let mut found = None;
        for name in &names.value.general_names {
            if let GeneralName::URI(uri) = name
                && uri.starts_with(IDENTITY_SCHEME)
            {
                if found.is_some() {
                    return Err(IdentityError::Ambiguous);
                }
                found = Some(Self::parse_uri(uri)?);
            }
        }
        found.ok_or(IdentityError::Missing)
    }

    /// Checks that the identity belongs to cluster `cluster_id`.
    ///
    /// # Errors
    /// [`IdentityError::OtherCluster`].
    pub fn check_cluster(&self, cluster_id: &str) -> Result<(), IdentityError> {
        if self.cluster_id == cluster_id {
            Ok(())
        } else {
            Err(IdentityError::OtherCluster {
                presented: self.cluster_id.clone(),
                expected: cluster_id.to_owned(),
            })
        }
    }

    /// The Raft node id, when the holder is a node or a gateway.
    pub fn node_id(&self) -> Option<NodeId> {
        match &self.holder {
            Holder::Node { node_id, .. } | Holder::Gateway { node_id, .. } => Some(*node_id),
            Holder::Authority | Holder::Operator { .. } => None,
        }
    }

    /// Whether the holder is a voter's certificate (a node), which may send Raft messages
    /// and propose for the region; a gateway's may not.
    pub fn may_vote(&self) -> bool {
        matches!(self.holder, Holder::Node { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every form round-trips through its URI; malformed ones are refused.
    #[test]
    fn identity_uris_round_trip() {
        for identity in [
            PeerIdentity { cluster_id: "region-a".into(), holder: Holder::Authority },
            PeerIdentity {
                cluster_id: "region-a".into(),
                holder: Holder::Node { region: "eu-1".into(), node_id: NodeId(3) },
            },
            PeerIdentity {
                cluster_id: "c".into(),
                holder: Holder::Operator { name: "alice".into() },
            },
            PeerIdentity {
                cluster_id: "c".into(),
                holder: Holder::Gateway { region: "r".into(), node_id: NodeId(4) },
            },
        ] {
            assert_eq!(PeerIdentity::parse_uri(&identity.uri()), Ok(identity.clone()));
        }
        for bad in [
            "https://region-a/ca",
            "quotamesh://region-a/eu/node/0",
            "quotamesh://region-a/eu/node/x",
            "quotamesh://region a/ca",
            "quotamesh://region-a/eu/node/3/extra",
            "quotamesh:///ca",
        ] {
            assert!(PeerIdentity::parse_uri(bad).is_err(), "{bad}");
        }
    }
}
