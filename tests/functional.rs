//! The functional integration tests, one module per file of `tests/`, in one test binary.
//!
//! Every test binary is compiled and linked on its own, with its own copies of the generic
//! code it uses (tokio, tonic, the node's clients), so each file costs its own build. These
//! files need no machine to themselves: their tests run two at a time as they did in a
//! binary per file. The files that do (tests that run one at a time, keep both cores busy
//! with spinning threads, or inject faults) keep a binary each (`Cargo.toml`), so no test of
//! another file runs beside theirs.

mod t10_alert_rules;
mod t10_billing_basic;
mod t10_billing_checkers;
mod t10_canary_audit;
mod t10_cluster_grants;
mod t10_dashboard;
mod t10_gateway;
mod t10_lease_simulation;
mod t10_leasing;
mod t10_ledger_cluster;
mod t10_ledger_machine;
mod t10_ledger_storage;
mod t10_operator_cli;
mod t10_readme;
mod t10_rls_basic;
mod t10_rollout;
mod t10_upstream_compat;
mod t20_cert_rotation;
mod t20_cluster_recovery;
mod t20_data_directories;
mod t20_node_lifecycle;
mod t30_billing_bad_input;
mod t30_cluster_bad_input;
mod t30_port_security;
mod t30_rls_bad_input;
