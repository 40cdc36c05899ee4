//! What the node's client-facing gRPC ports (RLS, billing, admin) accept of a request before
//! its service sees it, and the status a client gets for going past it.
//!
//! ```text
//!  client ──HTTP/2──▶ hyper: header list > HEADER_LIST_BYTES_MAX? ──▶ HTTP 431 (client: UNKNOWN)
//!                       │
//!                       ▼
//!                   Bounded: metadata > METADATA_BYTES_MAX? ──▶ RESOURCE_EXHAUSTED
//!                       │
//!                       ▼
//!                   the service (tonic): message > its decoding limit? ──▶ OUT_OF_RANGE,
//!                       │                 rewritten by Bounded to RESOURCE_EXHAUSTED
//!                       ▼
//!                   the handler
//! ```
//!
//! gRPC's convention for a request over the receiver's limits, metadata or message, is
//! `RESOURCE_EXHAUSTED` (what the C core, Java and Go implementations answer); tonic answers
//! an oversized message `OUT_OF_RANGE`, and hyper refuses a header list over its HTTP/2
//! setting (16 KiB by default) with an HTTP 431 that gRPC clients report as `UNKNOWN`. So the
//! ports advertise a header list far above any sane request ([`HEADER_LIST_BYTES_MAX`]) and
//! [`Bounded`] refuses metadata over [`METADATA_BYTES_MAX`] itself, with a status naming the
//! sizes; only a header list past the HTTP/2 setting still gets the 431. No handler of these
//! services answers `OUT_OF_RANGE` itself, so every one a client sees was a message too large.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;

use crate::api::grpc_metrics::{GRPC_STATUS, grpc_status_value};

/// Largest request metadata (HTTP/2 header list: names, values and 32 bytes per entry, as
/// HTTP/2 counts it) a call may carry; the rest is refused with `RESOURCE_EXHAUSTED`. hyper's
/// own default, so nothing that was served before is refused now.
pub const METADATA_BYTES_MAX: usize = 16 * 1024;
/// The HTTP/2 header list size the ports advertise and hyper enforces; past it the client
/// gets an HTTP 431 (`UNKNOWN`). One HPACK-decoded header block per connection is buffered at
/// a time, so this bounds memory per connection.
pub const HEADER_LIST_BYTES_MAX: u32 = 256 * 1024;
/// What HTTP/2 adds to each header entry's name and value when it counts a header list
/// (RFC 7541 section 4.1).
const HEADER_ENTRY_OVERHEAD_BYTES: usize = 32;

const _: () = assert!(METADATA_BYTES_MAX < HEADER_LIST_BYTES_MAX as usize);

/// A gRPC service with the limits of this module in front of it.
#[derive(Debug, Clone)]
pub struct Bounded<S> {
    inner: S,
}

impl<S> Bounded<S> {
    /// `inner` behind the metadata limit, its oversized messages answered
    /// `RESOURCE_EXHAUSTED`.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }
}

impl<S: NamedService> NamedService for Bounded<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tower_service::Service<http::Request<B>> for Bounded<S>
where
    S: tower_service::Service<
            http::Request<B>,
            Response = http::Response<Body>,
            Error = Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoundedCall<S::Future>;

    fn poll_ready(&mut self, context: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(context)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let metadata_bytes = header_list_bytes(request.headers());
        if metadata_bytes > METADATA_BYTES_MAX {
            let status = Status::resource_exhausted(format!(
                "request metadata is {metadata_bytes} bytes; at most {METADATA_BYTES_MAX} allowed"
            ));
            return BoundedCall::Refused { answer: Some(status.into_http()) };
        }
        BoundedCall::Served { inner: self.inner.call(request) }
    }
}

pin_project_lite::pin_project! {
    /// A call's answer through [`Bounded`]: refused at once, or the service's with an
    /// oversized message's code rewritten (a concrete future: no allocation per call).
    #[project = BoundedCallProjection]
    pub enum BoundedCall<F> {
        Refused { answer: Option<http::Response<Body>> },
        Served { #[pin] inner: F },
    }
}

impl<F> Future for BoundedCall<F>
where
    F: Future<Output = Result<http::Response<Body>, Infallible>>,
{
    type Output = Result<http::Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            BoundedCallProjection::Refused { answer } => {
                Poll::Ready(Ok(answer.take().expect("a refusal is not polled after its answer")))
            }
            BoundedCallProjection::Served { inner } => {
                let mut response = std::task::ready!(inner.poll(context))?;
                oversized_as_resource_exhausted(response.headers_mut());
                Poll::Ready(Ok(response))
            }
        }
    }
}

/// The size of a header list as HTTP/2 counts it (pseudo-headers aside).
fn header_list_bytes(headers: &http::HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, value)| {
            name.as_str()
                .len()
                .saturating_add(value.len())
                .saturating_add(HEADER_ENTRY_OVERHEAD_BYTES)
        })
        .fold(0, usize::saturating_add)
}

/// Rewrites a trailers-only `OUT_OF_RANGE` answer (tonic's refusal of a message over the
/// decoding limit, the only source of that code on these ports) to `RESOURCE_EXHAUSTED`,
/// keeping tonic's message, which names both sizes.
fn oversized_as_resource_exhausted(headers: &mut http::HeaderMap) {
    // Checked on every answer: no allocation unless there is something to rewrite.
    let out_of_range = |code: &http::HeaderValue| {
        tonic::Code::from_bytes(code.as_bytes()) == tonic::Code::OutOfRange
    };
    if grpc_status_value(headers).is_some_and(out_of_range) {
        let exhausted = http::HeaderValue::from(tonic::Code::ResourceExhausted as i32);
        headers.insert(&GRPC_STATUS, exhausted);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only an OUT_OF_RANGE code is rewritten; other codes and answers without one stay.
    #[test]
    fn only_out_of_range_becomes_resource_exhausted() {
        let mut headers = http::HeaderMap::new();
        headers.insert("grpc-status", http::HeaderValue::from_static("11"));
        oversized_as_resource_exhausted(&mut headers);
        assert_eq!(headers["grpc-status"], "8");
        for kept in ["0", "3", "14", "1"] {
            let mut headers = http::HeaderMap::new();
            headers.insert("grpc-status", http::HeaderValue::from_static(kept));
            oversized_as_resource_exhausted(&mut headers);
            assert_eq!(headers["grpc-status"], kept);
        }
        let mut empty = http::HeaderMap::new();
        oversized_as_resource_exhausted(&mut empty);
        assert!(empty.is_empty());
    }

    /// Header list sizes count names, values and HTTP/2's 32 bytes per entry.
    #[test]
    fn header_lists_are_counted_as_http2_does() {
        let mut headers = http::HeaderMap::new();
        headers.insert("authorization", http::HeaderValue::from_static("Bearer x"));
        headers.append("te", http::HeaderValue::from_static("trailers"));
        assert_eq!(header_list_bytes(&headers), 13 + 8 + 32 + 2 + 8 + 32);
    }
}
