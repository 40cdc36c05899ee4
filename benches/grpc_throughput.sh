#!/usr/bin/env bash
# End-to-end gRPC throughput of ShouldRateLimit with h2load, beside the ceiling: a
# constant-OK tonic RLS (`quotamesh bench constant-ok`) loaded by the same h2load command in
# the same run. Servers pinned to core 0 with one tokio worker, h2load to core 1. The ceiling
# runs twice: on tokio's multi-threaded runtime ("ceiling"), and on a single-threaded runtime
# on a thread of its own ("ceiling-1t", `--single-thread`), the layout a node serves its RLS
# port with when `rls_threads` is set (GRPC_BENCH_RLS_THREADS=1), which spends far less
# kernel time.
#
# The two servers are loaded in alternation for several rounds (this machine is shared and
# noisy); each figure is the median of its rounds. Prints requests/s, mean latency and
# server CPU per request for both, and the ratios; per round also each server's context
# switches per request and how its CPU split between its threads (by thread name).
#
# The node is a single-node region on loopback: every decision goes through local-first
# leasing from its embedded quota ledger (fsync on). The request's descriptor matches a
# rule of the script's own policy whose limit (1e9/s) is far above what h2load can send,
# so every answer is an admitted decision, paid from a lease while the ledger keeps up.
# After the rounds the script prints the node's own counts (decisions by code, unmatched
# descriptors, decisions paid from the fallback bucket, ledger calls) and fails if any
# answer was not OK through the rule, the share of decisions that took 1 ms or more and
# that of decisions that waited for their key's lease. When the fallback paid more than 1 %
# of the decisions (ledger calls failing open the circuit breaker), the figures are of the fallback
# bucket, not of leasing, and the script says so.
# The node runs with the shipped defaults ([leasing] included); GRPC_BENCH_LEDGER_TIMEOUT_MS
# sets a fixed ledger deadline instead of the default derived from measured latency.
# GRPC_BENCH_PATH=deny measures the deny path instead: the rule allows 5 a minute, so all
# but a handful of answers are OVER_LIMIT, decided from memory (the ledger said when the key
# has a token again), and the script checks that at most 1 % were admitted.
# Installs h2load (Debian package nghttp2-client) when it is missing, waits up to a minute
# for the 1-minute load average to fall below 1 (and says when it did not), and needs a
# release build (in CARGO_TARGET_DIR when set):
#   cargo build --release && benches/grpc_throughput.sh [requests] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/support/bench_node.sh

requests=${1:-200000}
rounds=${2:-3}
path=${GRPC_BENCH_PATH:-admit}
case $path in
  admit | deny) ;;
  *) echo "GRPC_BENCH_PATH is admit or deny, not $path" >&2; exit 2 ;;
esac
binary=${CARGO_TARGET_DIR:-target}/release/quotamesh
if ! command -v h2load >/dev/null; then
  echo "installing h2load (Debian package nghttp2-client)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends nghttp2-client >/dev/null \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends nghttp2-client >/dev/null; }
fi
[ -x "$binary" ] || { echo "build first: cargo build --release" >&2; exit 1; }

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

case $path in
  admit) limit='{unit: second, requests_per_unit: 1000000000}' ;;
  deny) limit='{unit: minute, requests_per_unit: 5}' ;;
esac
cat > "$work/policy.yaml" <<YAML
domain: bench
descriptors:
  - key: api_key
    rate_limit: $limit
YAML
# GRPC_BENCH_RLS_THREADS=N serves the node's RLS port from N threads of its own (`rls_threads`).
printf 'rls_threads = %s\n' "${GRPC_BENCH_RLS_THREADS:-0}" > "$work/node.toml"
ledger_timeout_ms=${GRPC_BENCH_LEDGER_TIMEOUT_MS:-}
if [ -n "$ledger_timeout_ms" ]; then
  printf '[leasing]\nledger_timeout_ms = %s\n' "$ledger_timeout_ms" >> "$work/node.toml"
fi
"$binary" bench encode-request --domain bench --entry api_key=alice --out "$work/body.bin"

# cpu_ticks PID: "user system" clock ticks of a process so far.
cpu_ticks() { awk '{print $14, $15}' "/proc/$1/stat"; }

