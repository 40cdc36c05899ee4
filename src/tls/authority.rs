//! The cluster's certificate authority: made once (`quotamesh cluster certs init`), then used
//! to issue node and operator certificates (`quotamesh cluster certs issue`). Keys are ECDSA
//! P-256 (rcgen's default, ring). The CA's key stays with the operator: nodes only ever get
//! the CA certificate (their trust bundle), their own certificate and their own key.
//!
//! Rotation: make a new CA, put both CA certificates in every node's bundle (nodes reload it,
//! `crate::tls::credentials`), issue new node certificates from the new CA, and drop the old
//! CA from the bundles once every node presents a new certificate.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use super::{Holder, IdentityError, PeerIdentity};
use crate::core::ledger::NodeId;

/// File name of the CA certificate in the CA directory (also the nodes' trust bundle).
pub const CA_CERT_FILE: &str = "ca.pem";
/// File name of the CA key in the CA directory (never copied to nodes).
pub const CA_KEY_FILE: &str = "ca.key";
/// Validity of a new CA, in days.
pub const CA_VALID_DAYS_DEFAULT: u32 = 3650;
/// Validity of a new node or operator certificate, in days.
pub const LEAF_VALID_DAYS_DEFAULT: u32 = 365;
/// Longest validity accepted, in days.
pub const VALID_DAYS_MAX: u32 = 36_500;
/// Certificates are valid from this long before they are made, so a peer whose clock is
/// slightly behind accepts them at once.
const BACKDATE_SECONDS: i64 = 3600;
/// Most subject-alternative host names on one node certificate.
pub const SANS_MAX: usize = 32;

/// Why a certificate could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum AuthorityError {
    /// rcgen refused the parameters or could not sign.
    #[error("cannot make the certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The CA certificate names no quotamesh CA identity.
    #[error("the CA certificate is not a quotamesh CA: {0}")]
    NotAnAuthority(#[from] IdentityError),
    /// A bad argument (name, host, validity).
    #[error("{0}")]
    Invalid(String),
}

impl AuthorityError {
    /// Retrying with the same arguments will not help.
    pub fn retry_may_help(&self) -> bool {
        false
    }
}

/// A certificate and its private key, both PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key (PKCS#8).
    pub key_pem: String,
}

