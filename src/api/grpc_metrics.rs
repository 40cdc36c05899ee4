//! gRPC server metrics, per service and method, as a tower layer that every tonic server of
//! a node (Envoy RLS with health and reflection, billing, admin, Raft) wraps its services
//! in: calls by status code, whole-call latency and calls in flight. The metric families
//! are registered in `crate::metrics`; this file measures the calls.
//!
//! A gRPC call's status is in the response's trailers (or, for an error answered at once,
//! in its headers), so the response body is wrapped to read them; a call ends when its body
//! is dropped: after the trailers, or early when the client went away (`CANCELLED`).
//! Methods are the ones compiled into the node (from its descriptor set, plus health and
//! reflection); any other path is counted as `unknown`, so labels stay bounded.

use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Instant;

use http_body::{Body, Frame};
use prometheus::{Histogram, IntCounter, IntGauge};
use prost::Message;

use crate::metrics::Metrics;

/// The label of a service or method the node does not serve.
pub const UNKNOWN: &str = "unknown";

/// Every gRPC status code as Prometheus labels name them (`grpc_code` in the usual exporters).
pub const CODES: [(tonic::Code, &str); 17] = [
    (tonic::Code::Ok, "OK"),
    (tonic::Code::Cancelled, "CANCELLED"),
    (tonic::Code::Unknown, "UNKNOWN"),
    (tonic::Code::InvalidArgument, "INVALID_ARGUMENT"),
    (tonic::Code::DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (tonic::Code::NotFound, "NOT_FOUND"),
    (tonic::Code::AlreadyExists, "ALREADY_EXISTS"),
    (tonic::Code::PermissionDenied, "PERMISSION_DENIED"),
    (tonic::Code::ResourceExhausted, "RESOURCE_EXHAUSTED"),
    (tonic::Code::FailedPrecondition, "FAILED_PRECONDITION"),
    (tonic::Code::Aborted, "ABORTED"),
    (tonic::Code::OutOfRange, "OUT_OF_RANGE"),
    (tonic::Code::Unimplemented, "UNIMPLEMENTED"),
    (tonic::Code::Internal, "INTERNAL"),
    (tonic::Code::Unavailable, "UNAVAILABLE"),
    (tonic::Code::DataLoss, "DATA_LOSS"),
    (tonic::Code::Unauthenticated, "UNAUTHENTICATED"),
];

/// Services the node serves that are not in its own descriptor set.
const LIBRARY_METHODS: [(&str, &str); 4] = [
    ("grpc.health.v1.Health", "Check"),
    ("grpc.health.v1.Health", "Watch"),
    ("grpc.reflection.v1.ServerReflection", "ServerReflectionInfo"),
    ("grpc.reflection.v1alpha.ServerReflection", "ServerReflectionInfo"),
];

/// Every `(service, method)` the node serves, in a stable order.
pub fn known_methods() -> &'static [(String, String)] {
    static METHODS: LazyLock<Vec<(String, String)>> = LazyLock::new(|| {
        // The descriptor set is compiled in by build.rs; it always decodes.
        let files = prost_types::FileDescriptorSet::decode(crate::api::proto::FILE_DESCRIPTOR_SET)
            .map(|set| set.file)
            .unwrap_or_default();
        let mut methods: Vec<(String, String)> = files
            .iter()
            .flat_map(|file| {
                file.service.iter().flat_map(move |service| {
                    let name = format!("{}.{}", file.package(), service.name());
                    service
                        .method
                        .iter()
                        .map(move |method| (name.clone(), method.name().to_owned()))
                })
            })
            .chain(LIBRARY_METHODS.iter().map(|(s, m)| ((*s).to_owned(), (*m).to_owned())))
            .collect();
        methods.sort();
        methods.dedup();
        methods
    });
    &METHODS
}

/// One method's series, looked up once per call by the request path.
struct MethodMetrics {
    in_flight: IntGauge,
    duration: Histogram,
    /// Indexed like [`CODES`].
    handled: [IntCounter; CODES.len()],
}

impl MethodMetrics {
    fn new(metrics: &Metrics, service: &str, method: &str) -> Self {
        Self {
            in_flight: metrics.grpc_server_in_flight.with_label_values(&[service, method]),
            duration: metrics.grpc_server_handling.with_label_values(&[service, method]),
            handled: CODES.map(|(_, code)| {
                metrics.grpc_server_handled.with_label_values(&[service, method, code])
            }),
        }
    }
}

