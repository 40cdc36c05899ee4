//! What the RLS port sends: the answer to `ShouldRateLimit`, encoded straight onto the wire
//! as `envoy.service.ratelimit.v3.RateLimitResponse`, and the gRPC service that serves it.
//!
//! The generated message keeps every header name and value in a `String` of its own and
//! every status in a `Vec`: building, encoding and dropping it cost an RLS answer about as
//! many instructions as deciding it. [`RlsAnswer`] holds what the decision found (its header
//! values in one string, its statuses inline) and [`RlsCodec`] writes the protobuf from it,
//! byte for byte what prost writes for the same message (a property test checks it). The
//! request is decoded by prost as before. Clients, tests and the constant-OK ceiling keep
//! the generated types.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use prost::bytes::BufMut;
use prost::encoding::{WireType, encode_varint, encoded_len_varint, key_len};
use smallvec::SmallVec;
use tonic::body::Body;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::codegen::{BoxFuture, StdError};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::{Request, Response, Status};

use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use crate::api::proto::envoy::service::ratelimit::v3::{
    RateLimitRequest, rate_limit_service_server,
};
use crate::api::rls::RlsService;
use crate::core::headers::HeaderFields;

/// The gRPC path of `ShouldRateLimit`.
const SHOULD_RATE_LIMIT_PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

// Field numbers (envoy/service/ratelimit/v3/rls.proto, envoy/config/core/v3/base.proto,
// google/protobuf/duration.proto).
const RESPONSE_OVERALL_CODE: u32 = 1;
const RESPONSE_STATUSES: u32 = 2;
const RESPONSE_HEADERS_TO_ADD: u32 = 3;
const RESPONSE_DYNAMIC_METADATA: u32 = 6;
const STATUS_CODE: u32 = 1;
const STATUS_CURRENT_LIMIT: u32 = 2;
const STATUS_LIMIT_REMAINING: u32 = 3;
const STATUS_DURATION_UNTIL_RESET: u32 = 4;
const LIMIT_REQUESTS_PER_UNIT: u32 = 1;
const LIMIT_UNIT: u32 = 2;
const LIMIT_NAME: u32 = 3;
const HEADER_KEY: u32 = 1;
const HEADER_VALUE: u32 = 2;
const DURATION_SECONDS: u32 = 1;

/// Every field number above is below 16, so each field's key is one byte.
const FIELD_NUMBER_END: u32 = 16;
const _: () = assert!(RESPONSE_DYNAMIC_METADATA < FIELD_NUMBER_END);
const _: () = assert!(STATUS_DURATION_UNTIL_RESET < FIELD_NUMBER_END);

/// The answer to one `ShouldRateLimit` request.
#[derive(Debug, Clone, PartialEq)]
pub struct RlsAnswer {
    /// OK or OVER_LIMIT, over all descriptors.
    pub overall_code: Code,
    /// One per descriptor of the request, in its order.
    pub statuses: SmallVec<[StatusAnswer; 2]>,
    /// `response_headers_to_add`.
    pub headers: HeaderFields,
    /// The matched rules' `metadata` with the request, as upstream's (rare: only rules with
    /// `metadata` set it).
    pub dynamic_metadata: Option<prost_types::Struct>,
}

/// One descriptor's `DescriptorStatus`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusAnswer {
    /// The descriptor's code.
    pub code: Code,
    /// The limit it was answered by, if a rule with limits matched.
    pub current_limit: Option<CurrentLimit>,
    /// Hits left under that limit.
    pub limit_remaining: u32,
    /// Whole seconds until that limit has reset, if a limit applied.
    pub reset_seconds: Option<i64>,
}

impl StatusAnswer {
    /// A descriptor no limit applies to.
    pub fn ok(limit_remaining: u32) -> Self {
        Self { code: Code::Ok, current_limit: None, limit_remaining, reset_seconds: None }
    }
}

/// A status's `current_limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentLimit {
    /// The limit's own name; empty without one.
    pub name: String,
    /// The limit's quota per unit.
    pub requests_per_unit: u32,
    /// Its Envoy unit (`UNKNOWN` for a window Envoy has no unit for).
    pub unit: Unit,
}

