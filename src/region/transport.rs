//! The QUIC endpoint of a region's rebalancer: a server for the other regions' calls and one
//! link per peer region, on one UDP socket.
//!
//! Both sides use the node's cluster credentials (`crate::tls`): TLS 1.3 with a required
//! client certificate, chains verified against the cluster CA and the cluster id checked,
//! never "skip verification". On top, a region link only talks to **voters of a peer
//! region**: the server closes a connection whose certificate names a gateway, an unknown
//! region or its own; the client closes one whose server does not name the region it
//! dialled. A request speaks only for the calling region's own transfers.
//!
//! Every call is bounded: [`CONNECT_TIMEOUT`] to connect, one stream per call and
//! [`CALL_TIMEOUT`] for its exchange,
//! [`MESSAGE_BYTES_MAX`](super::wire::MESSAGE_BYTES_MAX) per message, at most
//! [`STREAMS_PER_CONNECTION_MAX`] calls at once per connection and
//! [`CONNECTIONS_MAX`] connections. Connections send keepalives every [`KEEPALIVE`] and
//! die after [`IDLE_TIMEOUT`] of silence; a link reconnects on its next call. After a
//! failed connect or a failed call (a peer stopped with its connection open answers no
//! call, and each would cost a [`CALL_TIMEOUT`]) it waits an exponential backoff (from
//! [`RECONNECT_BACKOFF_MIN`] to [`RECONNECT_BACKOFF_MAX`]) during which calls fail at once,
//! until a call succeeds again: a region that is down never holds up a caller for long.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::RegionPeer;
use super::wire::{self, MESSAGE_BYTES_MAX, RegionReply, RegionRequest, WireError};
use crate::tls::credentials::{Accept, Credentials};
use crate::tls::{Holder, PeerIdentity, transport as tls_transport};

/// The application protocol regions speak (ALPN).
pub const ALPN: &[u8] = b"quotamesh-region/1";
/// Longest a call's exchange (request and reply on one stream) may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest connecting to a peer region (UDP, QUIC and TLS handshake) may take: a few round
/// trips across the world.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a peer may take to complete its handshake with the server.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Keepalive interval of every connection.
pub const KEEPALIVE: Duration = Duration::from_secs(5);
/// A connection silent this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Most calls in flight on one connection.
pub const STREAMS_PER_CONNECTION_MAX: u32 = 64;
/// Most connections the server holds at once.
pub const CONNECTIONS_MAX: usize = 64;
/// First wait before reconnecting after a failure.
pub const RECONNECT_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait before reconnecting.
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(10);

const _: () = assert!(KEEPALIVE.as_millis() * 2 < IDLE_TIMEOUT.as_millis());
const _: () = assert!(RECONNECT_BACKOFF_MIN.as_millis() <= RECONNECT_BACKOFF_MAX.as_millis());

/// QUIC error code a server closes a refused connection with.
const CLOSE_REFUSED: u32 = 1;

/// The endpoint could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The UDP socket could not be bound.
    #[error("cannot bind QUIC on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The IO error.
        source: std::io::Error,
    },
    /// A peer region is listed twice, or is this region.
    #[error("invalid [[regions]]: {0}")]
    Peers(String),
}

/// Why a call to a peer region failed; it may have been applied (retry with the same id).
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No `[[regions]]` entry for the region.
    #[error("region {0} is not a configured peer")]
    UnknownRegion(String),
    /// The link failed recently and waits before reconnecting.
    #[error("region {region} is unreachable; next attempt in {wait_ms} ms")]
    BackingOff {
        /// The peer region.
        region: String,
        /// How long until the link tries again.
        wait_ms: u64,
    },
    /// Connecting, the handshake or the peer's identity failed.
    #[error("cannot connect to region {region}: {reason}")]
    Connect {
        /// The peer region.
        region: String,
        /// What failed.
        reason: String,
    },
    /// The exchange failed or took longer than [`CALL_TIMEOUT`].
    #[error("call to region {region} failed: {reason}")]
    Exchange {
        /// The peer region.
        region: String,
        /// What failed.
        reason: String,
    },
    /// The request or the reply broke the protocol.
    #[error("call to region {region}: {source}")]
    Wire {
        /// The peer region.
        region: String,
        /// The wire error.
        source: WireError,
    },
}

/// What answers the other regions' requests: the region's rebalancer, given the calling
/// region (already authenticated) and its request.
pub type Handler = Arc<
    dyn Fn(String, RegionRequest) -> Pin<Box<dyn Future<Output = RegionReply> + Send>>
        + Send
        + Sync,
>;

