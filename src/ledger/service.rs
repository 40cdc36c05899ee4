//! The server side of the Raft transport: one tonic `RaftPeer` service per process, routing
//! each request by its group name to that group's handle ([`RaftGroup`]).
//!
//! The service decodes openraft's request from postcard, hands it to the group's core
//! through the handle (whose gate a shutdown closes before the core stops), and
//! encodes `Result<response, RaftError>` back, so a remote Raft error reaches the caller's
//! openraft as a value (`RemoteError`), never as a gRPC status. Statuses mean transport
//! trouble: `NOT_FOUND` for a group this process does not host (yet), `INVALID_ARGUMENT` for
//! an undecodable payload. `Forward` carries the sender's id and wall clock with the command
//! (`ledger_time.rs`); it runs the write on this node, stamped with this node's ledger time,
//! and never forwards it again. The client side is `network.rs`; the group handle is
//! `group.rs`.
//!
//! On a TLS port (`crate::tls`) every request carries the Raft node id its caller's verified
//! certificate names, and whether that is a voter's certificate or a gateway's; a node
//! speaks only for itself:
//!
//! ```text
//!  AppendEntries, InstallSnapshot   vote.leader_id names the sender; a voter's certificate
//!  Vote                             vote.leader_id (the candidate) names the sender; a voter's
//!  Forward                          GroupConfig::check_forward (own leases only; policy and
//!                                   billing from voters, each operation naming its caller)
//!  FetchPolicy                      any node of the cluster (a read of the quota group's
//!                                   current policy version, which every node serves)
//! ```
//!
//! The role comes from the certificate, not from the membership: a leader being removed
//! still leads until the new membership commits, while followers already hold that
//! membership, so a membership check would stall the change. Refusals are
//! `PERMISSION_DENIED`; a request without a node identity on an authenticated service is
//! `UNAUTHENTICATED`. A `Forward` whose stated sender is not the certificate's is refused too.

use tower_layer::{Identity, Stack};

use crate::api::grpc_metrics::GrpcMetricsLayer;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use openraft::error::{ClientWriteError, InstallSnapshotError, RaftError};
use parking_lot::RwLock;
use serde::Serialize;
use tonic::{Request, Response, Status};

use super::ledger_time::Forwarded;
use super::proto::raft_peer_server::{RaftPeer, RaftPeerServer};
use super::proto::{GroupReply, GroupRequest};
use super::quota::{PolicyFetch, PolicyFetched};
use super::{
    BasicNode, COMMAND_BYTES_MAX, GroupConfig, NodeId, PEER_MESSAGE_BYTES_MAX, QUOTA_GROUP_NAME,
    QuotaGroup, RaftGroup,
};
use crate::tls::transport::PeerInfo;

/// Most groups one process hosts (quota, billing, and room for multi-raft shards).
pub const GROUPS_PER_PROCESS_MAX: usize = 64;
/// Most requests served at once on one peer connection; openraft keeps one replication
/// stream per group and peer, so this is ample while bounding a misbehaving peer.
const CONCURRENT_REQUESTS_PER_CONNECTION_MAX: usize = 256;
/// Longest any request may run on the server, whatever deadline the caller sent.
const SERVER_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a group could not be registered with the service. Registering again will not help
/// without unregistering first.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// A group of that name is already registered.
    #[error("group {0:?} is already registered")]
    Duplicate(String),
    /// [`GROUPS_PER_PROCESS_MAX`] groups are registered already.
    #[error("at most {GROUPS_PER_PROCESS_MAX} groups per process")]
    TooMany,
}

/// A verified caller on a TLS port: its node id and whether its certificate is a voter's.
#[derive(Debug, Clone, Copy)]
struct Sender {
    node_id: NodeId,
    may_vote: bool,
}

