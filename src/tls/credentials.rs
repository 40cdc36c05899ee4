//! A node's TLS files (its certificate chain, its key, the CA bundle it trusts), loaded at
//! start and reloaded when they change, and the rustls pieces that always read the current
//! ones: a certificate resolver for both sides of a handshake and the two verifiers.
//!
//! ```text
//!  files ──poll (reload_interval_ms)──▶ changed? parse, check ──▶ ArcSwap<Loaded>
//!                                          └ bad: keep the old, log   │ read per handshake
//!               resolver (our cert) · client verifier · server verifier ◀┘
//! ```
//!
//! Nothing is rebuilt on a reload but the loaded set: the rustls configurations hold the
//! resolver and verifiers, which read the set on each new handshake, so a rotation needs no
//! restart and open connections carry on with what they were established with. A bundle may
//! hold several CAs (old and new during a CA rotation). Every verifier, after the usual chain
//! and validity checks, also requires the peer's identity (`crate::tls`) to name this node's
//! cluster and a holder the port serves.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};

use super::{Holder, PeerIdentity};
use crate::core::ledger::NodeId;

/// Largest TLS file read (a chain of a few certificates is a few KiB).
pub const TLS_FILE_BYTES_MAX: u64 = 1024 * 1024;

/// Where a node's TLS files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The node's certificate chain (PEM), its own certificate first.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA bundle (PEM): every CA whose certificates are trusted.
    pub ca: PathBuf,
}

/// Why the TLS files could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// A file could not be read or is too large.
    #[error("TLS file {path}: {reason}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// A file does not hold what it should.
    #[error("TLS file {path}: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

impl CredentialsError {
    /// Retrying with the same files will not help (a reload with new ones may).
    pub fn retry_may_help(&self) -> bool {
        false
    }
}

/// One consistent set: what was read, and what it was parsed into.
struct Loaded {
    bytes: [Vec<u8>; 3],
    certified: Arc<CertifiedKey>,
    client_verifier: Arc<dyn ClientCertVerifier>,
    server_verifier: Arc<WebPkiServerVerifier>,
}

/// A node's current TLS credentials; cheap to share, reloadable.
pub struct Credentials {
    files: TlsFiles,
    cluster_id: String,
    node_id: NodeId,
    gateway: bool,
    current: ArcSwap<Loaded>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Credentials")
            .field("files", &self.files)
            .field("cluster_id", &self.cluster_id)
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

fn read(path: &std::path::Path) -> Result<Vec<u8>, CredentialsError> {
    let error =
        |reason: String| CredentialsError::Read { path: path.display().to_string(), reason };
    let size = std::fs::metadata(path).map_err(|e| error(e.to_string()))?.len();
    if size > TLS_FILE_BYTES_MAX {
        return Err(error(format!("{size} bytes, more than {TLS_FILE_BYTES_MAX}")));
    }
    std::fs::read(path).map_err(|e| error(e.to_string()))
}

impl Credentials {
    /// Loads the files of node `node_id` of cluster `cluster_id`, a gateway's when
    /// `gateway`; the node's own certificate must name exactly that node, role and cluster
    /// (a node never starts with another's, nor a voter with a gateway's).
    ///
    /// # Errors
    /// [`CredentialsError`] naming the file that cannot be read or used.
    pub fn load(
        files: TlsFiles,
        cluster_id: &str,
        node_id: NodeId,
        gateway: bool,
    ) -> Result<Arc<Self>, CredentialsError> {
        super::install_crypto_provider();
        let bytes = [read(&files.cert)?, read(&files.key)?, read(&files.ca)?];
        let loaded = parse(&files, bytes, cluster_id, node_id, gateway)?;
        Ok(Arc::new(Self {
            files,
            cluster_id: cluster_id.to_owned(),
            node_id,
            gateway,
            current: ArcSwap::from_pointee(loaded),
        }))
    }

    /// Reads the files again and, when any changed and the new set is good, makes it the
    /// current one. Returns whether it did.
    ///
    /// # Errors
    /// [`CredentialsError`] when the new files cannot be used; the previous set stays.
    pub fn reload(&self) -> Result<bool, CredentialsError> {
        let bytes = [read(&self.files.cert)?, read(&self.files.key)?, read(&self.files.ca)?];
        if bytes == self.current.load().bytes {
            return Ok(false);
        }
        let loaded = parse(&self.files, bytes, &self.cluster_id, self.node_id, self.gateway)?;
        self.current.store(Arc::new(loaded));
        Ok(true)
    }

