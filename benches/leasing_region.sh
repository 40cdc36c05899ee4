#!/usr/bin/env bash
# The leasing issue's figures, measured on real node processes (three voters and two
# gateways, `nodes_in_region = 5`, the shipped `[leasing]` defaults): the hot key at 3x, the
# enterprise tier (50,000/min, drained first) at 2x, traffic moving between nodes, a key at
# its limit on two of five nodes, one clock 50 ms ahead, 2 per hour from two nodes, and a
# quorum lost for 20 s. For each: over-admission
# per window against the limit and against the exported bound, each node's share against its
# fair share, ledger writes per second per node at the limit, bypasses, and how soon
# fail-closed rules admit again. Tokens lost are checked exactly by the seeded simulation
# (`tests/t10_lease_simulation.rs`), which runs with the tests.
#
# The figures come from the tests that assert them (tests/t10_leasing_region.rs and
# tests/t50_leasing_faults.rs), run one at a time; a failed assertion fails this script.
# Needs a release build and Debian's `faketime` (scripts/test.sh installs it):
#   benches/leasing_region.sh
set -euo pipefail
cd "$(dirname "$0")/.."
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
output=$(cargo test --release --test t10_leasing_region --test t50_leasing_faults \
  -- --nocapture --test-threads 1 2>&1) || status=$?
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-28s | %-78s | %s\n' case figure value
grep -E '^figure \|' <<<"$output" | sed 's/^figure | //' \
  | awk -F' \\| ' '{ printf "%-28s | %-78s | %s\n", $1, $2, $3 }'
grep -E '^test .*(ok|FAILED)$' <<<"$output" || true
if [ "$status" -ne 0 ]; then
  grep -E "panicked|assertion" <<<"$output" | head -20 >&2
fi
exit "$status"
