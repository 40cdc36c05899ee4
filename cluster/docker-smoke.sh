#!/usr/bin/env bash
# Builds the FROM-scratch images, brings docker-compose.yml's two-region mesh up and checks it
# end to end, then takes everything down again (volumes too), pass or fail:
#   - every container healthy (the images' own probes), the one-shot setup steps done;
#   - node health on the host, the policy files refused without an operator token (401);
#   - both regions answer real HTTP requests through their Envoy: 200, and 429 over a limit;
#   - with the mesh network cut (`docker network disconnect`), both regions still answer
#     through their Envoy, promptly; after reconnecting, the regions' link is up again;
#   - skewed traffic (all of it on one region) moves slice from the other region to it,
#     and the slices plus the tokens in flight still add up to the global limit;
#   - no colour codes and no ERROR lines in the nodes' logs; the images' sizes.
# Prints the last logs on failure, and its duration.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS

fail() {
  echo "FAILED: $*" >&2
  exit 1
}

section() {
  echo "== $* (at $((SECONDS - started)) s)"
}

section "images"
cluster/build-image.sh

# The global limit of cluster/compose/policies/mesh.yaml and each region's policy slice.
GLOBAL_TOKENS=20
POLICY_SLICE_TOKENS=10
ENVOY_A=http://127.0.0.1:10000
ENVOY_B=http://127.0.0.1:10001
# Node 1 of each region; the voters' metrics ports are 6070 to 6072 and 6073 to 6075.
METRICS_A=http://127.0.0.1:6070
METRICS_B=http://127.0.0.1:6073
# Its own project name: the checks find containers and networks by its labels.
export COMPOSE_PROJECT_NAME=quotamesh-smoke

finish() {
  local status=$?
  if [ -n "${load_pid:-}" ]; then kill "$load_pid" 2>/dev/null || true; fi
  rm -f "${load_log:-}"
  if ((status != 0)); then
    docker-compose ps || true
    docker-compose logs --no-color --tail 25 || true
  fi
  timeout 120 docker-compose down -v --remove-orphans >/dev/null 2>&1 \
    || echo "docker-compose down failed" >&2
  local verdict=passed
  ((status == 0)) || verdict=FAILED
  echo "docker-compose smoke test $verdict in $((SECONDS - started)) s"
}
timeout 120 docker-compose down -v --remove-orphans >/dev/null 2>&1 || true
trap finish EXIT
section "up"
# `up` waits for each service's dependencies (the setup steps, the nodes' health): bounded.
timeout 150 docker-compose up -d

# The containers by service, asked once (each `docker-compose` call takes a second or more).
declare -A containers
while read -r id service; do
  containers[$service]=$id
done < <(docker ps -a --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" \
  --format '{{.ID}} {{.Label "com.docker.compose.service"}}')

# Containers not (yet) as they should be: running and healthy, or a one-shot exited 0.
not_ready() {
  docker inspect --format \
    '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}-{{end}} {{.State.ExitCode}}' \
    "${containers[@]}" | grep -vE ' running healthy 0$| exited - 0$' || true
}

wait_ready() {
  local deadline=$((SECONDS + 60)) pending
  while pending=$(not_ready) && [ -n "$pending" ]; do
    ((SECONDS < deadline)) || fail "containers not healthy: $pending"
    sleep 1
  done
}

# status URL [CURL_ARGS...]: the HTTP status of one GET.
status() {
  local url=$1
  shift
  curl -s -o /dev/null -m 5 -w '%{http_code}' "$@" "$url" || true
}

# metric URL SERIES: the value of one series on a node's /metrics ("" when absent).
metric() {
  curl -sf -m 5 "$1/metrics" | awk -v series="$2" '$1 == series { print $2 }' || true
}

# metrics_url SERVICE: where a voter's metrics port is published on the host.
metrics_url() {
  local node=${1##*-}
  case $1 in
    region-a-node-*) echo "http://127.0.0.1:$((6069 + node))" ;;
    region-b-node-*) echo "http://127.0.0.1:$((6072 + node))" ;;
  esac
}

# metric_of SERVICE SERIES: as metric, for a voter by its service name ("" for none).
metric_of() {
  [ -n "$1" ] || return 0
  metric "$(metrics_url "$1")" "$2"
}

# leader REGION: the service of the voter leading the region's quota group.
leader() {
  local node
  for node in 1 2 3; do
    if [ "$(metric_of "$1-node-$node" quotamesh_region_leading)" = 1 ]; then
      echo "$1-node-$node"
      return
    fi
  done
}