impl RlsAnswer {
    /// An answer of `overall_code` with no status, header field or metadata yet.
    pub fn new(overall_code: Code) -> Self {
        Self {
            overall_code,
            statuses: SmallVec::new(),
            headers: HeaderFields::default(),
            dynamic_metadata: None,
        }
    }

    /// Writes the message, fields in field-number order as prost writes them, proto3
    /// defaults left out.
    pub fn encode(&self, buf: &mut impl BufMut) {
        put_enum(RESPONSE_OVERALL_CODE, self.overall_code as i32, buf);
        for status in &self.statuses {
            put_nested(RESPONSE_STATUSES, status.encoded_len(), buf);
            status.encode(buf);
        }
        for (name, value) in self.headers.iter() {
            put_nested(RESPONSE_HEADERS_TO_ADD, header_len(name, value), buf);
            put_string(HEADER_KEY, name, buf);
            put_string(HEADER_VALUE, value, buf);
        }
        if let Some(metadata) = &self.dynamic_metadata {
            prost::encoding::message::encode(RESPONSE_DYNAMIC_METADATA, metadata, buf);
        }
    }
}

impl StatusAnswer {
    fn encoded_len(&self) -> usize {
        enum_len(STATUS_CODE, self.code as i32)
            + self
                .current_limit
                .as_ref()
                .map_or(0, |limit| nested_len(STATUS_CURRENT_LIMIT, limit.encoded_len()))
            + varint_len(STATUS_LIMIT_REMAINING, u64::from(self.limit_remaining))
            + self
                .reset_seconds
                .map_or(0, |seconds| nested_len(STATUS_DURATION_UNTIL_RESET, duration_len(seconds)))
    }

    fn encode(&self, buf: &mut impl BufMut) {
        put_enum(STATUS_CODE, self.code as i32, buf);
        if let Some(limit) = &self.current_limit {
            put_nested(STATUS_CURRENT_LIMIT, limit.encoded_len(), buf);
            put_varint(LIMIT_REQUESTS_PER_UNIT, u64::from(limit.requests_per_unit), buf);
            put_enum(LIMIT_UNIT, limit.unit as i32, buf);
            put_string(LIMIT_NAME, &limit.name, buf);
        }
        put_varint(STATUS_LIMIT_REMAINING, u64::from(self.limit_remaining), buf);
        if let Some(seconds) = self.reset_seconds {
            put_nested(STATUS_DURATION_UNTIL_RESET, duration_len(seconds), buf);
            put_varint(DURATION_SECONDS, int64_bits(seconds), buf);
        }
    }
}

impl CurrentLimit {
    fn encoded_len(&self) -> usize {
        varint_len(LIMIT_REQUESTS_PER_UNIT, u64::from(self.requests_per_unit))
            + enum_len(LIMIT_UNIT, self.unit as i32)
            + string_len(LIMIT_NAME, &self.name)
    }
}

fn header_len(name: &str, value: &str) -> usize {
    string_len(HEADER_KEY, name) + string_len(HEADER_VALUE, value)
}

fn duration_len(seconds: i64) -> usize {
    varint_len(DURATION_SECONDS, int64_bits(seconds))
}

/// An `int32` or enum goes on the wire as its `int64` sign extension.
fn enum_bits(value: i32) -> u64 {
    int64_bits(i64::from(value))
}

#[allow(clippy::cast_sign_loss)] // the two's complement bits are the wire format
fn int64_bits(value: i64) -> u64 {
    value as u64
}

fn varint_len(tag: u32, value: u64) -> usize {
    if value == 0 { 0 } else { key_len(tag) + encoded_len_varint(value) }
}

fn enum_len(tag: u32, value: i32) -> usize {
    varint_len(tag, enum_bits(value))
}

fn string_len(tag: u32, text: &str) -> usize {
    if text.is_empty() { 0 } else { nested_len(tag, text.len()) }
}

/// A length-delimited field of `len` bytes, key and length included.
fn nested_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

fn put_varint(tag: u32, value: u64, buf: &mut impl BufMut) {
    if value != 0 {
        put_key(tag, WireType::Varint, buf);
        put_varint_value(value, buf);
    }
}

