//! TLS for the billing port: a server certificate, and optionally a client CA that makes
//! it mutual (every client must present a certificate the CA signed).
//!
//! tonic's TLS server builds a rustls `ServerConfig`, which needs a process-wide crypto
//! provider: [`install_crypto_provider`] installs ring (the only one compiled in) before any
//! TLS object is built (dependencies.md gotcha 6).

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::config::BillingTls;

/// Why the TLS files could not be used.
#[derive(Debug, thiserror::Error)]
#[error("billing TLS file {path}: {source}")]
pub struct TlsError {
    /// The file.
    pub path: String,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

/// Installs rustls's ring provider as the process default (a second call does nothing).
pub fn install_crypto_provider() {
    // An error means a provider is installed already, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn read(path: &std::path::Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError { path: path.display().to_string(), source })
}

/// The tonic server TLS settings of `tls`.
///
/// # Errors
/// [`TlsError`] when a file cannot be read. Malformed PEM is reported when the server
/// starts.
pub fn server_config(tls: &BillingTls) -> Result<ServerTlsConfig, TlsError> {
    install_crypto_provider();
    let identity = Identity::from_pem(read(&tls.cert)?, read(&tls.key)?);
    let mut config = ServerTlsConfig::new().identity(identity);
    if let Some(client_ca) = &tls.client_ca {
        config = config.client_ca_root(Certificate::from_pem(read(client_ca)?));
    }
    Ok(config)
}