/// One group as the service sees it: bytes in, bytes out. `sender` is the verified caller
/// on a TLS port, `None` on a plaintext one (which checks nothing).
#[tonic::async_trait]
trait GroupEndpoint: Send + Sync + 'static {
    async fn append_entries(
        &self,
        payload: &[u8],
        sender: Option<Sender>,
    ) -> Result<Vec<u8>, Status>;
    async fn vote(&self, payload: &[u8], sender: Option<Sender>) -> Result<Vec<u8>, Status>;
    async fn install_snapshot(
        &self,
        payload: &[u8],
        sender: Option<Sender>,
    ) -> Result<Vec<u8>, Status>;
    async fn forward(&self, payload: &[u8], sender: Option<Sender>) -> Result<Vec<u8>, Status>;
}

struct Endpoint<C: GroupConfig> {
    /// The group's handle: messages reach the core through its gate, and forwarded writes
    /// are stamped with ledger time.
    group: RaftGroup<C>,
}

fn decode<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Result<T, Status> {
    postcard::from_bytes(payload)
        .map_err(|e| Status::invalid_argument(format!("undecodable payload: {e}")))
}

fn encode<T: Serialize>(reply: &T) -> Result<Vec<u8>, Status> {
    postcard::to_allocvec(reply)
        .map_err(|e| Status::internal(format!("cannot encode the reply: {e}")))
}

/// Checks a Raft message whose vote names `claimed` as leader or candidate: only a voter's
/// certificate, and only in its own name.
fn check_raft_sender(
    rpc: &str,
    claimed: Option<NodeId>,
    sender: Option<Sender>,
) -> Result<(), Status> {
    let Some(sender) = sender else { return Ok(()) };
    if !sender.may_vote {
        return Err(Status::permission_denied(format!(
            "{rpc} from gateway {}: a gateway sends no Raft messages",
            sender.node_id
        )));
    }
    if claimed != Some(sender.node_id) {
        return Err(Status::permission_denied(format!(
            "{rpc} from node {} speaks for node {claimed:?}",
            sender.node_id
        )));
    }
    Ok(())
}