fn put_enum(tag: u32, value: i32, buf: &mut impl BufMut) {
    put_varint(tag, enum_bits(value), buf);
}

fn put_string(tag: u32, text: &str, buf: &mut impl BufMut) {
    if !text.is_empty() {
        put_nested(tag, text.len(), buf);
        buf.put_slice(text.as_bytes());
    }
}

/// The key and length of a length-delimited field; its `len` bytes follow.
fn put_nested(tag: u32, len: usize, buf: &mut impl BufMut) {
    put_key(tag, WireType::LengthDelimited, buf);
    put_varint_value(len as u64, buf);
}

/// A field's key: one byte, as every field number here is below [`FIELD_NUMBER_END`].
#[inline]
fn put_key(tag: u32, wire_type: WireType, buf: &mut impl BufMut) {
    debug_assert!(tag < FIELD_NUMBER_END);
    buf.put_u8(u8::try_from((tag << 3) | wire_type as u32).expect("a field number below 16"));
}

/// A varint written inline when it takes one byte, as most here do (codes, lengths, small
/// counts): prost's loop is a call of its own per value.
#[inline]
fn put_varint_value(value: u64, buf: &mut impl BufMut) {
    match u8::try_from(value) {
        Ok(byte) if byte < 0x80 => buf.put_u8(byte),
        _ => encode_varint(value, buf),
    }
}

/// Decodes `RateLimitRequest` with prost and encodes [`RlsAnswer`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RlsCodec;

impl Codec for RlsCodec {
    type Encode = Box<RlsAnswer>;
    type Decode = RateLimitRequest;
    type Encoder = RlsCodec;
    type Decoder = tonic_prost::ProstDecoder<RateLimitRequest>;

    fn encoder(&mut self) -> Self::Encoder {
        RlsCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(BufferSettings::default())
    }
}

/// Most a thread keeps of a large answer's scratch vector; usual answers take a few hundred
/// bytes.
const ENCODE_SCRATCH_BYTES_KEPT: usize = 16 * 1024;