# burst URL N [CURL_ARGS...]: N requests on one connection; prints how many got each status.
burst() {
  local url=$1 count=$2 arguments=() i
  shift 2
  for ((i = 0; i < count; i++)); do arguments+=(-o /dev/null "$url"); done
  curl -s -m 30 -w '%{http_code}\n' "$@" "${arguments[@]}" | sort | uniq -c | tr '\n' ' '
}

# answers NAME URL KEY: a burst past the per-key limit gets both 200 and 429.
answers() {
  local name=$1 url=$2 key=$3 counts
  counts=$(burst "$url/" 30 -H "x-api-key: $key")
  echo "$name: 30 requests with x-api-key $key: $counts(count status)"
  grep -q ' 200 ' <<<" $counts" || fail "$name admitted nothing"
  grep -q ' 429 ' <<<" $counts" || fail "$name never answered 429"
}

section "health"
wait_ready
for metrics in "$METRICS_A" "$METRICS_B"; do
  curl -sf -m 5 "$metrics/healthz" >/dev/null || fail "$metrics/healthz"
  curl -sf -m 5 "$metrics/readyz" >/dev/null || fail "$metrics/readyz"
  # The policy files are for operators: without the token, none.
  [ "$(status "$metrics/config")" = 401 ] || fail "$metrics/config answered without a token"
done
for url in "$ENVOY_A" "$ENVOY_B"; do
  deadline=$((SECONDS + 30))
  until [ "$(status "$url/")" = 200 ]; do
    ((SECONDS < deadline)) || fail "no 200 from $url"
    sleep 0.5
  done
done

section "both regions answer through their Envoy"
answers region-a "$ENVOY_A" smoke-a
answers region-b "$ENVOY_B" smoke-b

section "the regions cut apart"
# The rule's label, and each region's own slice (node 1 of each is published on the host).
# The leader adopts the slice once the group has formed and node 1 exports it on its next
# tick, which may come after the first answers: wait for it.
deadline=$((SECONDS + 30))
rule=
until [ -n "$rule" ]; do
  rule=$(curl -sf -m 5 "$METRICS_A/metrics" \
    | grep -oE 'quotamesh_region_slice_tokens\{region="region-a",rule="[^"]*global[^"]*"' \
    | head -1 | sed -E 's/.*rule="([^"]*)"/\1/') || true
  [ -n "$rule" ] || ((SECONDS < deadline)) || fail "region-a has no slice of the global limit"
  [ -n "$rule" ] || sleep 0.5
done
slice() { metric "$1" "quotamesh_region_slice_tokens{region=\"$2\",rule=\"$rule\"}"; }
in_flight() { metric "$1" "quotamesh_region_in_flight_tokens{rule=\"$rule\"}"; }
deadline=$((SECONDS + 30))
until [ "$(slice "$METRICS_A" region-a)" = "$POLICY_SLICE_TOKENS" ] \
  && [ "$(slice "$METRICS_B" region-b)" = "$POLICY_SLICE_TOKENS" ]; do
  ((SECONDS < deadline)) || fail "the regions did not adopt their policy slices of $rule"
  sleep 0.5