impl<C: GroupConfig> Endpoint<C> {
    /// Refuses a Raft message once the group's core has stopped, on a storage failure or at
    /// shutdown (the group's gate refuses those too): openraft logs every call to a stopped
    /// core as an ERROR. The peer sees UNAVAILABLE, as for a node that is down.
    fn check_running(&self) -> Result<(), Status> {
        if self.group.core_stopped() {
            return Err(Status::unavailable("this node's Raft group is stopping"));
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl<C: GroupConfig> GroupEndpoint for Endpoint<C> {
    async fn append_entries(
        &self,
        payload: &[u8],
        sender: Option<Sender>,
    ) -> Result<Vec<u8>, Status> {
        let request: openraft::raft::AppendEntriesRequest<C> = decode(payload)?;
        check_raft_sender("AppendEntries", request.vote.leader_id().voted_for(), sender)?;
        self.check_running()?;
        encode(&self.group.append_entries(request).await)
    }

    async fn vote(&self, payload: &[u8], sender: Option<Sender>) -> Result<Vec<u8>, Status> {
        let request: openraft::raft::VoteRequest<NodeId> = decode(payload)?;
        check_raft_sender("Vote", request.vote.leader_id().voted_for(), sender)?;
        self.check_running()?;
        encode(&self.group.vote(request).await)
    }

    async fn install_snapshot(
        &self,
        payload: &[u8],
        sender: Option<Sender>,
    ) -> Result<Vec<u8>, Status> {
        let request: openraft::raft::InstallSnapshotRequest<C> = decode(payload)?;
        check_raft_sender("InstallSnapshot", request.vote.leader_id().voted_for(), sender)?;
        self.check_running()?;
        let reply: Result<_, RaftError<NodeId, InstallSnapshotError>> =
            self.group.install_snapshot(request).await;
        encode(&reply)
    }

    async fn forward(&self, payload: &[u8], sender: Option<Sender>) -> Result<Vec<u8>, Status> {
        if payload.len() > COMMAND_BYTES_MAX {
            return Err(Status::invalid_argument(format!(
                "command of {} bytes exceeds {COMMAND_BYTES_MAX}",
                payload.len()
            )));
        }
        let forwarded: Forwarded<C::D> = decode(payload)?;
        if let Some(sender) = sender {
            if forwarded.from != sender.node_id {
                return Err(Status::permission_denied(format!(
                    "Forward from node {} says it comes from node {}",
                    sender.node_id, forwarded.from
                )));
            }
            C::check_forward(&forwarded.command, sender.node_id, sender.may_vote)
                .map_err(Status::permission_denied)?;
        }
        let reply: Result<C::R, RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>> =
            self.group.forwarded(forwarded).await;
        encode(&reply)
    }
}

/// The `RaftPeer` gRPC service of one process; cheap to clone, groups come and go.
#[derive(Clone, Default)]
pub struct RaftPeerService {
    groups: Arc<RwLock<HashMap<String, Arc<dyn GroupEndpoint>>>>,
    /// Served over TLS: every request must carry its caller's identity.
    authenticated: bool,
    /// Where the server's calls are counted; none in tests that run the service bare.
    grpc_metrics: Option<GrpcMetricsLayer>,
    /// The quota group whose policy versions `FetchPolicy` serves, once registered.
    quota: Arc<RwLock<Option<RaftGroup<QuotaGroup>>>>,
}

impl RaftPeerService {
    /// A service hosting no group yet; `authenticated` when it is served over TLS
    /// ([`Self::serve_tls`]), so every request must name its verified sender.
    pub fn new(authenticated: bool) -> Self {
        Self { groups: Arc::default(), authenticated, grpc_metrics: None, quota: Arc::default() }
    }

    /// Counts the server's calls in `metrics` (`quotamesh_grpc_server_*`).
    #[must_use]
    pub fn with_grpc_metrics(mut self, metrics: &crate::metrics::Metrics) -> Self {
        self.grpc_metrics = Some(GrpcMetricsLayer::new(metrics));
        self
    }

    /// The verified caller of a request: `None` on a plaintext service.
    ///
    /// # Errors
    /// `UNAUTHENTICATED` on an authenticated service for a request without a node identity.
    fn sender<T>(&self, request: &Request<T>) -> Result<Option<Sender>, Status> {
        if !self.authenticated {
            return Ok(None);
        }
        let identity =
            request.extensions().get::<PeerInfo>().and_then(|info| info.identity.as_ref());
        let sender = identity.and_then(|identity| {
            Some(Sender { node_id: identity.node_id()?, may_vote: identity.may_vote() })
        });
        sender.map(Some).ok_or_else(|| Status::unauthenticated("no verified node certificate"))
    }

    /// Routes requests for `group`'s name to it. Forwarded writes go through the group's
    /// handle, which stamps their time as the leader's (`super::ledger_time`).
    ///
    /// # Errors
    /// [`RegisterError`] when the name is taken or the process hosts too many groups.
    pub fn register_group<C: GroupConfig>(
        &self,
        group: &RaftGroup<C>,
    ) -> Result<(), RegisterError> {
        let mut groups = self.groups.write();
        if groups.contains_key(group.name()) {
            return Err(RegisterError::Duplicate(group.name().to_owned()));
        }
        if groups.len() >= GROUPS_PER_PROCESS_MAX {
            return Err(RegisterError::TooMany);
        }
        let endpoint = Endpoint { group: group.clone() };
        groups.insert(group.name().to_owned(), Arc::new(endpoint));
        Ok(())
    }

    /// Routes the quota group's requests to `group` ([`Self::register_group`]) and serves
    /// its policy versions to `FetchPolicy`.
    ///
    /// # Errors
    /// [`RegisterError`] as [`Self::register_group`].
    pub fn register_quota_group(&self, group: &RaftGroup<QuotaGroup>) -> Result<(), RegisterError> {
        self.register_group(group)?;
        *self.quota.write() = Some(group.clone());
        Ok(())
    }

    /// Stops routing requests to `group` (peers then see it as unreachable).
    pub fn unregister(&self, group: &str) {
        self.groups.write().remove(group);
        if group == QUOTA_GROUP_NAME {
            self.quota.write().take();
        }
    }

    fn endpoint(&self, group: &str) -> Result<Arc<dyn GroupEndpoint>, Status> {
        self.groups
            .read()
            .get(group)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("this node hosts no Raft group {group:?}")))
    }

    /// The tonic service with the message size limits set both ways.
    pub fn into_server(self) -> RaftPeerServer<Self> {
        RaftPeerServer::new(self)
            .max_decoding_message_size(PEER_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(PEER_MESSAGE_BYTES_MAX)
    }

    fn router(self) -> tonic::transport::server::Router<Stack<GrpcMetricsLayer, Identity>> {
        let grpc_metrics = self
            .grpc_metrics
            .clone()
            .unwrap_or_else(|| GrpcMetricsLayer::new(&crate::metrics::Metrics::new()));
        tonic::transport::Server::builder()
            .layer(grpc_metrics)
            .timeout(SERVER_REQUEST_TIMEOUT)
            .concurrency_limit_per_connection(CONCURRENT_REQUESTS_PER_CONNECTION_MAX)
            .add_service(self.into_server())
    }

    /// Serves the Raft transport in plaintext on `listener` until `shutdown` completes.
    ///
    /// # Errors
    /// The transport error that stopped the server.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        // Nagle off on accepted sockets: `Server::tcp_nodelay` applies only to listeners tonic
        // binds itself, and Nagle meeting the peer's delayed ACK stalls a small reply ~40 ms.
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        self.router().serve_with_incoming_shutdown(incoming, shutdown).await
    }

    /// Serves the Raft transport over mutual TLS (`crate::tls::transport::incoming`) on
    /// `listener` until `shutdown` completes.
    ///
    /// # Errors
    /// The transport error that stopped the server.
    pub async fn serve_tls(
        self,
        listener: tokio::net::TcpListener,
        tls: Arc<rustls::ServerConfig>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        let incoming = crate::tls::transport::incoming(listener, tls);
        self.router().serve_with_incoming_shutdown(incoming, shutdown).await
    }
}

#[tonic::async_trait]
impl RaftPeer for RaftPeerService {
    async fn append_entries(
        &self,
        request: Request<GroupRequest>,
    ) -> Result<Response<GroupReply>, Status> {
        let sender = self.sender(&request)?;
        let request = request.into_inner();
        let payload =
            self.endpoint(&request.group)?.append_entries(&request.payload, sender).await?;
        Ok(Response::new(GroupReply { payload }))
    }