thread_local! {
    static ENCODE_SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Encoder for RlsCodec {
    type Item = Box<RlsAnswer>;
    type Error = Status;

    fn encode(&mut self, answer: Box<RlsAnswer>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // Written into this thread's scratch vector, then copied whole: tonic's buffer takes
        // each byte through a chain of calls, a vector in a few inlined instructions. No
        // length first: the vector grows as it is written.
        ENCODE_SCRATCH.with_borrow_mut(|scratch| {
            scratch.clear();
            answer.encode(scratch);
            buf.put_slice(scratch);
            if scratch.capacity() > ENCODE_SCRATCH_BYTES_KEPT {
                *scratch = Vec::new();
            }
        });
        Ok(())
    }
}

/// The `envoy.service.ratelimit.v3.RateLimitService` gRPC service, answering with
/// [`RlsAnswer`]s (as the generated server would, with the generated message).
#[derive(Clone)]
pub struct RlsServer {
    service: Arc<RlsService>,
    request_bytes_max: usize,
}

impl RlsServer {
    /// Serves `service`, refusing requests larger than `request_bytes_max`.
    pub fn new(service: RlsService, request_bytes_max: usize) -> Self {
        Self { service: Arc::new(service), request_bytes_max }
    }
}

impl NamedService for RlsServer {
    const NAME: &'static str = rate_limit_service_server::SERVICE_NAME;
}

/// `ShouldRateLimit` as tonic's unary call.
struct ShouldRateLimit(Arc<RlsService>);

impl UnaryService<RateLimitRequest> for ShouldRateLimit {
    type Response = Box<RlsAnswer>;
    type Future = BoxFuture<Response<Box<RlsAnswer>>, Status>;

    fn call(&mut self, request: Request<RateLimitRequest>) -> Self::Future {
        let service = Arc::clone(&self.0);
        Box::pin(
            async move { service.should_rate_limit(request.get_ref()).await.map(Response::new) },
        )
    }
}

impl<B> tower_service::Service<::http::Request<B>> for RlsServer
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = ::http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: ::http::Request<B>) -> Self::Future {
        if request.uri().path() != SHOULD_RATE_LIMIT_PATH {
            return Box::pin(async { Ok(Status::unimplemented("").into_http()) });
        }
        let method = ShouldRateLimit(Arc::clone(&self.service));
        let mut grpc =
            Grpc::new(RlsCodec).apply_max_message_size_config(Some(self.request_bytes_max), None);
        Box::pin(async move { Ok(grpc.unary(method, request).await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::proto::envoy::config::core::v3::HeaderValue;
    use crate::api::proto::envoy::service::ratelimit::v3::RateLimitResponse;
    use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_response::{
        DescriptorStatus, RateLimit,
    };
    use proptest::prelude::*;
    use prost::Message;

    /// The generated message for the same answer, as the node sent before.
    fn generated(answer: &RlsAnswer) -> RateLimitResponse {
        RateLimitResponse {
            overall_code: answer.overall_code.into(),
            statuses: answer
                .statuses
                .iter()
                .map(|status| DescriptorStatus {
                    code: status.code.into(),
                    current_limit: status.current_limit.as_ref().map(|limit| RateLimit {
                        name: limit.name.clone(),
                        requests_per_unit: limit.requests_per_unit,
                        unit: limit.unit.into(),
                    }),
                    limit_remaining: status.limit_remaining,
                    duration_until_reset: status
                        .reset_seconds
                        .map(|seconds| prost_types::Duration { seconds, nanos: 0 }),
                    quota: None,
                })
                .collect(),
            response_headers_to_add: answer
                .headers
                .iter()
                .map(|(key, value)| HeaderValue {
                    key: key.to_owned(),
                    value: value.to_owned(),
                    raw_value: Vec::new(),
                })
                .collect(),
            dynamic_metadata: answer.dynamic_metadata.clone(),
            ..Default::default()
        }
    }

    const HEADER_NAMES: [&str; 4] = ["ratelimit-policy", "ratelimit", "retry-after", "x"];

    fn code() -> impl Strategy<Value = Code> {
        prop_oneof![Just(Code::Unknown), Just(Code::Ok), Just(Code::OverLimit)]
    }

    fn status() -> impl Strategy<Value = StatusAnswer> {
        let limit =
            (".{0,12}", any::<u32>(), 0_i32..8).prop_map(|(name, requests_per_unit, unit)| {
                CurrentLimit {
                    name,
                    requests_per_unit,
                    unit: Unit::try_from(unit).expect("0..8 are units"),
                }
            });
        (code(), proptest::option::of(limit), any::<u32>(), proptest::option::of(any::<i64>()))
            .prop_map(|(code, current_limit, limit_remaining, reset_seconds)| StatusAnswer {
                code,
                current_limit,
                limit_remaining,
                reset_seconds,
            })
    }

    fn answer() -> impl Strategy<Value = RlsAnswer> {
        let headers = proptest::collection::vec((0..HEADER_NAMES.len(), ".{0,40}"), 0..5);
        let metadata = proptest::option::of(".{0,8}".prop_map(|text| {
            let value =
                prost_types::Value { kind: Some(prost_types::value::Kind::StringValue(text)) };
            prost_types::Struct { fields: [("domain".to_owned(), value)].into() }
        }));
        (code(), proptest::collection::vec(status(), 0..4), headers, metadata).prop_map(
            |(overall_code, statuses, headers, dynamic_metadata)| {
                let mut answer = RlsAnswer::new(overall_code);
                answer.statuses.extend(statuses);
                for (name, value) in headers {
                    answer.headers.push_with(HEADER_NAMES[name], |out| out.push_str(&value));
                }
                answer.dynamic_metadata = dynamic_metadata;
                answer
            },
        )
    }

    proptest! {
        /// The answer encodes to exactly the bytes prost writes for the generated message.
        #[test]
        fn answers_encode_as_the_generated_message(answer in answer()) {
            let mut bytes = Vec::new();
            answer.encode(&mut bytes);
            prop_assert_eq!(&bytes, &generated(&answer).encode_to_vec());
            let decoded = RateLimitResponse::decode(bytes.as_slice()).expect("decodes");
            prop_assert_eq!(decoded, generated(&answer));
        }
    }
}