/// The layer: add it to a tonic `Server` builder with `.layer(...)`.
#[derive(Clone)]
pub struct GrpcMetricsLayer {
    /// By request path: built once, read without locks. A client's path is only looked up,
    /// so foldhash (fast on these 30 to 60 byte paths) cannot be flooded.
    methods: Arc<foldhash::HashMap<String, Arc<MethodMetrics>>>,
    unknown: Arc<MethodMetrics>,
}

impl GrpcMetricsLayer {
    /// Measures calls into `metrics`.
    pub fn new(metrics: &Metrics) -> Self {
        let methods = known_methods()
            .iter()
            .map(|(service, method)| {
                (
                    format!("/{service}/{method}"),
                    Arc::new(MethodMetrics::new(metrics, service, method)),
                )
            })
            .collect();
        Self {
            methods: Arc::new(methods),
            unknown: Arc::new(MethodMetrics::new(metrics, UNKNOWN, UNKNOWN)),
        }
    }

    fn method(&self, path: &str) -> Arc<MethodMetrics> {
        Arc::clone(self.methods.get(path).unwrap_or(&self.unknown))
    }
}

impl<S> tower_layer::Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetricsService { inner, layer: self.clone() }
    }
}

/// A service measured by [`GrpcMetricsLayer`].
#[derive(Clone)]
pub struct GrpcMetricsService<S> {
    inner: S,
    layer: GrpcMetricsLayer,
}

impl<S, RequestBody, ResponseBody> tower_service::Service<http::Request<RequestBody>>
    for GrpcMetricsService<S>
where
    S: tower_service::Service<http::Request<RequestBody>, Response = http::Response<ResponseBody>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    ResponseBody: 'static,
{
    type Response = http::Response<MeasuredBody<ResponseBody>>;
    type Error = S::Error;
    type Future = MeasuredCall<S::Future>;

    fn poll_ready(&mut self, context: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(context)
    }

    fn call(&mut self, request: http::Request<RequestBody>) -> Self::Future {
        let call = CallRecord::start(self.layer.method(request.uri().path()));
        MeasuredCall { inner: self.inner.call(request), call: Some(call) }
    }
}

pin_project_lite::pin_project! {
    /// A call's answer on its way: hands the call's record to the response body (a concrete
    /// future, not a boxed one: no allocation per call).
    pub struct MeasuredCall<F> {
        #[pin]
        inner: F,
        // Taken when the answer comes; on a transport error the call ends with its drop.
        call: Option<CallRecord>,
    }
}

impl<F, ResponseBody, Error> Future for MeasuredCall<F>
where
    F: Future<Output = Result<http::Response<ResponseBody>, Error>>,
{
    type Output = Result<http::Response<MeasuredBody<ResponseBody>>, Error>;

    fn poll(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = std::task::ready!(this.inner.poll(context))?;
        let mut call = this.call.take().expect("a call's future is not polled after its answer");
        if let Some(code) = grpc_status(response.headers()) {
            call.code = Some(code);
        }
        Poll::Ready(Ok(response.map(|inner| MeasuredBody { inner, call })))
    }
}

/// The name of an answer's gRPC status, parsed once rather than on every lookup.
pub(crate) static GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");

fn grpc_status(headers: &http::HeaderMap) -> Option<tonic::Code> {
    let value = grpc_status_value(headers)?;
    Some(tonic::Code::from_bytes(value.as_bytes()))
}

/// The `grpc-status` field of an answer's headers or trailers, found by a scan: they hold a
/// field or two, and comparing names costs less than hashing one for a lookup (checked three
/// times on every call).
pub(crate) fn grpc_status_value(headers: &http::HeaderMap) -> Option<&http::HeaderValue> {
    headers.iter().find_map(|(name, value)| (*name == GRPC_STATUS).then_some(value))
}

/// One call in flight; recorded when dropped.
pub struct CallRecord {
    started: Instant,
    method: Arc<MethodMetrics>,
    code: Option<tonic::Code>,
}

impl CallRecord {
    fn start(method: Arc<MethodMetrics>) -> Self {
        method.in_flight.inc();
        Self { started: Instant::now(), method, code: None }
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        self.method.in_flight.dec();
        self.method.duration.observe(self.started.elapsed().as_secs_f64());
        // No status seen: the body was dropped before its trailers, the client went away.
        let code = self.code.unwrap_or(tonic::Code::Cancelled);
        if let Some(index) = CODES.iter().position(|(known, _)| *known == code) {
            self.method.handled[index].inc();
        }
    }
}

