//! The node's network APIs: tonic services (decode, call the shards, encode) and the HTTP
//! endpoints for Prometheus and health checks. No rate-limit rule lives here.
//!
//! - [`rls`]: Envoy Rate Limit Service v3 (`ShouldRateLimit`).
//! - [`rls_wire`]: the RLS answer, encoded straight onto the wire, and its gRPC service.
//! - [`rule_metrics`]: the active policy's rule counters, resolved once per policy.
//! - [`shadow_events`]: the JSON-lines file of shadow rules' would-be rejections.
//! - [`admin`]: the admin API (`quotamesh.admin.v1.Admin`): the groups' membership and
//!   status, lease grants by hand.
//! - [`grpc_limits`]: the metadata and message limits of the RLS, billing and admin ports,
//!   and the status past them.
//! - [`grpc_metrics`]: calls, codes, latency and calls in flight of every gRPC server.
//! - [`operators`]: who may call the admin API (operator tokens).
//! - [`billing`]: the billing-debit API (`quotamesh.billing.v1.Billing`).
//! - [`status`]: the one mapping from domain and operating errors to `tonic::Status`.
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`.
//! - [`proto`]: generated protobuf code.

pub mod admin;
pub mod billing;
pub mod grpc_limits;
pub mod grpc_metrics;
pub mod http;
pub mod operators;
pub mod proto;
pub mod rls;
pub mod rls_wire;
pub mod rule_metrics;
pub mod shadow_events;
pub mod status;