/// A loaded CA: its certificate (for the bundle) and what signs with its key.
pub struct Authority {
    cluster_id: String,
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn validity(
    params: &mut CertificateParams,
    now_ms: u64,
    valid_days: u32,
) -> Result<(), AuthorityError> {
    if !(1..=VALID_DAYS_MAX).contains(&valid_days) {
        return Err(AuthorityError::Invalid(format!(
            "validity must be 1 to {VALID_DAYS_MAX} days, got {valid_days}"
        )));
    }
    let now_seconds = i64::try_from(now_ms / 1000).unwrap_or(i64::MAX / 2);
    let at = |seconds: i64| {
        time::OffsetDateTime::from_unix_timestamp(seconds)
            .map_err(|error| AuthorityError::Invalid(format!("validity out of range: {error}")))
    };
    params.not_before = at(now_seconds - BACKDATE_SECONDS)?;
    params.not_after = at(now_seconds + i64::from(valid_days) * 86_400)?;
    Ok(())
}

fn uri_san(identity: &PeerIdentity) -> Result<SanType, AuthorityError> {
    Ok(SanType::URI(identity.uri().try_into()?))
}

impl Authority {
    /// Makes a new CA for cluster `cluster_id`, valid `valid_days` from `now_ms`.
    ///
    /// # Errors
    /// [`AuthorityError::Invalid`] for a bad cluster id or validity.
    pub fn generate(
        cluster_id: &str,
        now_ms: u64,
        valid_days: u32,
    ) -> Result<Self, AuthorityError> {
        if !super::valid_name(cluster_id) {
            return Err(AuthorityError::Invalid(format!(
                "cluster id {cluster_id:?} must be 1 to {} characters of [A-Za-z0-9._-]",
                super::NAME_BYTES_MAX
            )));
        }
        let identity =
            PeerIdentity { cluster_id: cluster_id.to_owned(), holder: Holder::Authority };
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, format!("quotamesh CA {cluster_id}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.subject_alt_names = vec![uri_san(&identity)?];
        validity(&mut params, now_ms, valid_days)?;
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Self {
            cluster_id: cluster_id.to_owned(),
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// Loads a CA from its certificate and key (PEM).
    ///
    /// # Errors
    /// [`AuthorityError`] when either does not parse or the certificate is no quotamesh CA.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, AuthorityError> {
        let der = rustls::pki_types::CertificateDer::from(
            pem_contents(cert_pem)
                .ok_or_else(|| AuthorityError::Invalid("the CA certificate is not PEM".into()))?,
        );
        let identity = PeerIdentity::from_certificate(&der)?;
        if identity.holder != Holder::Authority {
            return Err(AuthorityError::Invalid(format!(
                "the certificate names {}, not a CA",
                identity.uri()
            )));
        }
        let key = KeyPair::from_pem(key_pem)?;
        let issuer = Issuer::from_ca_cert_der(&der, key)?;
        Ok(Self { cluster_id: identity.cluster_id, cert_pem: cert_pem.to_owned(), issuer })
    }

    /// Reads `ca.pem` and `ca.key` from `directory`.
    ///
    /// # Errors
    /// [`AuthorityError`] when a file cannot be read or does not parse.
    pub fn load(directory: &Path) -> Result<Self, AuthorityError> {
        let read = |name: &str| {
            let path = directory.join(name);
            std::fs::read_to_string(&path)
                .map_err(|source| AuthorityError::Io { path: path.display().to_string(), source })
        };
        Self::from_pem(&read(CA_CERT_FILE)?, &read(CA_KEY_FILE)?)
    }

    /// Writes `ca.pem` and `ca.key` (owner-only) into `directory`, refusing to overwrite.
    ///
    /// # Errors
    /// [`AuthorityError::Io`], also when a CA is there already.
    pub fn save(&self, directory: &Path) -> Result<(), AuthorityError> {
        write_new(&directory.join(CA_CERT_FILE), &self.cert_pem, false)?;
        write_new(&directory.join(CA_KEY_FILE), &self.issuer.key().serialize_pem(), true)
    }

    /// The cluster this CA is for.
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues the certificate of voter `node_id` of region `region`, valid for the TLS
    /// host names and addresses `hosts` (what its peers dial), as server and as client.
    ///
    /// # Errors
    /// [`AuthorityError::Invalid`] for a bad region, host or validity.
    pub fn issue_node(
        &self,
        region: &str,
        node_id: NodeId,
        hosts: &[String],
        now_ms: u64,
        valid_days: u32,
    ) -> Result<Issued, AuthorityError> {
        self.issue_member(region, node_id, hosts, now_ms, valid_days, false)
    }

    /// Issues the certificate of gateway `node_id` (`role = "gateway"`) of region `region`,
    /// as [`Self::issue_node`] does for a voter.
    ///
    /// # Errors
    /// [`AuthorityError::Invalid`] for a bad region, host or validity.
    pub fn issue_gateway(
        &self,
        region: &str,
        node_id: NodeId,
        hosts: &[String],
        now_ms: u64,
        valid_days: u32,
    ) -> Result<Issued, AuthorityError> {
        self.issue_member(region, node_id, hosts, now_ms, valid_days, true)
    }

    fn issue_member(
        &self,
        region: &str,
        node_id: NodeId,
        hosts: &[String],
        now_ms: u64,
        valid_days: u32,
        gateway: bool,
    ) -> Result<Issued, AuthorityError> {
        if !super::valid_name(region) {
            return Err(AuthorityError::Invalid(format!(
                "region {region:?} must be 1 to {} characters of [A-Za-z0-9._-]",
                super::NAME_BYTES_MAX
            )));
        }
        if node_id.0 == 0 {
            return Err(AuthorityError::Invalid("node id must be at least 1".into()));
        }
        if hosts.is_empty() || hosts.len() > SANS_MAX {
            return Err(AuthorityError::Invalid(format!(
                "give 1 to {SANS_MAX} host names or addresses (--san) the peers reach the node at"
            )));
        }
        let region = region.to_owned();
        let holder = if gateway {
            Holder::Gateway { region, node_id }
        } else {
            Holder::Node { region, node_id }
        };
        let usages = [ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(holder, hosts, &usages, now_ms, valid_days)
    }

    /// Issues the client certificate of operator `name` (admin API).
    ///
    /// # Errors
    /// [`AuthorityError::Invalid`] for a bad name or validity.
    pub fn issue_operator(
        &self,
        name: &str,
        now_ms: u64,
        valid_days: u32,
    ) -> Result<Issued, AuthorityError> {
        if !super::valid_name(name) {
            return Err(AuthorityError::Invalid(format!(
                "operator name {name:?} must be 1 to {} characters of [A-Za-z0-9._-]",
                super::NAME_BYTES_MAX
            )));
        }
        let holder = Holder::Operator { name: name.to_owned() };
        self.issue(holder, &[], &[ExtendedKeyUsagePurpose::ClientAuth], now_ms, valid_days)
    }

    fn issue(
        &self,
        holder: Holder,
        hosts: &[String],
        usages: &[ExtendedKeyUsagePurpose],
        now_ms: u64,
        valid_days: u32,
    ) -> Result<Issued, AuthorityError> {
        let identity = PeerIdentity { cluster_id: self.cluster_id.clone(), holder };
        let mut params = CertificateParams::new(hosts.to_vec())?;
        params.subject_alt_names.push(uri_san(&identity)?);
        params.distinguished_name.push(DnType::CommonName, identity.uri());
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = usages.to_vec();
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, now_ms, valid_days)?;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }
}

/// The DER contents of the first PEM block of `pem`.
fn pem_contents(pem: &str) -> Option<Vec<u8>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()?
        .ok()
        .map(|der| der.to_vec())
}

/// Writes `text` to a new file at `path` (owner-only when `private`), never overwriting.
///
/// # Errors
/// [`AuthorityError::Io`], also when the file exists.
pub fn write_new(path: &Path, text: &str, private: bool) -> Result<(), AuthorityError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| AuthorityError::Io { path: path.display().to_string(), source };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true).mode(if private { 0o600 } else { 0o644 });
    let mut file = options.open(path).map_err(io)?;
    file.write_all(text.as_bytes()).map_err(io)?;
    file.sync_all().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA saved and loaded again issues node certificates that name the node, its region
    /// and the cluster, and operator certificates that name the operator.
    #[test]
    fn issued_certificates_name_their_holder() -> Result<(), AuthorityError> {
        let directory = tempfile::tempdir().expect("tempdir");
        let now_ms = 1_800_000_000_000;
        Authority::generate("region-a", now_ms, CA_VALID_DAYS_DEFAULT)?.save(directory.path())?;
        let authority = Authority::load(directory.path())?;
        assert_eq!(authority.cluster_id(), "region-a");
        assert!(
            Authority::generate("region-a", now_ms, 10)?.save(directory.path()).is_err(),
            "never overwrites a CA"
        );
        let hosts = vec!["127.0.0.1".to_owned(), "node-1.example".to_owned()];
        let node = authority.issue_node("eu-1", NodeId(7), &hosts, now_ms, 30)?;
        let der = pem_contents(&node.cert_pem).expect("PEM");
        let identity = PeerIdentity::from_certificate(&der)?;
        assert_eq!(identity.cluster_id, "region-a");
        assert_eq!(identity.holder, Holder::Node { region: "eu-1".into(), node_id: NodeId(7) });
        let operator = authority.issue_operator("alice", now_ms, 30)?;
        let der = pem_contents(&operator.cert_pem).expect("PEM");
        assert_eq!(
            PeerIdentity::from_certificate(&der)?.holder,
            Holder::Operator { name: "alice".into() }
        );
        assert!(authority.issue_node("eu 1", NodeId(7), &hosts, now_ms, 30).is_err());
        assert!(authority.issue_node("eu-1", NodeId(7), &[], now_ms, 30).is_err());
        Ok(())
    }
}