/// A region's QUIC endpoint: the server and the links to its peers, on one socket.
pub struct RegionEndpoint {
    endpoint: quinn::Endpoint,
    region: String,
    links: BTreeMap<String, Arc<PeerLink>>,
    /// Connections the server closed or failed: a certificate of another CA or cluster
    /// (the handshake fails), of a gateway, of an unknown region or of this one.
    refused: Arc<AtomicU64>,
}

/// What one link carried since it was made: its calls, and the bytes of their requests and
/// replies (message bytes; QUIC, TLS and UDP headers and keepalives are not counted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkTraffic {
    /// Calls that got a reply (each is one request and one reply message).
    pub calls: u64,
    /// Request bytes sent.
    pub sent_bytes: u64,
    /// Reply bytes received.
    pub received_bytes: u64,
}

fn transport_config() -> Arc<quinn::TransportConfig> {
    let mut transport = quinn::TransportConfig::default();
    transport.keep_alive_interval(Some(KEEPALIVE));
    transport.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(IDLE_TIMEOUT).expect("30 s is a valid QUIC idle timeout"),
    ));
    transport.max_concurrent_bidi_streams(STREAMS_PER_CONNECTION_MAX.into());
    transport.max_concurrent_uni_streams(0_u32.into());
    Arc::new(transport)
}

/// The region a verified peer certificate names, if it is a voter's (gateways only lease).
fn peer_region(connection: &quinn::Connection) -> Result<String, String> {
    let identity = connection
        .peer_identity()
        .ok_or("no peer certificate")?
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .map_err(|_| "unexpected peer identity type")?;
    let end_entity = identity.first().ok_or("empty certificate chain")?;
    let identity = PeerIdentity::from_certificate(end_entity).map_err(|e| e.to_string())?;
    match identity.holder {
        Holder::Node { region, .. } => Ok(region),
        other => Err(format!("{other:?} is not a region's voter")),
    }
}

impl RegionEndpoint {
    /// Binds `addr` (UDP) for region `region` with the node's cluster credentials; `peers`
    /// are the other regions.
    ///
    /// # Errors
    /// [`EndpointError`] when the socket cannot be bound or `peers` repeats a region or names
    /// this one.
    pub fn bind(
        addr: SocketAddr,
        credentials: &Arc<Credentials>,
        region: &str,
        peers: &[RegionPeer],
    ) -> Result<Self, EndpointError> {
        let mut server_tls = (*tls_transport::server_config(credentials, Accept::Nodes)).clone();
        server_tls.alpn_protocols = vec![ALPN.to_vec()];
        let mut client_tls = (*tls_transport::client_config(credentials)).clone();
        client_tls.alpn_protocols = vec![ALPN.to_vec()];
        let server_crypto = QuicServerConfig::try_from(server_tls)
            .expect("the TLS 1.3 ring configuration has QUIC's initial cipher suite");
        let client_crypto = QuicClientConfig::try_from(client_tls)
            .expect("the TLS 1.3 ring configuration has QUIC's initial cipher suite");
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server.transport_config(transport_config());
        let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
        client.transport_config(transport_config());
        let mut endpoint = quinn::Endpoint::server(server, addr)
            .map_err(|source| EndpointError::Bind { addr, source })?;
        endpoint.set_default_client_config(client);
        let mut links = BTreeMap::new();
        for peer in peers {
            if peer.name == region {
                return Err(EndpointError::Peers(format!(
                    "{} is this node's own region",
                    peer.name
                )));
            }
            let link = PeerLink::new(endpoint.clone(), peer.clone());
            if links.insert(peer.name.clone(), Arc::new(link)).is_some() {
                return Err(EndpointError::Peers(format!("region {} is listed twice", peer.name)));
            }
        }
        Ok(Self { endpoint, region: region.to_owned(), links, refused: Arc::default() })
    }

