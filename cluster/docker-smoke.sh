#!/usr/bin/env bash
# Builds the FROM-scratch image, brings docker-compose.yml up, checks health and one real
# RLS answer from the container, and takes everything down again.
set -euo pipefail
cd "$(dirname "$0")/.."

cluster/build-image.sh
docker-compose down -v --remove-orphans >/dev/null 2>&1 || true
trap 'docker-compose logs --no-color | tail -40; docker-compose down -v --remove-orphans' EXIT
docker-compose up -d --build

for _ in $(seq 150); do
  curl -sf http://127.0.0.1:6070/readyz >/dev/null 2>&1 && break
  sleep 0.2
done
curl -sf http://127.0.0.1:6070/healthz
curl -sf http://127.0.0.1:6070/readyz
answer=$(target/release/quotamesh rls ask --addr http://127.0.0.1:8081 --domain quotamesh-example --entry api_key=docker-smoke)
echo "$answer"
grep -q '"overall_code": "OK"' <<<"$answer"
curl -sf http://127.0.0.1:6070/metrics | grep -q 'quotamesh_rls_decisions_total{code="ok",domain="quotamesh-example"} 1'
echo "docker-compose smoke test passed"
