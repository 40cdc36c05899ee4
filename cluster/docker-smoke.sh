#!/usr/bin/env bash
# Builds the FROM-scratch image, brings docker-compose.yml up, checks health (the image's own
# HEALTHCHECK too), one real RLS answer from the container, the policy files refused without
# an operator token, and that its log has no colour codes and no ERROR line, then takes
# everything down again.
set -euo pipefail
cd "$(dirname "$0")/.."

cluster/build-image.sh
docker-compose down -v --remove-orphans >/dev/null 2>&1 || true
trap 'docker-compose logs --no-color | tail -40; docker-compose down -v --remove-orphans' EXIT
docker-compose up -d

for _ in $(seq 150); do
  curl -sf http://127.0.0.1:6070/readyz >/dev/null 2>&1 && break
  sleep 0.2
done
curl -sf http://127.0.0.1:6070/healthz
curl -sf http://127.0.0.1:6070/readyz
answer=$(target/release/quotamesh rls ask --json --addr http://127.0.0.1:8081 --domain quotamesh-example --entry api_key=docker-smoke)
echo "$answer"
grep -q '"overall_code": "OK"' <<<"$answer"
# grep reads to the end (no -q): curl must not see its pipe closed early.
curl -sf http://127.0.0.1:6070/metrics \
  | grep 'quotamesh_rls_decisions_total{code="ok",domain="quotamesh-example"} 1' >/dev/null
# The policy files are for operators: the embedded default has no operator token, so none.
[ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:6070/config)" = 401 ]

container=$(docker-compose ps -q quotamesh)
health=
for _ in $(seq 60); do
  health=$(docker inspect --format '{{.State.Health.Status}}' "$container")
  [ "$health" = healthy ] && break
  sleep 1
done
[ "$health" = healthy ] || { echo "container health: $health" >&2; exit 1; }

logs=$(docker-compose logs --no-color quotamesh)
if grep -q $'\e\[' <<<"$logs"; then echo "colour codes in the container's log" >&2; exit 1; fi
if grep -q ' ERROR ' <<<"$logs"; then echo "ERROR lines in the container's log" >&2; exit 1; fi
echo "image: $(docker image inspect --format '{{.Size}}' quotamesh:dev) bytes"
echo "docker-compose smoke test passed"
