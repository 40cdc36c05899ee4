//! The client side of the Raft transport: openraft's `RaftNetworkFactory` over tonic.
//!
//! Each RPC sends one `GroupRequest` (the group's name and the postcard bytes of openraft's
//! request) and decodes `Result<response, RaftError>` from the reply. Every call is bounded
//! by openraft's `RPCOption::hard_ttl`, and messages by [`PEER_MESSAGE_BYTES_MAX`] both
//! ways. Failures map onto openraft's retry rules: a peer that cannot be reached (connection
//! refused, group not hosted there) is `Unreachable`, so replication backs off; a call past its
//! deadline is `Timeout`; any other transport failure is `Network`; the peer's own
//! `RaftError` is `RemoteError`. The server side is `service.rs`.
//!
//! One [`PeerChannels`] per process holds one HTTP/2 channel per peer address, shared by all
//! groups, so several groups to the same peer reuse one connection. With TLS (`crate::tls`)
//! each channel dials through [`crate::tls::transport::PeerConnector`], presenting this
//! node's certificate and verifying the peer's; without it, plaintext.
//!
//! A connection that goes silent (a partition that drops packets rather than refusing them)
//! must not outlive the partition by the kernel's retransmission timers (13 to 19 s
//! measured): HTTP/2 PINGs close it within [`KEEPALIVE_INTERVAL`] + [`KEEPALIVE_TIMEOUT`],
//! and a channel whose calls all ran past their deadline for [`SILENCE_BEFORE_RESET`]
//! ([`TIMEOUTS_BEFORE_RESET`] of them at least) is dropped, so the next call connects afresh
//! (each connect bounded by [`CONNECT_TIMEOUT`]). A few slow calls (a follower's slow fsync
//! against openraft's 50 ms append deadline) never reset a channel: reconnecting would only
//! add a handshake.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use openraft::RPCTypes;
use openraft::error::{
    InstallSnapshotError, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError, Timeout,
    Unreachable,
};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use parking_lot::Mutex;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::transport::{Channel, Endpoint};

use super::proto::GroupRequest;
use super::proto::raft_peer_client::RaftPeerClient;
use super::{BasicNode, GroupConfig, NodeId, PEER_MESSAGE_BYTES_MAX};

/// Most peer addresses whose channel is kept open; a region has 3 to 5 voters and a few
/// gateways. Past this, calls still work on a fresh, unshared channel.
pub const PEER_CHANNELS_MAX: usize = 64;
/// How long opening a TCP connection to a peer may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// TCP keep-alive on peer connections, a backstop for the HTTP/2 PINGs below.
const TCP_KEEPALIVE: Duration = Duration::from_secs(10);
/// How often an HTTP/2 PING goes out on a peer connection, idle or not.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_millis(500);
/// How long a PING may go unanswered before the connection is closed (and reopened by the
/// next call): a peer's loaded machine answers a PING within milliseconds.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(1);
/// Calls to one address in a row that ran past their deadline, at least, before its channel
/// is dropped: a connection whose PINGs still pass but whose calls hang is not reused.
pub const TIMEOUTS_BEFORE_RESET: u32 = 2;
/// How long a channel's calls must all have timed out before it is dropped: longer than the
/// PINGs take to close a dead connection, so this only catches what they cannot.
pub const SILENCE_BEFORE_RESET: Duration = Duration::from_secs(2);
/// How long replication waits before calling an unreachable peer again (openraft's default
/// is 500 ms). Each call costs at most a connect attempt, so a short wait is cheap and a
/// healed peer is reached again within it plus [`CONNECT_TIMEOUT`].
const UNREACHABLE_BACKOFF: Duration = Duration::from_millis(100);
/// Room left in a message for the group name and the protobuf and gRPC framing.
const MESSAGE_FRAMING_BYTES: usize = 1024;

/// Why a call to a peer failed before any reply was decoded.
#[derive(Debug, thiserror::Error)]
pub enum PeerCallError {
    /// The peer's address is not a valid URI authority (`host:port`).
    #[error("invalid peer address {address:?}: {reason}")]
    Address {
        /// The address as configured.
        address: String,
        /// Why it was refused.
        reason: String,
    },
    /// The request could not be encoded.
    #[error("cannot encode the request: {0}")]
    Encode(postcard::Error),
    /// The call ran past its deadline.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The gRPC call failed.
    #[error("gRPC call failed: {0}")]
    Status(#[from] tonic::Status),
    /// The reply could not be decoded (a peer on another version).
    #[error("cannot decode the reply: {0}")]
    Decode(postcard::Error),
}

impl PeerCallError {
    /// Whether the request certainly never reached the peer's Raft (so it was not applied).
    pub fn never_delivered(&self) -> bool {
        match self {
            Self::Address { .. } | Self::Encode(_) => true,
            Self::Status(status) => {
                connection_refused(status) || status.code() == tonic::Code::NotFound
            }
            Self::Timeout(_) | Self::Decode(_) => false,
        }
    }