    /// Connections the server refused since it started (see the field's doc).
    #[must_use]
    pub fn refused_connections(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// The bound address.
    ///
    /// # Errors
    /// The socket's error.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// The link to peer region `region`.
    #[must_use]
    pub fn link(&self, region: &str) -> Option<Arc<PeerLink>> {
        self.links.get(region).cloned()
    }

    /// Calls peer region `region`.
    ///
    /// # Errors
    /// [`CallError`]; an error does not say the request was not applied.
    pub async fn call(
        &self,
        region: &str,
        request: &RegionRequest,
    ) -> Result<RegionReply, CallError> {
        let link = self.link(region).ok_or_else(|| CallError::UnknownRegion(region.to_owned()))?;
        link.call(request).await
    }

    /// Serves the peers' calls with `handler` until the endpoint is closed.
    pub fn serve(&self, handler: Handler) -> tokio::task::JoinHandle<()> {
        let endpoint = self.endpoint.clone();
        let own = self.region.clone();
        let peers: Arc<Vec<String>> = Arc::new(self.links.keys().cloned().collect());
        let connections = Arc::new(Semaphore::new(CONNECTIONS_MAX));
        let refused = Arc::clone(&self.refused);
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
                    incoming.refuse();
                    continue;
                };
                let (own, peers, handler) = (own.clone(), Arc::clone(&peers), Arc::clone(&handler));
                let refused = Arc::clone(&refused);
                tokio::spawn(async move {
                    let _permit = permit;
                    let connection = match tokio::time::timeout(HANDSHAKE_TIMEOUT, incoming).await {
                        Ok(Ok(connection)) => connection,
                        Ok(Err(error)) => {
                            // A certificate this cluster's CA did not sign ends here.
                            refused.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(%error, "refused QUIC connection: handshake failed");
                            return;
                        }
                        Err(_) => return,
                    };
                    let region = match peer_region(&connection) {
                        Ok(region) if region != own && peers.contains(&region) => region,
                        Ok(region) => {
                            refused.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(%region, "refused QUIC connection: not a peer region");
                            connection.close(CLOSE_REFUSED.into(), b"not a peer region");
                            return;
                        }
                        Err(reason) => {
                            refused.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(%reason, "refused QUIC connection");
                            connection.close(CLOSE_REFUSED.into(), b"not a region voter");
                            return;
                        }
                    };
                    serve_connection(connection, region, handler).await;
                });
            }
        })
    }

    /// Closes every connection and the socket.
    pub fn close(&self) {
        self.endpoint.close(0_u32.into(), b"shutting down");
    }
}

/// Answers the streams of one authenticated peer region.
async fn serve_connection(connection: quinn::Connection, region: String, handler: Handler) {
    while let Ok((mut send, mut recv)) = connection.accept_bi().await {
        let (region, handler) = (region.clone(), Arc::clone(&handler));
        tokio::spawn(async move {
            let exchange = async {
                let bytes = recv.read_to_end(MESSAGE_BYTES_MAX).await.map_err(|e| e.to_string())?;
                let reply = match wire::decode::<RegionRequest>(&bytes) {
                    Err(error) => RegionReply::refused(error.to_string(), false),
                    Ok(RegionRequest::Transfer(transfer)) if transfer.id().donor != region => {
                        RegionReply::refused(
                            format!("region {region} may only speak for its own transfers"),
                            false,
                        )
                    }
                    Ok(request) => handler(region.clone(), request).await,
                };
                let bytes = wire::encode(&reply).map_err(|e| e.to_string())?;
                send.write_all(&bytes).await.map_err(|e| e.to_string())?;
                send.finish().map_err(|e| e.to_string())
            };
            match tokio::time::timeout(CALL_TIMEOUT, exchange).await {
                Ok(Ok(())) => {}
                Ok(Err(reason)) => tracing::debug!(%region, %reason, "region stream failed"),
                Err(_) => tracing::debug!(%region, "region stream timed out"),
            }
        });
    }
}

/// The state of a link: its connection, and the backoff after failures.
#[derive(Default)]
struct LinkState {
    connection: Option<quinn::Connection>,
    failures: u32,
    retry_at: Option<Instant>,
}

/// One peer region: its connection, reopened on demand with backoff.
pub struct PeerLink {
    endpoint: quinn::Endpoint,
    peer: RegionPeer,
    state: tokio::sync::Mutex<LinkState>,
    calls: AtomicU64,
    sent_bytes: AtomicU64,
    received_bytes: AtomicU64,
}

impl PeerLink {
    fn new(endpoint: quinn::Endpoint, peer: RegionPeer) -> Self {
        Self {
            endpoint,
            peer,
            state: tokio::sync::Mutex::new(LinkState::default()),
            calls: AtomicU64::new(0),
            sent_bytes: AtomicU64::new(0),
            received_bytes: AtomicU64::new(0),
        }
    }

    /// What the link carried so far.
    #[must_use]
    pub fn traffic(&self) -> LinkTraffic {
        LinkTraffic {
            calls: self.calls.load(Ordering::Relaxed),
            sent_bytes: self.sent_bytes.load(Ordering::Relaxed),
            received_bytes: self.received_bytes.load(Ordering::Relaxed),
        }
    }

    /// The peer region's name.
    #[must_use]
    pub fn region(&self) -> &str {
        &self.peer.name
    }

    /// The round-trip time of the live connection, if there is one.
    pub async fn rtt(&self) -> Option<Duration> {
        self.state.lock().await.connection.as_ref().map(quinn::Connection::rtt)
    }

    /// True while a connection is open.
    pub async fn is_connected(&self) -> bool {
        self.state.lock().await.connection.as_ref().is_some_and(|c| c.close_reason().is_none())
    }

