#!/usr/bin/env bash
# Server CPU per ShouldRateLimit request, counted in instructions under valgrind's
# callgrind: repeatable on a shared, noisy machine where wall-clock figures are not.
# Compares a real node with the constant-OK ceiling (`quotamesh bench constant-ok`), both
# driven by the same h2load command: a warm-up, then counters zeroed, then the measured run.
# The ceiling is measured twice: on tokio's multi-threaded runtime, and on a single-threaded
# runtime on a thread of its own (`--single-thread`), the layout a node serves its RLS port
# with when `rls_threads` is set (GRPC_BENCH_RLS_THREADS=N sets it for the node).
#
# Valgrind slows the node about fifty-fold, and leases are sized by the key's traffic (250 ms
# of it, 5 to 500 tokens): at valgrind's pace a lease is about 25 tokens, so the node makes
# a Raft commit every 25 requests instead of every 500 as it does at full speed (2,000
# decisions/s and more). The node is measured twice: on the shipped defaults, and with the
# policy's lease pinned at the 500 tokens the defaults reach at full speed, which counts the
# work per request of a hot key at full speed. It is measured a third time on the deny path:
# a rule of 5 a minute, so all but the first five answers are OVER_LIMIT, decided from
# memory (the ledger said when the key has a token again), with the full set of rate-limit
# header fields and a Retry-After.
#
# Needs valgrind and h2load (Debian packages valgrind, nghttp2-client) and a release build:
#   cargo build --release && benches/grpc_instructions.sh [requests]
# (QUOTAMESH_BIN=path measures another build, to compare two commits in one session;
# CALLGRIND_OUT_DIR=dir keeps the profiles there, for callgrind_annotate.)
set -euo pipefail
cd "$(dirname "$0")/.."

requests=${1:-10000}
binary=${QUOTAMESH_BIN:-$PWD/target/release/quotamesh}
for tool in valgrind callgrind_control h2load; do
  command -v "$tool" >/dev/null || { echo "$tool missing" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cat > "$work/policy.yaml" <<'YAML'
domain: bench
descriptors:
  - key: api_key
    rate_limit: {unit: second, requests_per_unit: 1000000000}
YAML
sed 's/^    rate_limit: .*/&\n    lease: {min_tokens: 500, max_tokens: 500}/' "$work/policy.yaml" >"$work/pinned.yaml"
sed 's/^    rate_limit: .*/    rate_limit: {unit: minute, requests_per_unit: 5}/' "$work/policy.yaml" >"$work/deny.yaml"
printf 'rls_threads = %s\n' "${GRPC_BENCH_RLS_THREADS:-0}" > "$work/node.toml"
"$binary" bench encode-request --domain bench --entry api_key=alice --out "$work/body.bin"

# load PORT N: sends N requests, prints how many succeeded
load() {
  h2load -n "$2" -c 1 -m 10 -t 1 -H 'content-type: application/grpc' -H 'te: trailers' \
    -d "$work/body.bin" "http://127.0.0.1:$1/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" |
    grep -oE '[0-9]+ succeeded' | cut -d' ' -f1
}

# measure NAME PORT COMMAND...: prints instructions per request
measure() {
  local name=$1 port=$2
  shift 2
  TOKIO_WORKER_THREADS=1 valgrind --tool=callgrind --callgrind-out-file="$work/$name.out" "$@" \
    </dev/null >"$work/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do
    [ "$(load "$port" 10 2>/dev/null)" = 10 ] && break
    sleep 0.2
  done
  load "$port" 2000 >/dev/null
  callgrind_control -z "$pid" >/dev/null
  local done_count; done_count=$(load "$port" "$requests")
  [ "$done_count" -gt 0 ] || { echo "no request succeeded against $name" >&2; exit 1; }
  callgrind_control -d "$pid" >/dev/null
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true
  [ -z "${CALLGRIND_OUT_DIR:-}" ] || { mkdir -p "$CALLGRIND_OUT_DIR" && cp "$work/$name.out".* "$CALLGRIND_OUT_DIR/"; }
  local total; total=$(grep -h '^summary:' "$work/$name.out".* | head -1 | cut -d' ' -f2)
  echo $((total / done_count))
}

ceiling=$(measure ceiling 18291 "$binary" bench constant-ok --rls-addr 127.0.0.1:18291)
ceiling_st=$(measure ceiling-single-thread 18292 "$binary" bench constant-ok --single-thread \
  --rls-addr 127.0.0.1:18292)
node=$(measure quotamesh 18281 "$binary" serve --config "$work/node.toml" --rls-addr 127.0.0.1:18281 \
  --metrics-addr 127.0.0.1:16271 --data-dir "$work/data" --policy "$work/policy.yaml")
pinned=$(measure pinned 18282 "$binary" serve --config "$work/node.toml" --rls-addr 127.0.0.1:18282 \
  --metrics-addr 127.0.0.1:16272 --data-dir "$work/pinned-data" --policy "$work/pinned.yaml")
deny=$(measure deny 18283 "$binary" serve --config "$work/node.toml" --rls-addr 127.0.0.1:18283 \
  --metrics-addr 127.0.0.1:16273 --data-dir "$work/deny-data" --policy "$work/deny.yaml")
printf 'instructions per request: ceiling %s, single-threaded ceiling %s, quotamesh %s (defaults at valgrind pace), %s (lease of 500), %s (deny path)\n' \
  "$ceiling" "$ceiling_st" "$node" "$pinned" "$deny"
for case in "defaults at valgrind pace:$node" "lease of 500, as at full speed:$pinned" "deny path:$deny"; do
  awk -v a="${case##*:}" -v b="$ceiling" -v c="$ceiling_st" -v what="${case%:*}" 'BEGIN {
    printf "CPU (instructions) per request ratio quotamesh/ceiling   %.3f, /single-threaded ceiling %.3f (%s)\n", a / b, a / c, what
  }'
done
