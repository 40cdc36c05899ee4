# Sourced by the gRPC benchmark scripts: starts the node they measure.
#
# start_bench_node: starts "$binary" serve on core 0 with one tokio worker, its config
# "$work/node.toml", policy "$work/policy.yaml" and data in "$work/data", every listener on
# loopback off the default ports (so a node running beside is not met), its log in
# "$work/node.log"; sets node_pid and waits until it is ready, or exits with its log.
start_bench_node() {
  TOKIO_WORKER_THREADS=1 taskset -c 0 "$binary" serve --config "$work/node.toml" \
    --rls-addr 127.0.0.1:18081 --metrics-addr 127.0.0.1:16070 --billing-addr 127.0.0.1:18082 \
    --admin-addr 127.0.0.1:18083 --raft-addr 127.0.0.1:18084 --data-dir "$work/data" \
    --policy "$work/policy.yaml" 2>"$work/node.log" &
  node_pid=$!
  local ready=
  for _ in $(seq 100); do
    curl -sf http://127.0.0.1:16070/readyz >/dev/null 2>&1 && { ready=1; break; }
    sleep 0.1
  done
  [ -n "$ready" ] || { echo "the node did not become ready:" >&2; tail -n 20 "$work/node.log" >&2; exit 1; }
}
