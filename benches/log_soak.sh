#!/usr/bin/env bash
# A healthy 3-node region under steady Envoy RLS load, and what it logs: the three nodes
# (mTLS between them, as shipped) on 127.0.0.11 to 127.0.0.13, off the default ports, with
# their logs written to files; h2load sends ShouldRateLimit to each node at a fixed rate for
# the duration, each node its own key, every answer admitted through leases from the quota
# ledger. Prints, per node, how many lines its log has, how many are ERROR or WARN and how
# many hold ANSI escape codes (a file is no terminal: there must be none), the first ERROR
# and WARN lines, the decisions it made, and the load average seen; fails on any ERROR line
# or escape code, or on a request h2load saw fail.
# Needs h2load (Debian package nghttp2-client) and a release build (in CARGO_TARGET_DIR when
# set):
#   cargo build --release && benches/log_soak.sh [seconds] [requests_per_second_per_node]
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-600}
rate=${2:-200}
binary=${CARGO_TARGET_DIR:-target}/release/quotamesh
command -v h2load >/dev/null || { echo "h2load missing: apt-get install nghttp2-client" >&2; exit 1; }
[ -x "$binary" ] || { echo "build first: cargo build --release" >&2; exit 1; }

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

cat > "$work/policy.yaml" <<'YAML'
domain: soak
descriptors:
  - key: api_key
    rate_limit: {unit: second, requests_per_unit: 100000}
YAML
token=soak-operator-token
digest=$(printf %s "$token" | "$binary" billing hash-token)
"$binary" cluster certs init --cluster-id soak --out "$work/certs" >/dev/null
peers=
for n in 1 2 3; do
  "$binary" cluster certs issue --ca "$work/certs" --node-id "$n" --region soak \
    --san "127.0.0.1$n" >/dev/null
  peers+=$'\n'"[[peers]]"$'\n'"id = $n"$'\n'"raft_addr = \"127.0.0.1$n:28084\""$'\n'
done
for n in 1 2 3; do
  cat > "$work/node-$n.toml" <<TOML
node_id = "soak-$n"
cluster_id = "soak"
region = "soak"
raft_node_id = $n
data_dir = "$work/data-$n"
policy = "$work/policy.yaml"
rls_addr = "127.0.0.1$n:28081"
metrics_addr = "127.0.0.1$n:26070"
admin_addr = "127.0.0.1$n:28083"
raft_addr = "127.0.0.1$n:28084"
billing_addr = "127.0.0.1$n:28082"
$peers
[tls]
cert = "$work/certs/node-$n.pem"
key = "$work/certs/node-$n.key"
ca = "$work/certs/ca.pem"

[[admin.tokens]]
name = "soak"
sha256 = "$digest"
TOML
  if [ "$n" = 1 ]; then printf '\n[billing]\nbootstrap = true\n' >> "$work/node-$n.toml"; fi
  # The log a user gets: no RUST_LOG, stderr to a file.
  env -u RUST_LOG "$binary" serve --config "$work/node-$n.toml" 2>"$work/node-$n.log" &
done
for n in 1 2 3; do
  until "$binary" health --url "http://127.0.0.1$n:26070/healthz" >/dev/null 2>&1; do sleep 0.2; done
done
export QUOTAMESH_ADMIN_TOKEN=$token
"$binary" cluster init --admin-addr 127.0.0.11:28083 >/dev/null 2>&1
for n in 1 2 3; do
  until "$binary" health --url "http://127.0.0.1$n:26070/readyz" >/dev/null 2>&1; do sleep 0.2; done
done

echo "load: $rate requests/s to each node for $seconds s"
loaders=()
for n in 1 2 3; do
  "$binary" bench encode-request --domain soak --entry "api_key=soak-$n" --out "$work/body-$n.bin"
  h2load -D "$seconds" -c 2 -m 1 -t 1 --rps "$((rate / 2))" \
    -H 'content-type: application/grpc' -H 'te: trailers' -d "$work/body-$n.bin" \
    "http://127.0.0.1$n:28081/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" \
    >"$work/h2load-$n.txt" 2>&1 &
  loaders+=("$!")
done
# The load average, every 30 s, while the load runs.
loads=()
end=$((SECONDS + seconds))
while [ "$SECONDS" -lt "$end" ]; do
  sleep 30
  loads+=("$(cut -d' ' -f1 /proc/loadavg)")
done
for loader in "${loaders[@]}"; do wait "$loader" || true; done
echo "load average (1 min) every 30 s: ${loads[*]}"

status=0
for n in 1 2 3; do
  log="$work/node-$n.log"
  lines=$(wc -l <"$log")
  errors=$(grep -c ' ERROR ' "$log" || true)
  warnings=$(grep -c ' WARN ' "$log" || true)
  escapes=$(grep -c $'\e' "$log" || true)
  decisions=$(curl -s "http://127.0.0.1$n:26070/metrics" \
    | awk '/^quotamesh_rls_decisions_total\{.*domain="soak"/ {sum += $2} END {print sum + 0}')
  failed=$(grep -oE '[0-9]+ failed' "$work/h2load-$n.txt" | head -1 | cut -d' ' -f1)
  echo "node $n: $lines log lines, $errors ERROR, $warnings WARN, $escapes with escape codes; $decisions decisions; h2load failed ${failed:-?}"
  # -m: grep stops by itself (a `head` would end it with SIGPIPE, failing under pipefail).
  grep -m 10 -E ' (ERROR|WARN) ' "$log" | cut -c1-300 || true
  if [ "$errors" != 0 ] || [ "$escapes" != 0 ] || [ "${failed:-1}" != 0 ]; then status=1; fi
done
exit "$status"