# threads PID: one line per thread of the process: "name ticks switches", its name (spaces
# made underscores), CPU clock ticks so far (user and system) and context switches so far
# (voluntary and not).
threads() {
  local task stat name
  for task in /proc/"$1"/task/*; do
    stat=$(cat "$task/stat" 2>/dev/null) || continue
    name=${stat#*(}; name=${name%)*}
    stat=${stat##*) }
    printf '%s %s %s\n' "${name// /_}" \
      "$(awk '{print $12 + $13}' <<<"$stat")" \
      "$(awk '/ctxt_switches/ {n += $2} END {print n}' "$task/status" 2>/dev/null)"
  done
}

# thread_split BEFORE AFTER N: context switches per request, and each thread name's share
# of the process's CPU, between two `threads` listings (a thread that ended between them is
# left out).
thread_split() {
  awk -v n="$3" 'FNR == NR {ticks[$1] -= $2; switches[$1] -= $3; next}
    {ticks[$1] += $2; switches[$1] += $3}
    END {
      for (name in ticks) if (ticks[name] > 0) total += ticks[name]
      for (name in switches) all += switches[name]
      for (name in switches) if (switches[name] * 1000 >= n) split_by = split_by sprintf(" %s %.3f", name, switches[name] / n)
      printf "  context switches per request %.3f%s; CPU by thread:", all / n, (split_by == "" ? "" : " (by thread:" split_by ")")
      for (name in ticks) if (ticks[name] > 0) printf " %s %.1f%%", name, ticks[name] * 100 / total
      printf "\n"
    }' <(sort "$1") <(sort "$2")
}

# run NAME PORT PID: loads 127.0.0.1:PORT, prints the round's figures and appends
# "rps cpu_us kernel_us" (per request) to NAME.result
run() {
  local name=$1 port=$2 pid=$3
  # Warm up connections and caches.
  taskset -c 1 h2load -n 20000 -c 4 -m 32 -t 1 \
    -H 'content-type: application/grpc' -H 'te: trailers' -d "$work/body.bin" \
    "http://127.0.0.1:$port/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" >/dev/null
  threads "$pid" > "$work/threads.before"
  local before; before=$(cpu_ticks "$pid")
  taskset -c 1 h2load -n "$requests" -c 4 -m 32 -t 1 \
    -H 'content-type: application/grpc' -H 'te: trailers' -d "$work/body.bin" \
    "http://127.0.0.1:$port/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" > "$work/$name.txt"
  local after; after=$(cpu_ticks "$pid")
  threads "$pid" > "$work/threads.after"
  local rps mean failed
  rps=$(grep -oE '[0-9.]+ req/s' "$work/$name.txt" | head -1 | cut -d' ' -f1)
  mean=$(awk '/^time for request:/ {print $6}' "$work/$name.txt")
  failed=$(grep -oE '[0-9]+ failed' "$work/$name.txt" | head -1 | cut -d' ' -f1)
  local hz; hz=$(getconf CLK_TCK)
  local per_request='{printf "%.2f", t / hz * 1e6 / n}'
  local cpu_us kernel_us
  cpu_us=$(awk -v t="$(( ${after% *} + ${after#* } - ${before% *} - ${before#* } ))" -v hz="$hz" -v n="$requests" "BEGIN $per_request")
  kernel_us=$(awk -v t="$(( ${after#* } - ${before#* } ))" -v hz="$hz" -v n="$requests" "BEGIN $per_request")
  printf '%-12s %10s req/s   mean %8s   server CPU %6s us/request (kernel %s)   failed %s\n' \
    "$name" "$rps" "$mean" "$cpu_us" "$kernel_us" "$failed"
  thread_split "$work/threads.before" "$work/threads.after" "$requests"
  echo "$rps $cpu_us $kernel_us" >> "$work/$name.result"
}

TOKIO_WORKER_THREADS=1 taskset -c 0 "$binary" bench constant-ok --rls-addr 127.0.0.1:18091 2>/dev/null &
ceiling_pid=$!
TOKIO_WORKER_THREADS=1 taskset -c 0 "$binary" bench constant-ok --single-thread \
  --rls-addr 127.0.0.1:18092 2>/dev/null &
ceiling_1t_pid=$!
start_bench_node
for _ in $(seq 60); do
  awk '{exit !($1 < 1.0)}' /proc/loadavg && break
  sleep 1
done
awk '{exit !($1 < 1.0)}' /proc/loadavg || echo "the machine did not become quiet within a minute: figures are from a loaded machine"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

for _ in $(seq "$rounds"); do
  run ceiling 18091 "$ceiling_pid"
  run ceiling-1t 18092 "$ceiling_1t_pid"
  run quotamesh 18081 "$node_pid"
done

echo "load average after:  $(cut -d' ' -f1-3 /proc/loadavg)"

# What the node decided, from its own metrics: all OK through the rule, and how many
# decisions the fallback bucket paid instead of a lease.
metrics=$(curl -sf http://127.0.0.1:16070/metrics)
sum() { printf '%s\n' "$metrics" | awk -v pattern="$1" '$0 !~ /^#/ && $1 ~ pattern {total += $2} END {printf "%d", total}'; }
ok=$(sum '^quotamesh_rls_descriptor_decisions_total[{].*code="ok"')
not_ok=$(sum '^quotamesh_rls_descriptor_decisions_total[{].*code="(over_limit|shadow_over_limit)"')
unmatched=$(sum '^quotamesh_rls_unmatched_total')
rejected=$(sum '^quotamesh_rls_rejected_requests_total')
bypassed=$(sum '^quotamesh_rate_limit_bypassed_total')
calls=$(sum '^quotamesh_ledger_calls_total')
failed_calls=$(sum '^quotamesh_ledger_calls_total[{]result="error"')
# Decisions that took 1 ms or more: the histogram's count less its 1 ms bucket.
decided=$(sum '^quotamesh_rls_request_duration_seconds_count')
within_1ms=$(sum '^quotamesh_rls_request_duration_seconds_bucket[{]le="0.001"')
waits=$(sum '^quotamesh_lease_waits_total')
printf 'node (ledger timeout %s): %s OK through the rule, %s over limit, %s unmatched, %s rejected; %s paid from the fallback; %s ledger calls (%s failed), 1 per %s decisions; %s of %s decisions took 1 ms or more (%s %%); %s waited for a lease (%s %%)\n' \
  "${ledger_timeout_ms:-default}" "$ok" "$not_ok" "$unmatched" "$rejected" "$bypassed" "$calls" "$failed_calls" \
  "$(awk -v d="$ok" -v c="$calls" 'BEGIN {if (c > 0) printf "%.0f", d / c; else print "-"}')" \
  "$((decided - within_1ms))" "$decided" \
  "$(awk -v s="$((decided - within_1ms))" -v d="$decided" 'BEGIN {if (d > 0) printf "%.2f", s * 100 / d; else print "-"}')" \
  "$waits" "$(awk -v s="$waits" -v d="$decided" 'BEGIN {if (d > 0) printf "%.2f", s * 100 / d; else print "-"}')"
if [ "$path" = admit ]; then
  if [ "$ok" -eq 0 ] || [ "$not_ok" -ne 0 ] || [ "$unmatched" -ne 0 ] || [ "$rejected" -ne 0 ]; then
    echo "the node did not answer every request OK through the rule: the figures are not of admitted decisions" >&2
    exit 1
  fi
elif [ $((ok * 100)) -gt "$decided" ] || [ "$not_ok" -eq 0 ] || [ "$unmatched" -ne 0 ] || [ "$rejected" -ne 0 ]; then
  echo "the node admitted more than 1 % of the requests (or answered outside the rule): the figures are not of the deny path" >&2
  exit 1
fi

leased_note=""
if [ $((bypassed * 100)) -gt "$ok" ]; then
  leased_note="   (NOT leasing: the fallback paid $((bypassed * 100 / ok)) % of the decisions)"
fi

median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
# figure NAME COLUMN: the median of a server's rounds (1 req/s, 2 CPU us, 3 kernel us)
figure() { cut -d' ' -f"$2" "$work/$1.result" | median; }
printf 'median of %s rounds:' "$rounds"
for name in ceiling ceiling-1t quotamesh; do
  printf ' %s %s req/s %s us CPU (kernel %s);' "$name" "$(figure "$name" 1)" "$(figure "$name" 2)" "$(figure "$name" 3)"
done
printf '\n'
for name in ceiling ceiling-1t; do
  awk -v a="$(figure quotamesh 1)" -v b="$(figure "$name" 1)" -v c="$(figure quotamesh 2)" -v d="$(figure "$name" 2)" \
    -v e="$(figure quotamesh 3)" -v f="$(figure "$name" 3)" -v note="$leased_note" -v name="$name" 'BEGIN {
    printf "throughput ratio quotamesh/%-11s %.3f%s\n", name, a / b, note
    printf "CPU per request ratio vs %-11s %.3f\n", name, c / d
    printf "kernel time per request vs %-11s %.3f\n", name, (f > 0 ? e / f : 0)
  }'
done