    /// Whether the peer looks down or not hosting the group, rather than merely slow.
    fn unreachable(&self) -> bool {
        match self {
            Self::Address { .. } => true,
            Self::Status(status) => {
                matches!(status.code(), tonic::Code::Unavailable | tonic::Code::NotFound)
            }
            Self::Encode(_) | Self::Timeout(_) | Self::Decode(_) => false,
        }
    }
}

/// Whether a failed call never got a connection: the connect itself was refused.
fn connection_refused(status: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::ConnectionRefused
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// The channels of a process to its Raft peers, shared by every group; cheap to clone.
#[derive(Clone, Default)]
pub struct PeerChannels {
    channels: Arc<Mutex<HashMap<String, CachedChannel>>>,
    /// The TLS client configuration; `None`: plaintext.
    tls: Option<Arc<rustls::ClientConfig>>,
}

/// One peer's channel, how many calls on it timed out in a row, and when one last did not.
struct CachedChannel {
    channel: Channel,
    timeouts_in_a_row: u32,
    last_answer: std::time::Instant,
}

impl CachedChannel {
    fn new(channel: Channel) -> Self {
        Self { channel, timeouts_in_a_row: 0, last_answer: std::time::Instant::now() }
    }
}

impl PeerChannels {
    /// An empty set; channels open lazily on first use, over TLS with `tls`.
    pub fn new(tls: Option<Arc<rustls::ClientConfig>>) -> Self {
        Self { channels: Arc::default(), tls }
    }

    /// Connects to `addresses` now, in the background, so the first call to each does not
    /// pay for the TCP and TLS handshakes (a lease call's budget is a few milliseconds). A
    /// peer that is not up yet is connected on first use, as without this.
    pub fn connect_early(&self, addresses: impl IntoIterator<Item = String>) {
        for address in addresses {
            let (channels, tls) = (Arc::clone(&self.channels), self.tls.clone());
            tokio::spawn(async move {
                let Ok(endpoint) = endpoint(&address) else { return };
                let connected = match tls {
                    None => endpoint.connect().await,
                    Some(tls) => {
                        let connector =
                            crate::tls::transport::PeerConnector::new(tls, TCP_KEEPALIVE);
                        endpoint.connect_with_connector(connector).await
                    }
                };
                if let Ok(channel) = connected {
                    let mut channels = channels.lock();
                    if channels.len() < PEER_CHANNELS_MAX {
                        channels.entry(address).or_insert_with(|| CachedChannel::new(channel));
                    }
                }
            });
        }
    }

    fn client(&self, address: &str) -> Result<RaftPeerClient<Channel>, PeerCallError> {
        let channel = {
            let mut channels = self.channels.lock();
            match channels.get(address) {
                Some(cached) => cached.channel.clone(),
                None => {
                    let channel = connect_lazy(&endpoint(address)?, self.tls.as_ref());
                    if channels.len() < PEER_CHANNELS_MAX {
                        channels.insert(address.to_owned(), CachedChannel::new(channel.clone()));
                    }
                    channel
                }
            }
        };
        Ok(RaftPeerClient::new(channel)
            .max_decoding_message_size(PEER_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(PEER_MESSAGE_BYTES_MAX))
    }

    /// Sends one already-encoded request to `group` on the peer at `address` and returns the
    /// reply's payload, within `timeout`.
    pub(crate) async fn call_raw(
        &self,
        address: &str,
        rpc: Rpc,
        group: &str,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, PeerCallError> {
        let mut client = self.client(address)?;
        let mut request = tonic::Request::new(GroupRequest { group: group.to_owned(), payload });
        // The header tells the server when to give up; the local timeout covers the connect.
        request.set_timeout(timeout);
        let call = async {
            match rpc {
                Rpc::AppendEntries => client.append_entries(request).await,
                Rpc::Vote => client.vote(request).await,
                Rpc::InstallSnapshot => client.install_snapshot(request).await,
                Rpc::Forward => client.forward(request).await,
                Rpc::FetchPolicy => client.fetch_policy(request).await,
            }
        };
        let result = match tokio::time::timeout(timeout, call).await {
            Err(_) => Err(PeerCallError::Timeout(timeout)),
            Ok(Err(status)) if status.code() == tonic::Code::DeadlineExceeded => {
                Err(PeerCallError::Timeout(timeout))
            }
            // The peer's tonic server gave up at the deadline this call's header set (a slow
            // follower): a timeout, not a transport failure.
            Ok(Err(status))
                if status.code() == tonic::Code::Cancelled
                    && status.message() == "Timeout expired" =>
            {
                Err(PeerCallError::Timeout(timeout))
            }
            Ok(Err(status)) => Err(PeerCallError::Status(status)),
            Ok(Ok(reply)) => Ok(reply.into_inner().payload),
        };
        self.count_timeout(address, matches!(result, Err(PeerCallError::Timeout(_))));
        result
    }

    /// Counts a timed-out call to `address` (or clears the count), and drops the channel
    /// after [`TIMEOUTS_BEFORE_RESET`] in a row spanning [`SILENCE_BEFORE_RESET`]: calls in
    /// flight on it finish or time out on their own; the next call opens a new connection.
    fn count_timeout(&self, address: &str, timed_out: bool) {
        let mut channels = self.channels.lock();
        let Some(cached) = channels.get_mut(address) else { return };
        if !timed_out {
            cached.timeouts_in_a_row = 0;
            cached.last_answer = std::time::Instant::now();
            return;
        }
        cached.timeouts_in_a_row = cached.timeouts_in_a_row.saturating_add(1);
        if cached.timeouts_in_a_row >= TIMEOUTS_BEFORE_RESET
            && cached.last_answer.elapsed() >= SILENCE_BEFORE_RESET
        {
            channels.remove(address);
            tracing::debug!(%address, "peer channel reset after calls timed out in a row");
        }
    }

    /// Encodes `request`, calls, and decodes the reply as `Result<Response, E>`.
    pub(crate) async fn call<Request, Response, E>(
        &self,
        address: &str,
        rpc: Rpc,
        group: &str,
        request: &Request,
        timeout: Duration,
    ) -> Result<Result<Response, E>, PeerCallError>
    where
        Request: Serialize,
        Response: DeserializeOwned,
        E: DeserializeOwned,
    {
        let payload = postcard::to_allocvec(request).map_err(PeerCallError::Encode)?;
        let reply = self.call_raw(address, rpc, group, payload, timeout).await?;
        postcard::from_bytes(&reply).map_err(PeerCallError::Decode)
    }
}

/// The endpoint of the peer at `address` (`host:port`).
fn endpoint(address: &str) -> Result<Endpoint, PeerCallError> {
    Ok(Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| PeerCallError::Address { address: address.to_owned(), reason: e.to_string() })?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .tcp_keepalive(Some(TCP_KEEPALIVE))
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true))
}

/// A lazily connecting channel to `endpoint`, through TLS when `tls` is set (the TCP
/// settings are then the connector's: tonic applies its own only to plaintext).
fn connect_lazy(endpoint: &Endpoint, tls: Option<&Arc<rustls::ClientConfig>>) -> Channel {
    match tls {
        None => endpoint.connect_lazy(),
        Some(tls) => endpoint.connect_with_connector_lazy(
            crate::tls::transport::PeerConnector::new(Arc::clone(tls), TCP_KEEPALIVE),
        ),
    }
}

/// The RPCs of `RaftPeer`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rpc {
    AppendEntries,
    Vote,
    InstallSnapshot,
    Forward,
    FetchPolicy,
}

/// openraft's network factory for one group on one node.
pub struct PeerNetwork<C> {
    group: Arc<str>,
    node_id: NodeId,
    channels: PeerChannels,
    _config: PhantomData<fn() -> C>,
}

impl<C> PeerNetwork<C> {
    /// The network of group `group` on node `node_id`, over `channels`.
    pub fn new(group: Arc<str>, node_id: NodeId, channels: PeerChannels) -> Self {
        Self { group, node_id, channels, _config: PhantomData }
    }
}

impl<C: GroupConfig> RaftNetworkFactory<C> for PeerNetwork<C> {
    type Network = PeerClient<C>;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Self::Network {
        PeerClient {
            group: Arc::clone(&self.group),
            node_id: self.node_id,
            target,
            target_node: node.clone(),
            channels: self.channels.clone(),
            failures: FailureLog::default(),
            _config: PhantomData,
        }
    }
}

/// Failed calls to one peer since the last WARN about them (see `crate::logging`: openraft's
/// own ERROR per failed call is dropped, this says the same once per interval).
#[derive(Default)]
struct FailureLog {
    last_logged: Option<std::time::Instant>,
    failed_since_logged: u64,
}

impl FailureLog {
    /// Counts a failed call and returns how many to report now, if a line is due.
    fn failed(&mut self, now: std::time::Instant) -> Option<u64> {
        self.failed_since_logged = self.failed_since_logged.saturating_add(1);
        let due = self.last_logged.is_none_or(|last| {
            now.saturating_duration_since(last) >= crate::logging::PEER_FAILURE_LOG_INTERVAL
        });
        if !due {
            return None;
        }
        self.last_logged = Some(now);
        Some(std::mem::take(&mut self.failed_since_logged))
    }
}

/// One group's connection to one peer, as openraft's replication and election use it.
pub struct PeerClient<C> {
    group: Arc<str>,
    node_id: NodeId,
    target: NodeId,
    target_node: BasicNode,
    channels: PeerChannels,
    failures: FailureLog,
    _config: PhantomData<fn() -> C>,
}

impl<C: GroupConfig> PeerClient<C> {
    /// Sends an encoded request and maps every failure onto openraft's retry rules.
    async fn send<Response, E>(
        &mut self,
        rpc: Rpc,
        action: RPCTypes,
        payload: Vec<u8>,
        option: &RPCOption,
    ) -> Result<Response, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Response: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let timeout = option.hard_ttl();
        let reply = self
            .channels
            .call_raw(&self.target_node.addr, rpc, &self.group, payload, timeout)
            .await
            .and_then(|bytes| {
                postcard::from_bytes::<Result<Response, RaftError<NodeId, E>>>(&bytes)
                    .map_err(PeerCallError::Decode)
            });
        if let Err(error) = &reply
            && let Some(failed_calls) = self.failures.failed(std::time::Instant::now())
        {
            // A busy follower misses a heartbeat deadline now and then; a stopped one fails
            // every call. Either is worth a line, neither an ERROR per call.
            tracing::warn!(
                group = %self.group,
                peer = %self.target,
                address = %self.target_node.addr,
                rpc = ?rpc,
                %error,
                failed_calls,
                "Raft calls to a peer failed (counted since the last such line, at most one \
                 per {:?}); replication retries",
                crate::logging::PEER_FAILURE_LOG_INTERVAL,
            );
        }
        match reply {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(remote)) => Err(RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                self.target_node.clone(),
                remote,
            ))),
            Err(PeerCallError::Timeout(timeout)) => Err(RPCError::Timeout(Timeout {
                action,
                id: self.node_id,
                target: self.target,
                timeout,
            })),
            Err(error) if error.unreachable() => {
                Err(RPCError::Unreachable(Unreachable::new(&error)))
            }
            Err(error) => Err(RPCError::Network(NetworkError::new(&error))),
        }
    }
}

fn encode<T: Serialize, E: std::error::Error>(
    request: &T,
) -> Result<Vec<u8>, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>> {
    postcard::to_allocvec(request).map_err(|e| RPCError::Network(NetworkError::new(&e)))
}

impl<C: GroupConfig> RaftNetwork<C> for PeerClient<C> {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let payload = encode(&rpc)?;
        // Ask openraft to split a batch that would not fit in one message.
        if payload.len() > PEER_MESSAGE_BYTES_MAX - MESSAGE_FRAMING_BYTES && rpc.entries.len() > 1 {
            let hint = u64::try_from(rpc.entries.len() / 2).unwrap_or(1).max(1);
            return Err(RPCError::PayloadTooLarge(PayloadTooLarge::new_entries_hint(hint)));
        }
        self.send(Rpc::AppendEntries, RPCTypes::AppendEntries, payload, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<C>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        let payload = encode(&rpc)?;
        self.send(Rpc::InstallSnapshot, RPCTypes::InstallSnapshot, payload, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let payload = encode(&rpc)?;
        self.send(Rpc::Vote, RPCTypes::Vote, payload, &option).await
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(std::iter::repeat(UNREACHABLE_BACKOFF))
    }
}