    async fn vote(&self, request: Request<GroupRequest>) -> Result<Response<GroupReply>, Status> {
        let sender = self.sender(&request)?;
        let request = request.into_inner();
        let payload = self.endpoint(&request.group)?.vote(&request.payload, sender).await?;
        Ok(Response::new(GroupReply { payload }))
    }

    async fn install_snapshot(
        &self,
        request: Request<GroupRequest>,
    ) -> Result<Response<GroupReply>, Status> {
        let sender = self.sender(&request)?;
        let request = request.into_inner();
        let payload =
            self.endpoint(&request.group)?.install_snapshot(&request.payload, sender).await?;
        Ok(Response::new(GroupReply { payload }))
    }

    async fn forward(
        &self,
        request: Request<GroupRequest>,
    ) -> Result<Response<GroupReply>, Status> {
        let sender = self.sender(&request)?;
        let request = request.into_inner();
        let payload = self.endpoint(&request.group)?.forward(&request.payload, sender).await?;
        Ok(Response::new(GroupReply { payload }))
    }

    async fn fetch_policy(
        &self,
        request: Request<GroupRequest>,
    ) -> Result<Response<GroupReply>, Status> {
        // Any node of the cluster may read: gateways follow the policy this way.
        self.sender(&request)?;
        let request = request.into_inner();
        if request.group != QUOTA_GROUP_NAME {
            return Err(Status::invalid_argument(format!(
                "policies live in the {QUOTA_GROUP_NAME} group, not {:?}",
                request.group
            )));
        }
        let fetch: PolicyFetch = decode(&request.payload)?;
        let quota = self.quota.read().clone().ok_or_else(|| {
            Status::not_found(format!("this node hosts no Raft group {QUOTA_GROUP_NAME:?}"))
        })?;
        let fetched = quota.read(|ledger| PolicyFetched::answer(ledger, fetch));
        Ok(Response::new(GroupReply { payload: encode(&fetched)? }))
    }
}
