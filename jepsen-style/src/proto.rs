//! Code generated from `proto/` by `build.rs`, in modules that mirror the protobuf packages
//! so the generated cross-package paths resolve. Nothing else lives here.

#![allow(missing_docs, unreachable_pub, clippy::all, unused_qualifications)]

/// The node's billing and admin APIs.
pub mod quotamesh {
    pub mod admin {
        pub mod v1 {
            tonic::include_proto!("quotamesh.admin.v1");
        }
    }
    pub mod billing {
        pub mod v1 {
            tonic::include_proto!("quotamesh.billing.v1");
        }
    }
}

/// Envoy's Rate Limit Service, as the nodes serve it.
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
