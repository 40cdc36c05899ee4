#!/usr/bin/env bash
# Where a node's CPU per ShouldRateLimit request goes, part by part, beside the constant-OK
# ceiling (`quotamesh bench constant-ok`): `perf record` samples each server on its CPU
# clock (with DWARF call stacks) while the same h2load command loads it, and each sample is
# charged to the first part its thread or call stack names:
#
#   Raft log flush thread   the thread that writes and fsyncs the Raft log (ledger rounds)
#   other node threads      any thread but the flush thread, the RLS serving thread and the
#                           node's tokio worker (the ledger, the broker, the shard actors)
#   ledger round            openraft, the ledger, the lease broker, sled, on those two
#   RLS handler             the decision and its answer (the ceiling's: a constant answer)
#   request decoding        tonic decoding the request message
#   service layers          tonic's service stack: metrics, limits, timeout, routing
#   HTTP/2 stream           the rest of a request's stream task (headers, answer body)
#   HTTP/2 connection       the connection task: frames, HPACK, socket reads and writes
#   runtime and rest        the scheduler, the timer, anything without a stack
#
# A sample is 1/frequency seconds of CPU, so a part's cost per request is its samples over
# the requests sent while perf ran; the figures are printed in ns per request and as a
# share of the ceiling's whole CPU per request. perf's sampling slows both servers a little;
# the throughput and CPU ratios come from `benches/grpc_throughput.sh`, this script says
# where the difference lies. Then the node's heaviest functions inside the RLS handler, by
# their own samples.
#
# GRPC_BENCH_PATH=deny profiles the deny path (5 a minute) as grpc_throughput.sh does.
# Needs perf (Debian's linux-perf, run as root or with perf_event_paranoid at most 1),
# python3, h2load (installed like grpc_throughput.sh does) and a release build:
#   cargo build --release && benches/grpc_profile.sh [requests]
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/support/bench_node.sh

requests=${1:-300000}
path=${GRPC_BENCH_PATH:-admit}
frequency=2999
case $path in
  admit) limit='{unit: second, requests_per_unit: 1000000000}' ;;
  deny) limit='{unit: minute, requests_per_unit: 5}' ;;
  *) echo "GRPC_BENCH_PATH is admit or deny, not $path" >&2; exit 2 ;;
esac
binary=${CARGO_TARGET_DIR:-target}/release/quotamesh
for tool in perf python3; do
  command -v "$tool" >/dev/null || { echo "$tool missing (Debian packages linux-perf, python3)" >&2; exit 1; }
done
if ! command -v h2load >/dev/null; then
  echo "installing h2load (Debian package nghttp2-client)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends nghttp2-client >/dev/null \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends nghttp2-client >/dev/null; }
fi
[ -x "$binary" ] || { echo "build first: cargo build --release" >&2; exit 1; }

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
printf 'domain: bench\ndescriptors:\n  - key: api_key\n    rate_limit: %s\n' "$limit" > "$work/policy.yaml"
# GRPC_BENCH_RLS_THREADS=N serves the node's RLS port from N threads of its own
# (`rls_threads`); the ceiling is then served the same way (`--single-thread`).
rls_threads=${GRPC_BENCH_RLS_THREADS:-0}
printf 'rls_threads = %s\n' "$rls_threads" > "$work/node.toml"
ceiling_layout=()
[ "$rls_threads" = 0 ] || ceiling_layout=(--single-thread)
mkdir "$work/perf"
"$binary" bench encode-request --domain bench --entry api_key=alice --out "$work/body.bin"

TOKIO_WORKER_THREADS=1 taskset -c 0 "$binary" bench constant-ok "${ceiling_layout[@]}" \
  --rls-addr 127.0.0.1:18091 2>/dev/null &
ceiling_pid=$!
start_bench_node

# load PORT N: N requests, 4 connections of 32 streams, from core 1
load() {
  taskset -c 1 h2load -n "$2" -c 4 -m 32 -t 1 -H 'content-type: application/grpc' -H 'te: trailers' \
    -d "$work/body.bin" "http://127.0.0.1:$1/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" \
    > "$work/load.txt"
  grep -q " $2 succeeded" "$work/load.txt" || { echo "not every request succeeded:" >&2; cat "$work/load.txt" >&2; exit 1; }
}

