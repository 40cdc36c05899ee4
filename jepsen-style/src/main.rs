//! quotamesh's black-box fault-injection runner (nemeses, workloads, history checkers).
//!
//! Placeholder: the runner arrives with the regional ledger, whose faults it injects (see
//! the ledger and leasing issues). Until then it only says so, and exits non-zero so that
//! nobody mistakes it for a passing run.

fn main() -> std::process::ExitCode {
    eprintln!("quotamesh-jepsen: no workloads yet; they arrive with the regional ledger");
    std::process::ExitCode::FAILURE
}
