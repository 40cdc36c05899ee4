//! Mutual TLS under tonic: a listener whose connections carry their peer's identity, and a
//! connector for the client side, both built over the reloadable [`Credentials`].
//!
//! ```text
//!  accept ─▶ handshake task (bounded, timed) ─▶ verified: identity parsed once ─▶ tonic
//!            └ refused or too slow: closed       (PeerInfo, a request extension)
//! ```
//!
//! Handshakes run in their own tasks so a slow or silent client cannot hold up the accept
//! loop; at most [`HANDSHAKES_IN_FLIGHT_MAX`] at once, each within [`HANDSHAKE_TIMEOUT`].
//! TLS 1.3 only, ALPN `h2`, no session resumption: every connection is verified against the
//! credentials current when it was made (connections between nodes are few and long-lived).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::http::Uri;
use tonic::transport::server::Connected;

use super::PeerIdentity;
use super::credentials::{Accept, Credentials, PeerClientVerifier, PeerServerVerifier};

/// Most TLS handshakes under way at once on one listener.
pub const HANDSHAKES_IN_FLIGHT_MAX: usize = 64;
/// Longest a client may take to complete its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Verified connections waiting for tonic to take them.
const ACCEPTED_QUEUE_MAX: usize = 64;
/// Pause after a failed `accept` (out of file descriptors), so the loop does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// What tonic puts in every request's extensions on a TLS port: who is calling.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// The identity the peer's verified certificate names; `None` on a port where a client
    /// certificate is optional (the admin port) and none was sent.
    pub identity: Option<Arc<PeerIdentity>>,
    /// The peer's address.
    pub remote_addr: Option<SocketAddr>,
}

/// One verified connection.
pub struct PeerConnection {
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    info: PeerInfo,
}

impl Connected for PeerConnection {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl AsyncRead for PeerConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(context, buffer)
    }
}

impl AsyncWrite for PeerConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(context, buffer)
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(context)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(context)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffers: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(context, buffers)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// The rustls server configuration of a port that accepts `accept`: on the Raft port a
/// node certificate is required; on the admin port a client certificate is optional (an
/// operator may use a token instead), but one that is sent must be valid.
pub fn server_config(credentials: &Arc<Credentials>, accept: Accept) -> Arc<ServerConfig> {
    let verifier = Arc::new(PeerClientVerifier { credentials: Arc::clone(credentials), accept });
    let mut config = ServerConfig::builder_with_provider(super::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("the ring provider supports TLS 1.3")
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(credentials.resolver());
    config.alpn_protocols = vec![b"h2".to_vec()];
    // No resumption: a resumed session would skip the (possibly reloaded) verifier.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Arc::new(config)
}

/// The rustls client configuration a node dials its peers with.
pub fn client_config(credentials: &Arc<Credentials>) -> Arc<ClientConfig> {
    let verifier = Arc::new(PeerServerVerifier { credentials: Arc::clone(credentials) });
    let mut config = ClientConfig::builder_with_provider(super::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("the ring provider supports TLS 1.3")
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_cert_resolver(credentials.resolver());
    config.alpn_protocols = vec![b"h2".to_vec()];
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

/// Accepts TCP connections on `listener`, completes their TLS handshakes with `config`,
/// and yields the verified ones; ends when the stream is dropped (the server stopped).
pub fn incoming(
    listener: TcpListener,
    config: Arc<ServerConfig>,
) -> ReceiverStream<std::io::Result<PeerConnection>> {
    let (accepted, stream) = mpsc::channel(ACCEPTED_QUEUE_MAX);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let handshakes = Arc::new(Semaphore::new(HANDSHAKES_IN_FLIGHT_MAX));
    tokio::spawn(async move {
        loop {
            let (tcp, remote_addr) = tokio::select! {
                () = accepted.closed() => return,
                result = listener.accept() => match result {
                    Ok(connection) => connection,
                    Err(error) => {
                        tracing::warn!(%error, "Raft peer accept failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                        continue;
                    }
                },
            };
            // Over the bound, the connection is closed at once rather than queued.
            let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else {
                tracing::warn!(%remote_addr, "too many TLS handshakes under way; closing");
                continue;
            };
            let (acceptor, accepted) = (acceptor.clone(), accepted.clone());
            tokio::spawn(async move {
                let _permit = permit;
                let _ = tcp.set_nodelay(true);
                let stream =
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(error)) => {
                            tracing::warn!(%remote_addr, %error, "TLS handshake refused");
                            return;
                        }
                        Err(_) => {
                            tracing::warn!(%remote_addr, "TLS handshake timed out");
                            return;
                        }
                    };
                // The verifier has checked the identity already; this only reads it.
                let identity = match stream.get_ref().1.peer_certificates() {
                    None | Some([]) => None,
                    Some([leaf, ..]) => match PeerIdentity::from_certificate(leaf) {
                        Ok(identity) => Some(Arc::new(identity)),
                        Err(error) => {
                            tracing::warn!(%remote_addr, %error, "verified peer without an identity");
                            return;
                        }
                    },
                };
                let info = PeerInfo { identity, remote_addr: Some(remote_addr) };
                let _ = accepted.send(Ok(PeerConnection { stream, info })).await;
            });
        }
    });
    ReceiverStream::new(stream)
}

/// The connection a [`PeerConnector`] makes.
pub type ClientStream = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;

/// A connector for tonic's `Endpoint::connect_with_connector_lazy`: TCP (no Nagle,
/// keep-alive), then TLS with the node's client configuration, verifying the host dialled.
#[derive(Clone)]
pub struct PeerConnector {
    connector: tokio_rustls::TlsConnector,
    keepalive: Duration,
}

impl PeerConnector {
    /// Dials with `config`, probing idle connections every `keepalive`.
    pub fn new(config: Arc<ClientConfig>, keepalive: Duration) -> Self {
        Self { connector: tokio_rustls::TlsConnector::from(config), keepalive }
    }
}

impl tower_service::Service<Uri> for PeerConnector {
    type Response = ClientStream;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<ClientStream>> + Send>>;

    fn poll_ready(&mut self, _context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (connector, keepalive) = (self.connector.clone(), self.keepalive);
        Box::pin(async move {
            let invalid = |what: &str| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what} in {uri}"))
            };
            let host = uri.host().ok_or_else(|| invalid("no host"))?;
            let port = uri.port_u16().ok_or_else(|| invalid("no port"))?;
            let name = host.trim_start_matches('[').trim_end_matches(']').to_owned();
            let server_name = rustls::pki_types::ServerName::try_from(name.clone())
                .map_err(|_| invalid("bad host name"))?;
            let tcp = TcpStream::connect((name.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            socket2::SockRef::from(&tcp)
                .set_tcp_keepalive(&socket2::TcpKeepalive::new().with_time(keepalive))?;
            let stream = connector.connect(server_name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(stream))
        })
    }
}
