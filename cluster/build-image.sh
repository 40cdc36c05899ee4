#!/usr/bin/env bash
# Stages the FROM-scratch image's root file system: the release binary plus every shared
# library it links (as ldd lists them), at their own paths. Then builds the image.
set -euo pipefail
cd "$(dirname "$0")/.."

# With --all-targets the features match `cargo test`, so CI reuses the test build.
cargo build --release --workspace --all-targets
binary=target/release/quotamesh
root=target/docker/rootfs
# The data directory is staged apart, so the image can hand it to the unprivileged user.
owned=target/docker/owned
rm -rf "$root" "$owned"
mkdir -p "$root" "$owned/data"
touch "$owned/data/.keep"
cp "$binary" "$root/quotamesh"
for library in $(ldd "$binary" | grep -oE '/[^ ]+'); do
  mkdir -p "$root$(dirname "$library")"
  cp -L "$library" "$root$library"
done
echo "staged $(find "$root" -type f | wc -l) files, $(du -sh "$root" | cut -f1)"
