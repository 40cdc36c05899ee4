//! The Envoy RLS port: `envoy.service.ratelimit.v3.RateLimitService` with gRPC health and
//! reflection, served by threads of its own.
//!
//! ```text
//!   listener ──accept (node runtime)──▶ round robin ──▶ rls-0: current-thread runtime
//!                                                   └──▶ rls-1: current-thread runtime ...
//! ```
//!
//! With `rls_threads` of 0 (the default) the port is served on the node's multi-threaded
//! runtime like its other ports. With N (or `"auto"`: one per core the process may use but
//! one, at least one), the node's runtime only accepts, and each of the serving threads runs
//! a single-threaded tokio runtime that owns the connections handed to it: a request is
//! read, decided and answered on one thread, and its HTTP/2 streams are polled in turn
//! before the connection writes their answers together. On tokio's multi-threaded runtime a
//! new stream's task runs at once (its LIFO slot), so each answer was written on its own;
//! measured in `benches/grpc_throughput.sh`, the single-threaded layout spends about a
//! quarter of the kernel time per request. The Raft groups, the lease broker and the shard
//! actors stay on the node's runtime; decisions reach them through the shards' locks and
//! channels, which work across runtimes. Not yet the default: on a machine with more
//! runnable threads than cores (the region's leasing tests: five nodes on two cores, two
//! spinning threads beside them), ledger calls stalled past their deadline several times as
//! long with serving threads as without (`quotamesh_ledger_stalled_seconds_total`), with
//! one thread per core or one per core but one, and a lower priority for the serving
//! threads did not change it.

use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use crate::api::grpc_limits::{self, Bounded};
use crate::api::grpc_metrics::GrpcMetricsLayer;
use crate::api::rls::{REQUEST_BYTES_MAX, RlsService};
use crate::api::rls_wire::RlsServer;
use crate::metrics::Metrics;

use super::{GRPC_STREAMS_PER_CONNECTION_MAX, NodeError, SHUTDOWN_DRAIN_TIMEOUT, until_stopped};

/// Accepted connections queued for one serving thread; the acceptor waits past it, and the
/// kernel's backlog holds new connections meanwhile.
const CONNECTIONS_QUEUED_MAX: usize = 64;
/// Pause after a failed accept (out of file descriptors, say), so that a persistent error
/// does not spin the acceptor.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(50);

fn setup_error(what: &'static str, reason: impl std::fmt::Display) -> NodeError {
    NodeError::Setup { what, reason: reason.to_string() }
}

/// Serves `rls` (with gRPC health and reflection) on `listener` until `stopped` is raised:
/// on the node's runtime when `threads` is 0, else from `threads` serving threads. The
/// handle ends once every connection has drained (and every thread stopped).
///
/// # Errors
/// [`NodeError::Setup`] when reflection or a thread's runtime cannot be built, or a thread
/// cannot be started; nothing is left running.
pub(super) async fn serve(
    rls: RlsService,
    metrics: &Metrics,
    listener: tokio::net::TcpListener,
    threads: usize,
    stopped: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, NodeError> {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<RlsServer>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::api::proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|error| setup_error("gRPC reflection", error))?;
    // Envoy's requests are a few KiB; tonic refuses a larger one before decoding it.
    let rls = RlsServer::new(rls, REQUEST_BYTES_MAX);
    let router = Server::builder()
        .layer(GrpcMetricsLayer::new(metrics))
        // No per-call server timer: a decision never waits except for a cold key, which is
        // bounded by the shard's own admission timeout, and Envoy sets its own deadline.
        .max_concurrent_streams(GRPC_STREAMS_PER_CONNECTION_MAX)
        .http2_max_header_list_size(grpc_limits::HEADER_LIST_BYTES_MAX)
        .add_service(health_service)
        .add_service(reflection)
        .add_service(Bounded::new(rls));
    if threads == 0 {
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let shutdown = until_stopped(stopped);
        return Ok(tokio::spawn(async move {
            if let Err(error) = router.serve_with_incoming_shutdown(incoming, shutdown).await {
                tracing::error!(%error, "Envoy RLS gRPC server stopped");
            }
        }));
    }

    let mut queues = Vec::with_capacity(threads);
    let mut finished_all = Vec::with_capacity(threads);
    for index in 0..threads {
        let (queue, connections) = mpsc::channel::<std::net::TcpStream>(CONNECTIONS_QUEUED_MAX);
        let (started, running) = oneshot::channel::<std::io::Result<()>>();
        let (done, finished) = oneshot::channel::<()>();
        let router = router.clone();
        let stopped = stopped.clone();
        let thread = std::thread::Builder::new().name(format!("rls-{index}")).spawn(move || {
            // Built and dropped on this thread: the node's runtime may not drop one.
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime,
                Err(error) => {
                    let _ = started.send(Err(error));
                    return;
                }
            };
            let _ = started.send(Ok(()));
            runtime.block_on(async move {
                // Registered with this thread's runtime, inside it.
                let incoming =
                    ReceiverStream::new(connections).map(tokio::net::TcpStream::from_std);
                let serving =
                    router.serve_with_incoming_shutdown(incoming, until_stopped(stopped.clone()));
                let drain_over = async {
                    until_stopped(stopped).await;
                    tokio::time::sleep(SHUTDOWN_DRAIN_TIMEOUT).await;
                };
                tokio::select! {
                    served = serving => if let Err(error) = served {
                        tracing::error!(%error, "Envoy RLS gRPC server stopped");
                    },
                    () = drain_over => {
                        tracing::warn!("Envoy RLS port: calls still open after the drain are cut");
                    }
                }
            });
            // Dropping the runtime drops the connections it still serves.
            drop(runtime);
            let _ = done.send(());
        });
        // On an error the queues dropped with this function end the threads already started.
        thread.map_err(|error| setup_error("RLS serving thread", error))?;
        match running.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(setup_error("RLS serving runtime", error)),
            Err(_) => return Err(setup_error("RLS serving runtime", "its thread ended")),
        }
        queues.push(queue);
        finished_all.push(finished);
    }

    let acceptor = tokio::spawn(accept(listener, queues, until_stopped(stopped)));
    Ok(tokio::spawn(async move {
        let _ = acceptor.await;
        for finished in finished_all {
            let _ = finished.await;
        }
    }))
}

/// Accepts connections and hands them to the serving threads in turn, until `shutdown`.
async fn accept(
    listener: tokio::net::TcpListener,
    queues: Vec<mpsc::Sender<std::net::TcpStream>>,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut next = 0;
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted.and_then(|(stream, _)| {
            stream.set_nodelay(true)?;
            // Leaves this runtime's reactor; the serving thread registers it with its own.
            stream.into_std()
        }) {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!(%error, "Envoy RLS port: accepting a connection failed");
                tokio::time::sleep(ACCEPT_RETRY_DELAY).await;
                continue;
            }
        };
        let queue = &queues[next];
        next = (next + 1) % queues.len();
        tokio::select! {
            () = &mut shutdown => return,
            // A thread that stopped takes nothing: the connection is closed.
            _ = queue.send(stream) => {}
        }
    }
}
