#!/usr/bin/env bash
# How long a healed node takes to serve again: 20 partitions (by default) of one follower of
# a real three-node region, each dropping every packet of that node for PARTITION_MS
# (default 8000) while the majority commits, then healed. Prints the time from each heal
# until the node has applied what was committed meanwhile and took a write of its own, and
# the worst; the target is at most 2000 ms every time.
#
# Runs the first test of tests/t50_partition_heal.rs with more rounds, so it needs what
# that test needs: root, nftables (`nft`), a release build:
#   benches/partition_heal.sh [rounds] [partition_ms]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nft >/dev/null || { echo "nft missing: apt-get install nftables" >&2; exit 1; }
export PARTITION_ROUNDS=${1:-20}
export PARTITION_MS=${2:-8000}
status=0
output=$(cargo test --release --test t50_partition_heal a_healed_node_serves_again_within_two_seconds \
  -- --nocapture 2>&1) || status=$?
grep -E '^(round|healed node|test |thread)' <<<"$output" || echo "$output" | tail -20
exit "$status"