    /// Polls the files every `interval` until `shutdown` resolves, reloading on change.
    pub fn watch(
        self: Arc<Self>,
        interval: Duration,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            tokio::pin!(shutdown);
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                tokio::select! {
                    () = &mut shutdown => return,
                    _ = ticks.tick() => {}
                }
                let credentials = Arc::clone(&self);
                match tokio::task::spawn_blocking(move || credentials.reload()).await {
                    Ok(Ok(true)) => tracing::info!(
                        cert = %self.files.cert.display(),
                        "TLS certificate, key or CA bundle changed: new connections use them"
                    ),
                    Ok(Ok(false)) => {}
                    Ok(Err(error)) => {
                        tracing::warn!(%error, "TLS files not reloaded; keeping the previous ones");
                    }
                    Err(error) => tracing::warn!(%error, "TLS reload task failed"),
                }
            }
        })
    }

    /// The cluster whose peers these credentials accept.
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// The resolver that presents the current certificate (server and client side).
    pub(crate) fn resolver(self: &Arc<Self>) -> Arc<CurrentCertificate> {
        Arc::new(CurrentCertificate { credentials: Arc::clone(self) })
    }
}

fn parse(
    files: &TlsFiles,
    bytes: [Vec<u8>; 3],
    cluster_id: &str,
    node_id: NodeId,
    gateway: bool,
) -> Result<Loaded, CredentialsError> {
    let invalid = |path: &PathBuf, reason: String| CredentialsError::Invalid {
        path: path.display().to_string(),
        reason,
    };
    let [cert, key, ca] = &bytes;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .map_err(|e| invalid(&files.cert, e.to_string()))?;
    let own = chain.first().ok_or_else(|| invalid(&files.cert, "no certificate".into()))?;
    let identity =
        PeerIdentity::from_certificate(own).map_err(|e| invalid(&files.cert, e.to_string()))?;
    identity.check_cluster(cluster_id).map_err(|e| invalid(&files.cert, e.to_string()))?;
    let role = if gateway { "gateway" } else { "voter" };
    if identity.node_id() != Some(node_id) || identity.may_vote() == gateway {
        return Err(invalid(
            &files.cert,
            format!(
                "names {}, but this node is Raft node {node_id}, a {role} (`certs issue{}`)",
                identity.uri(),
                if gateway { " --gateway" } else { "" }
            ),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| invalid(&files.key, e.to_string()))?;
    let provider = super::provider();
    let certified = CertifiedKey::from_der(chain, key, &provider)
        .map_err(|e| invalid(&files.key, format!("does not fit the certificate: {e}")))?;
    let mut roots = rustls::RootCertStore::empty();
    for authority in CertificateDer::pem_slice_iter(ca) {
        let authority = authority.map_err(|e| invalid(&files.ca, e.to_string()))?;
        roots.add(authority).map_err(|e| invalid(&files.ca, e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(invalid(&files.ca, "no CA certificate".into()));
    }
    let roots = Arc::new(roots);
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
            .build()
            .map_err(|e| invalid(&files.ca, e.to_string()))?;
    let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider)
        .build()
        .map_err(|e| invalid(&files.ca, e.to_string()))?;
    Ok(Loaded { bytes, certified: Arc::new(certified), client_verifier, server_verifier })
}

/// Presents the node's current certificate, as server and as client.
#[derive(Debug)]
pub(crate) struct CurrentCertificate {
    credentials: Arc<Credentials>,
}

impl ResolvesServerCert for CurrentCertificate {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.credentials.current.load().certified))
    }
}

impl ResolvesClientCert for CurrentCertificate {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.credentials.current.load().certified))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Which holders a port accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accept {
    /// Nodes and gateways of the cluster only (the Raft port, and a node dialling a peer).
    Nodes,
    /// Nodes and operators, or a client without a certificate (the admin port, where a
    /// token authenticates such a client).
    NodesAndOperators,
}