pin_project_lite::pin_project! {
    /// A response body that reads the call's status from its trailers.
    pub struct MeasuredBody<B> {
        #[pin]
        inner: B,
        call: CallRecord,
    }
}

impl<B: Body> Body for MeasuredBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(context);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(code) = frame.trailers_ref().and_then(grpc_status)
        {
            this.call.code = Some(code);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's own services and the library ones are known, by their request paths.
    #[test]
    fn methods_are_known_from_the_descriptors() {
        let known = |service: &str, method: &str| {
            known_methods().iter().any(|(s, m)| s == service && m == method)
        };
        assert!(known("envoy.service.ratelimit.v3.RateLimitService", "ShouldRateLimit"));
        assert!(known("grpc.health.v1.Health", "Check"));
        assert!(
            known_methods().iter().any(|(service, _)| service == "quotamesh.billing.v1.Billing")
        );
        assert!(known_methods().iter().any(|(service, _)| service == "quotamesh.admin.v1.Admin"));
        assert!(known_methods().iter().any(|(service, _)| service == "quotamesh.raft.v1.RaftPeer"));
    }

    /// A service that answers every call at once with the given `grpc-status` header.
    #[derive(Clone)]
    struct Answer(&'static str);

    impl tower_service::Service<http::Request<()>> for Answer {
        type Response = http::Response<String>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            let response =
                http::Response::builder().header("grpc-status", self.0).body(String::new());
            std::future::ready(Ok(response.expect("a valid response")))
        }
    }

    /// A call is in flight until its body is dropped, then counted under its method (found
    /// by its path) and its status; a path the node does not serve counts as `unknown`.
    #[tokio::test]
    async fn calls_count_under_their_method_and_status() {
        use tower_layer::Layer;
        use tower_service::Service;
        let metrics = Metrics::new();
        let layer = GrpcMetricsLayer::new(&metrics);
        let mut service = layer.layer(Answer("5"));
        let (rls, method) = ("envoy.service.ratelimit.v3.RateLimitService", "ShouldRateLimit");
        let request = |path: &str| http::Request::builder().uri(path).body(()).expect("a request");
        let response = service.call(request(&format!("/{rls}/{method}"))).await.expect("answered");
        let in_flight = metrics.grpc_server_in_flight.with_label_values(&[rls, method]);
        assert_eq!(in_flight.get(), 1, "in flight until its body is dropped");
        drop(response);
        assert_eq!(in_flight.get(), 0);
        let handled = |service: &str, method: &str, code: &str| {
            metrics.grpc_server_handled.with_label_values(&[service, method, code]).get()
        };
        assert_eq!(handled(rls, method, "NOT_FOUND"), 1);
        assert_eq!(handled(rls, method, "OK"), 0);
        let histogram = metrics.grpc_server_handling.with_label_values(&[rls, method]);
        assert_eq!(histogram.get_sample_count(), 1);
        drop(service.call(request("/no.Such/Method")).await.expect("answered"));
        assert_eq!(handled(UNKNOWN, UNKNOWN, "NOT_FOUND"), 1);
        // Every known path is found.
        for (service_name, method_name) in known_methods() {
            let path = format!("/{service_name}/{method_name}");
            drop(service.call(request(&path)).await.expect("answered"));
            assert!(handled(service_name, method_name, "NOT_FOUND") >= 1, "{path}");
        }
        assert_eq!(handled(UNKNOWN, UNKNOWN, "NOT_FOUND"), 1, "no known path counted as unknown");
    }

    /// The scan finds what a lookup would: the first `grpc-status` value, among other fields.
    #[test]
    fn the_status_field_is_found_among_others() {
        let mut headers = http::HeaderMap::new();
        assert!(grpc_status_value(&headers).is_none());
        headers.insert("content-type", http::HeaderValue::from_static("application/grpc"));
        assert!(grpc_status_value(&headers).is_none());
        headers.insert("grpc-status", http::HeaderValue::from_static("5"));
        headers.append("grpc-status", http::HeaderValue::from_static("2"));
        headers.insert("grpc-message", http::HeaderValue::from_static("gone"));
        assert_eq!(grpc_status_value(&headers), headers.get("grpc-status"));
        assert_eq!(grpc_status(&headers), Some(tonic::Code::NotFound));
    }

    /// Every code has its label, in the codes' numeric order.
    #[test]
    fn codes() {
        for (index, (code, _)) in CODES.iter().enumerate() {
            assert_eq!(i32::from(*code), i32::try_from(index).expect("17 codes"));
        }
    }
}