    /// Sends one request on its own stream and reads the reply, within [`CALL_TIMEOUT`].
    ///
    /// # Errors
    /// [`CallError`]: during a backoff at once, otherwise when connecting or the exchange
    /// fails; the request may still have been applied.
    pub async fn call(&self, request: &RegionRequest) -> Result<RegionReply, CallError> {
        let bytes = wire::encode(request)
            .map_err(|source| CallError::Wire { region: self.peer.name.clone(), source })?;
        let connection = self.connection().await?;
        let exchange = async {
            let (mut send, mut recv) = connection.open_bi().await.map_err(|e| e.to_string())?;
            send.write_all(&bytes).await.map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            recv.read_to_end(MESSAGE_BYTES_MAX).await.map_err(|e| e.to_string())
        };
        let reply = match tokio::time::timeout(CALL_TIMEOUT, exchange).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(reason)) => {
                return Err(self
                    .failed(CallError::Exchange { region: self.peer.name.clone(), reason })
                    .await);
            }
            Err(_) => {
                let reason = format!("no reply within {} ms", CALL_TIMEOUT.as_millis());
                return Err(self
                    .failed(CallError::Exchange { region: self.peer.name.clone(), reason })
                    .await);
            }
        };
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.sent_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.received_bytes.fetch_add(reply.len() as u64, Ordering::Relaxed);
        let reply = wire::decode(&reply)
            .map_err(|source| CallError::Wire { region: self.peer.name.clone(), source })?;
        let mut state = self.state.lock().await;
        state.failures = 0;
        state.retry_at = None;
        Ok(reply)
    }

    /// The open connection, or a new one (unless backing off).
    async fn connection(&self) -> Result<quinn::Connection, CallError> {
        let mut state = self.state.lock().await;
        if let Some(connection) = &state.connection {
            if connection.close_reason().is_none() {
                return Ok(connection.clone());
            }
            state.connection = None;
        }
        if let Some(retry_at) = state.retry_at {
            let now = Instant::now();
            if retry_at > now {
                let wait_ms = u64::try_from((retry_at - now).as_millis()).unwrap_or(u64::MAX);
                return Err(CallError::BackingOff { region: self.peer.name.clone(), wait_ms });
            }
        }
        match tokio::time::timeout(CONNECT_TIMEOUT, self.connect()).await {
            Ok(Ok(connection)) => {
                // The failures are forgotten only when a call succeeds: a peer that accepts
                // connections but answers no call keeps backing off.
                state.retry_at = None;
                state.connection = Some(connection.clone());
                Ok(connection)
            }
            Ok(Err(reason)) => Err(Self::back_off(&mut state, &self.peer.name, reason)),
            Err(_) => {
                let reason = format!("no handshake within {} ms", CONNECT_TIMEOUT.as_millis());
                Err(Self::back_off(&mut state, &self.peer.name, reason))
            }
        }
    }

    /// Dials the peer and checks its certificate names a voter of the region dialled.
    async fn connect(&self) -> Result<quinn::Connection, String> {
        // The peer's certificate must carry its address as a SAN, as on the Raft port.
        let server_name = self.peer.quic_addr.ip().to_string();
        let connecting =
            self.endpoint.connect(self.peer.quic_addr, &server_name).map_err(|e| e.to_string())?;
        let connection = connecting.await.map_err(|e| e.to_string())?;
        match peer_region(&connection) {
            Ok(region) if region == self.peer.name => Ok(connection),
            Ok(region) => {
                connection.close(CLOSE_REFUSED.into(), b"unexpected region");
                Err(format!("the peer at {} is region {region}", self.peer.quic_addr))
            }
            Err(reason) => {
                connection.close(CLOSE_REFUSED.into(), b"not a region voter");
                Err(reason)
            }
        }
    }

    fn back_off(state: &mut LinkState, region: &str, reason: String) -> CallError {
        Self::delay_retry(state);
        CallError::Connect { region: region.to_owned(), reason }
    }

    /// Counts a failure and sets when the link may try again.
    fn delay_retry(state: &mut LinkState) {
        state.failures = state.failures.saturating_add(1);
        let exponent = state.failures.saturating_sub(1).min(16);
        let wait = RECONNECT_BACKOFF_MIN.saturating_mul(1 << exponent).min(RECONNECT_BACKOFF_MAX);
        state.retry_at = Some(Instant::now() + wait);
    }

    /// Drops the connection after a failed exchange, so the next call reconnects, and
    /// backs off as after a failed connect.
    async fn failed(&self, error: CallError) -> CallError {
        let mut state = self.state.lock().await;
        if let Some(connection) = state.connection.take() {
            connection.close(0_u32.into(), b"call failed");
        }
        Self::delay_retry(&mut state);
        error
    }
}

#[cfg(test)]
mod tests;