impl Accept {
    fn allows(self, holder: &Holder) -> bool {
        match (self, holder) {
            (_, Holder::Node { .. } | Holder::Gateway { .. })
            | (Self::NodesAndOperators, Holder::Operator { .. }) => true,
            (_, Holder::Authority) | (Self::Nodes, Holder::Operator { .. }) => false,
        }
    }
}

/// After the chain checks: the certificate must name our cluster and an accepted holder.
fn check_identity(
    credentials: &Credentials,
    end_entity: &CertificateDer<'_>,
    accept: Accept,
) -> Result<(), rustls::Error> {
    let refuse = |reason: String| {
        rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(
            std::io::Error::new(std::io::ErrorKind::PermissionDenied, reason),
        ))))
    };
    let identity =
        PeerIdentity::from_certificate(end_entity).map_err(|error| refuse(error.to_string()))?;
    identity.check_cluster(&credentials.cluster_id).map_err(|error| refuse(error.to_string()))?;
    if accept.allows(&identity.holder) {
        Ok(())
    } else {
        Err(refuse(format!("{} may not use this port", identity.uri())))
    }
}

/// Verifies a client's certificate against the current bundle and identity rules.
#[derive(Debug)]
pub(crate) struct PeerClientVerifier {
    pub(crate) credentials: Arc<Credentials>,
    pub(crate) accept: Accept,
}

impl ClientCertVerifier for PeerClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        // The admin port also takes operators with a token and no certificate.
        self.accept == Accept::Nodes
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // The bundle can change under us; no hints: a client sends the one it has.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let current = self.credentials.current.load();
        let verified =
            current.client_verifier.verify_client_cert(end_entity, intermediates, now)?;
        check_identity(&self.credentials, end_entity, self.accept)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.credentials.current.load().client_verifier.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.credentials.current.load().client_verifier.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.credentials.current.load().client_verifier.supported_verify_schemes()
    }
}

/// Verifies a peer node's server certificate: the current bundle, the host name dialled,
/// and the identity rules.
#[derive(Debug)]
pub(crate) struct PeerServerVerifier {
    pub(crate) credentials: Arc<Credentials>,
}

impl ServerCertVerifier for PeerServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let current = self.credentials.current.load();
        let verified = current.server_verifier.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        check_identity(&self.credentials, end_entity, Accept::Nodes)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.credentials.current.load().server_verifier.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.credentials.current.load().server_verifier.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.credentials.current.load().server_verifier.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::authority::Authority;

    /// A node loads its own certificate, refuses one naming another node or cluster and a
    /// key that does not fit, and a reload picks up new files (and keeps the old on bad ones).
    #[test]
    fn load_checks_the_identity_and_reload_swaps() -> anyhow::Result<()> {
        let directory = tempfile::tempdir()?;
        let now_ms = 1_800_000_000_000;
        let authority = Authority::generate("c", now_ms, 10)?;
        let hosts = ["127.0.0.1".to_owned()];
        let files = TlsFiles {
            cert: directory.path().join("n.pem"),
            key: directory.path().join("n.key"),
            ca: directory.path().join("ca.pem"),
        };
        let write = |issued: &crate::tls::authority::Issued| -> std::io::Result<()> {
            std::fs::write(&files.cert, &issued.cert_pem)?;
            std::fs::write(&files.key, &issued.key_pem)
        };
        std::fs::write(&files.ca, authority.cert_pem())?;
        write(&authority.issue_node("r", NodeId(1), &hosts, now_ms, 10)?)?;
        let credentials = Credentials::load(files.clone(), "c", NodeId(1), false)?;
        assert!(Credentials::load(files.clone(), "c", NodeId(2), false).is_err(), "another node's");
        assert!(
            Credentials::load(files.clone(), "d", NodeId(1), false).is_err(),
            "another cluster's"
        );
        assert!(Credentials::load(files.clone(), "c", NodeId(1), true).is_err(), "a voter's");
        assert!(!credentials.reload()?, "nothing changed");
        write(&authority.issue_node("r", NodeId(1), &hosts, now_ms, 10)?)?;
        assert!(credentials.reload()?, "a new certificate and key");
        let other = authority.issue_node("r", NodeId(1), &hosts, now_ms, 10)?;
        std::fs::write(&files.key, &other.key_pem)?;
        assert!(credentials.reload().is_err(), "a key that does not fit is refused");
        Ok(())
    }
}
