#!/usr/bin/env bash
# Installs Debian's faketime (libfaketime) when it is missing: the clock-skew test and the
# fault-injection suite's clock nemeses run nodes under it. Needs root (CI runs as root).
set -euo pipefail
if ! compgen -G "/usr/lib/*/faketime/libfaketime.so.1" >/dev/null \
  && ! compgen -G "/usr/lib/faketime/libfaketime.so.1" >/dev/null; then
  echo "installing faketime (Debian package)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends faketime >/dev/null \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends faketime >/dev/null; }
fi
