#!/usr/bin/env bash
# End-to-end gRPC throughput of ShouldRateLimit with h2load, beside the ceiling: a
# constant-OK tonic RLS (`quotamesh bench constant-ok`) loaded by the same h2load command in
# the same run. Server pinned to core 0 with one tokio worker, h2load to core 1.
#
# The two servers are loaded in alternation for several rounds (this machine is shared and
# noisy); each figure is the median of its rounds. Prints requests/s, mean latency and
# server CPU per request for both, and the ratios.
# Needs h2load (Debian package nghttp2-client) and a release build:
#   cargo build --release && benches/grpc_throughput.sh [requests]
set -euo pipefail
cd "$(dirname "$0")/.."

requests=${1:-200000}
rounds=${2:-3}
binary=target/release/quotamesh
command -v h2load >/dev/null || { echo "h2load missing: apt-get install nghttp2-client" >&2; exit 1; }
[ -x "$binary" ] || { echo "build first: cargo build --release" >&2; exit 1; }

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

cat > "$work/policy.yaml" <<'YAML'
domain: bench
descriptors:
  - key: api_key
    rate_limit: {unit: second, requests_per_unit: 1000000000}
YAML
"$binary" bench encode-request --domain bench --entry api_key=alice --out "$work/body.bin"

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# run NAME PORT: loads 127.0.0.1:PORT, prints "NAME rps mean_us cpu_us_per_request"
run() {
  local name=$1 port=$2 pid=$3
  # Warm up connections and caches.
  taskset -c 1 h2load -n 20000 -c 4 -m 32 -t 1 \
    -H 'content-type: application/grpc' -H 'te: trailers' -d "$work/body.bin" \
    "http://127.0.0.1:$port/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" >/dev/null
  local before; before=$(cpu_ticks "$pid")
  taskset -c 1 h2load -n "$requests" -c 4 -m 32 -t 1 \
    -H 'content-type: application/grpc' -H 'te: trailers' -d "$work/body.bin" \
    "http://127.0.0.1:$port/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" > "$work/$name.txt"
  local after; after=$(cpu_ticks "$pid")
  local rps mean failed
  rps=$(grep -oE '[0-9.]+ req/s' "$work/$name.txt" | head -1 | cut -d' ' -f1)
  mean=$(awk '/^time for request:/ {print $6}' "$work/$name.txt")
  failed=$(grep -oE '[0-9]+ failed' "$work/$name.txt" | head -1 | cut -d' ' -f1)
  local hz; hz=$(getconf CLK_TCK)
  local cpu_us; cpu_us=$(awk -v t=$((after - before)) -v hz="$hz" -v n="$requests" 'BEGIN {printf "%.2f", t / hz * 1e6 / n}')
  printf '%-12s %10s req/s   mean %8s   server CPU %6s us/request   failed %s\n' "$name" "$rps" "$mean" "$cpu_us" "$failed"
  echo "$rps $cpu_us" >> "$work/$name.result"
}

TOKIO_WORKER_THREADS=1 taskset -c 0 "$binary" bench constant-ok --rls-addr 127.0.0.1:18091 2>/dev/null &
ceiling_pid=$!
TOKIO_WORKER_THREADS=1 taskset -c 0 "$binary" serve --rls-addr 127.0.0.1:18081 --metrics-addr 127.0.0.1:16070 \
  --data-dir "$work/data" --policy "$work/policy.yaml" 2>/dev/null &
node_pid=$!
for _ in $(seq 100); do
  curl -sf http://127.0.0.1:16070/readyz >/dev/null 2>&1 && break
  sleep 0.1
done

for _ in $(seq "$rounds"); do
  run ceiling 18091 "$ceiling_pid"
  run quotamesh 18081 "$node_pid"
done

median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
ceiling_rps=$(cut -d' ' -f1 "$work/ceiling.result" | median)
ceiling_cpu=$(cut -d' ' -f2 "$work/ceiling.result" | median)
node_rps=$(cut -d' ' -f1 "$work/quotamesh.result" | median)
node_cpu=$(cut -d' ' -f2 "$work/quotamesh.result" | median)
printf 'median of %s rounds: ceiling %s req/s %s us CPU; quotamesh %s req/s %s us CPU\n' \
  "$rounds" "$ceiling_rps" "$ceiling_cpu" "$node_rps" "$node_cpu"
awk -v a="$node_rps" -v b="$ceiling_rps" -v c="$node_cpu" -v d="$ceiling_cpu" 'BEGIN {
  printf "throughput ratio quotamesh/ceiling   %.3f\n", a / b
  printf "CPU per request ratio                %.3f\n", c / d
}'