done
# Traffic goes to region-a through its Envoy, spread over its voters and gateway; each node
# reports its demand to the region's ledger, which adds them up.
hot=region-a hot_envoy=$ENVOY_A hot_metrics=$METRICS_A cold=region-b cold_metrics=$METRICS_B
hot_node=${containers[$hot-node-1]}
mesh=$(docker network ls --format '{{.Name}}' --filter label=com.docker.compose.network=mesh \
  --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
[ -n "$mesh" ] || fail "no mesh network for project $COMPOSE_PROJECT_NAME"
declare -A mesh_ips
for service in region-{a,b}-node-{1,2,3}; do  # the voters: the gateways are not on it
  container=${containers[$service]}
  mesh_ips[$container]=$(docker inspect --format \
    "{{(index .NetworkSettings.Networks \"$mesh\").IPAddress}}" "$container")
  docker network disconnect "$mesh" "$container"
done
# Each region's leader (the only node that calls the other region) sees its link go down.
link() { metric_of "$(leader "$1")" "quotamesh_region_link_up{region=\"$2\"}"; }
links() { echo "$(link region-a region-b) $(link region-b region-a)"; }
deadline=$((SECONDS + 30))
until [ "$(links)" = "0 0" ]; do
  ((SECONDS < deadline)) || fail "links still up with the mesh network cut: $(links)"
  sleep 0.5
done
for region in a b; do
  url=ENVOY_${region^^}
  # A 429 is quotamesh's answer (Envoy fails open): each region still decides on its own.
  answers "region-$region (cut)" "${!url}" "smoke-cut-$region"
  # No request waits on the other region.
  slowest=$(curl -s -o /dev/null -m 5 -w '%{time_total}' "${!url}/" -H "x-api-key: slow-$region")
  awk -v t="$slowest" 'BEGIN { exit !(t < 1) }' || fail "region-$region took $slowest s"
done
for container in "${!mesh_ips[@]}"; do
  docker network connect --ip "${mesh_ips[$container]}" "$mesh" "$container"
done
deadline=$((SECONDS + 30))
until [ "$(links)" = "1 1" ]; do
  ((SECONDS < deadline)) || fail "links not up again after reconnecting: $(links)"
  sleep 0.5
done
echo "mesh network reconnected, both links up"

section "skewed traffic moves slice to the busy region"
# All traffic on the busy region, until the checks below stop it (or 90 s pass).
load_log=$(mktemp)
(
  end=$((SECONDS + 90))
  while ((SECONDS < end)); do burst "$hot_envoy/" 200 >>"$load_log"; echo >>"$load_log"; done
) &
load_pid=$!
shift_at=$SECONDS
deadline=$((SECONDS + 60))
previous= quiet=0 rebalanced=
while :; do
  sample="$(slice "$hot_metrics" "$hot") $(slice "$cold_metrics" "$cold") $(in_flight "$hot_metrics") $(in_flight "$cold_metrics")"
  read -r hot_slice cold_slice hot_flying cold_flying <<<"$sample"
  # Read one region after the other, a sample is exact only while nothing moves: nothing in
  # flight, and the same numbers as the sample before.
  if [ "$hot_flying $cold_flying" = "0 0" ] && [ "$sample" = "$previous" ]; then
    ((hot_slice + cold_slice == GLOBAL_TOKENS)) \
      || fail "tokens not conserved: $hot $hot_slice + $cold $cold_slice != $GLOBAL_TOKENS"
    if [ -n "$rebalanced" ]; then quiet=$((quiet + 1)); fi
  fi
  if [ -z "$rebalanced" ] && ((hot_slice > POLICY_SLICE_TOKENS)); then
    rebalanced=$((SECONDS - shift_at))
  fi
  [ -n "$rebalanced" ] && ((quiet >= 2)) && break
  ((SECONDS < deadline)) || break
  previous=$sample
  sleep 1
done
echo "slices ($hot, $cold, in flight): $sample; rebalanced after ${rebalanced:-never} s"
[ -n "$rebalanced" ] || fail "$hot never got more than its policy slice of $rule"
((quiet >= 2)) || fail "the slices did not settle after the rebalance"
# The same through the admin API, while the traffic lasts: the busy region's ledger holds more
# than its policy share of the global limit.
regions=$(docker exec "$hot_node" /quotamesh cluster regions --json)
python3 -c '
import json, sys
node = json.loads(sys.argv[1])["nodes"][0]
slice = next(s for s in node["slices"] if s["rule"] == sys.argv[2])
print("cluster regions:", json.dumps(slice))
assert slice["global_tokens"] == int(sys.argv[3]), slice
assert slice["slice_tokens"] > int(sys.argv[4]), slice
' "$regions" "$rule" "$GLOBAL_TOKENS" "$POLICY_SLICE_TOKENS" || fail "cluster regions on $hot: $regions"
kill "$load_pid" 2>/dev/null || true
wait "$load_pid" 2>/dev/null || true
echo "traffic on $hot for $((SECONDS - shift_at)) s: $(tr -s ' \n' ' ' <"$load_log" \
  | awk '{for (i = 1; i < NF; i += 2) total[$(i + 1)] += $i} END {for (s in total) printf "%s %s ", total[s], s}')(count status)"
rm -f "$load_log"
wait_ready

section "logs"
nodes=(region-{a,b}-{node-1,node-2,node-3,gateway})
logs=$(docker-compose logs --no-color)
if grep -q $'\e\[' <<<"$logs"; then fail "colour codes in the containers' logs"; fi
if docker-compose logs --no-color "${nodes[@]}" setup-certs setup-init | grep ' ERROR '; then
  fail "ERROR lines in the nodes' logs"
fi
for image in quotamesh:dev quotamesh-envoy:dev quotamesh-setup:dev; do
  echo "image $image: $(docker image inspect --format '{{.Size}}' "$image") bytes"
done