# profile NAME PORT PID: samples PID while it answers the measured requests
profile() {
  load "$2" 20000
  # perf's files go to a directory of their own: the node watches its policy's directory.
  perf record -q -F "$frequency" -e cpu-clock --call-graph dwarf,16384 -p "$3" -o "$work/perf/$1.data" 2>/dev/null &
  local perf_pid=$!
  sleep 0.5
  load "$2" "$requests"
  kill -INT "$perf_pid"
  wait "$perf_pid" || true
  perf script -i "$work/perf/$1.data" -F comm,ip,sym --no-inline 2>/dev/null > "$work/perf/$1.stacks"
}
profile ceiling 18091 "$ceiling_pid"
profile quotamesh 18081 "$node_pid"

python3 - "$work/perf/ceiling.stacks" "$work/perf/quotamesh.stacks" "$requests" "$frequency" "$path" <<'PYTHON'
import collections, sys

ceiling_file, node_file, requests, frequency, path = sys.argv[1:]
requests, frequency = int(requests), int(frequency)
# An idle server takes no samples: the half second before the load starts costs nothing.
# The threads that serve requests or run the node's runtime; any other is reported apart.
SERVING_THREADS = ("tokio-rt-worker", "rls-", "constant-ok")
PARTS = [
    ("Raft log flush thread", lambda comm, stack: comm.startswith("raft-log-flush")),
    ("other node threads", lambda comm, stack: not comm.startswith(SERVING_THREADS)),
    ("ledger round", lambda comm, stack: any(
        word in frame for frame in stack
        for word in ("openraft", "quotamesh::ledger", "lease_broker", "sled::", "ractor"))),
    ("RLS handler", lambda comm, stack: any(
        "ShouldRateLimit as tonic" in frame or "ConstantOk" in frame for frame in stack)),
    ("request decoding", lambda comm, stack: any("tonic::codec::decode" in frame for frame in stack)),
    ("service layers", lambda comm, stack: any("SvcFuture" in frame for frame in stack)),
    ("HTTP/2 stream", lambda comm, stack: any("H2Stream" in frame for frame in stack)),
    ("HTTP/2 connection", lambda comm, stack: any("serve_connection" in frame for frame in stack)),
    ("runtime and rest", lambda comm, stack: True),
]


def samples(file):
    """Yields (thread name, [frames, innermost first]) per sample."""
    comm, stack = None, []
    with open(file) as lines:
        for line in lines:
            if line.startswith("\t"):
                fields = line.strip().split(" ", 1)
                stack.append(fields[1] if len(fields) > 1 else fields[0])
            elif line.strip():
                if comm is not None:
                    yield comm, stack
                comm, stack = line.strip(), []
    if comm is not None:
        yield comm, stack


def attribute(file):
    parts, handler_self, threads = collections.Counter(), collections.Counter(), collections.Counter()
    for comm, stack in samples(file):
        for name, matches in PARTS:
            if matches(comm, stack):
                parts[name] += 1
                if name == "RLS handler" and stack:
                    handler_self[stack[0]] += 1
                if name == "other node threads":
                    threads[comm] += 1
                break
    return parts, handler_self, threads


ns_per_sample = 1e9 / frequency
ceiling, _, _ = attribute(ceiling_file)
node, handler_self, threads = attribute(node_file)
per_request = lambda count: count * ns_per_sample / requests
ceiling_total = per_request(sum(ceiling.values()))
node_total = per_request(sum(node.values()))
print(f"{path} path, {requests} requests each, CPU sampled at {frequency} Hz")
print(f"{'part':24s} {'ceiling ns':>11s} {'node ns':>9s} {'node - ceiling':>15s}  (share of the ceiling's CPU)")
for name, _ in PARTS:
    a, b = per_request(ceiling[name]), per_request(node[name])
    print(f"{name:24s} {a:11.0f} {b:9.0f} {b - a:+9.0f} ns {(b - a) / ceiling_total:+7.1%}")
print(f"{'whole request':24s} {ceiling_total:11.0f} {node_total:9.0f} {node_total - ceiling_total:+9.0f} ns"
      f" {(node_total - ceiling_total) / ceiling_total:+7.1%}")
print("the node's other threads: " + ", ".join(
    f"{comm} {per_request(count):.0f} ns" for comm, count in threads.most_common(5)))
print("the node's heaviest functions inside the RLS handler, by their own samples:")
for frame, count in handler_self.most_common(12):
    print(f"  {per_request(count):6.0f} ns  {frame[:110]}")
PYTHON
