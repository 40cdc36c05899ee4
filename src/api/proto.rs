//! Code generated from `proto/` by `build.rs` (prost + tonic), in modules that mirror the
//! protobuf packages, so the generated cross-package paths resolve. Nothing else lives here.

#![allow(missing_docs, unreachable_pub, clippy::all, unused_qualifications)]

/// Envoy's packages, trimmed to what the Rate Limit Service uses.
pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    pub mod extensions {
        pub mod common {
            pub mod ratelimit {
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    pub mod service {
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
}

/// quotamesh's own packages served by the node (the Raft transport's is `crate::ledger::proto`).
pub mod quotamesh {
    /// The admin API: the quota group's membership and status.
    pub mod admin {
        pub mod v1 {
            tonic::include_proto!("quotamesh.admin.v1");
        }
    }
    /// The billing-debit API.
    pub mod billing {
        pub mod v1 {
            tonic::include_proto!("quotamesh.billing.v1");
        }
    }
}

/// Encoded descriptor set of every compiled file, served by gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("quotamesh_descriptor");
