#!/usr/bin/env bash
# Builds the FROM-scratch image `quotamesh:dev` (or the tag given as $1): stages the release
# binary, stripped, plus every shared library it links (as ldd lists them) at their own
# paths, then runs docker build on cluster/Dockerfile.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-quotamesh:dev}

# The same build as the README's commands (cargo run --release, scripts/test.sh): the
# features of normal and dev-dependencies are aligned in Cargo.toml, so nothing is rebuilt.
cargo build --release --bin quotamesh
binary=target/release/quotamesh
root=target/docker/rootfs
# The data directory is staged apart, so the image can hand it to the unprivileged user.
owned=target/docker/owned
rm -rf "$root" "$owned"
mkdir -p "$root" "$owned/data"
touch "$owned/data/.keep"
# Symbols and line tables stay in target/release/quotamesh for debugging; the image gets
# neither.
strip --strip-all -o "$root/quotamesh" "$binary"
for library in $(ldd "$binary" | grep -oE '/[^ ]+'); do
  mkdir -p "$root$(dirname "$library")"
  cp -L "$library" "$root$library"
done
echo "staged $(find "$root" -type f | wc -l) files, $(du -sh "$root" | cut -f1)"
docker build --file cluster/Dockerfile --tag "$tag" .
docker image ls "$tag"
