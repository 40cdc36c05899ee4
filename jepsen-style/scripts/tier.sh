#!/usr/bin/env bash
# The fault-injection tiers: short seeded schedules of quotamesh-jepsen across the
# workloads, topologies and nemeses, then the summary of every run and the worst verdict as
# the exit code (0 valid, 1 a violation, 2 a run that could not be judged).
#
#   jepsen-style/scripts/tier.sh ci [OUT]     # 4 schedules of 20 s: about 1.5 minutes (.ci/run)
#   jepsen-style/scripts/tier.sh fast [OUT]   # 22 schedules of 20 s: about 9 minutes
#   jepsen-style/scripts/tier.sh full [OUT]   # 120 schedules of 20 s: about 50 minutes
#
# SEED (default 1000) moves every seed; TIME_LIMIT (default 20s, three or four faults) sets
# each run's length. The ci tier exits non-zero only on a violation: a run it could not
# judge (2) is reported, and fails the tier only with STRICT=1.
# The netns lines need root (namespaces, nft), the docker line (full only) a usable docker
# and docker-compose; without them they are skipped, and said so. The docker line runs the
# node image cluster/build-image.sh builds from QUOTAMESH_BIN (quotamesh-jepsen:tier).
# Installs Debian's faketime (the clock nemeses) when it is missing; builds both binaries,
# unless BUILD=0 (CI: scripts/test.sh built them). QUOTAMESH_BIN and QUOTAMESH_JEPSEN_BIN
# name other binaries (copies, say, so a long tier is not disturbed by a build meanwhile).
set -euo pipefail
cd "$(dirname "$0")/../.."

tier=${1:-fast}
out=${2:-runs/tier-$tier}
case $tier in
  ci) per_line=1 ;;
  fast) per_line=2 ;;
  full) per_line=10 ;;
  *) echo "usage: $0 ci|fast|full [out-directory]" >&2; exit 2 ;;
esac
seed=${SEED:-1000}
time_limit=${TIME_LIMIT:-20s}

scripts/install-faketime.sh

jepsen=${QUOTAMESH_JEPSEN_BIN:-target/release/quotamesh-jepsen}
export QUOTAMESH_BIN=${QUOTAMESH_BIN:-target/release/quotamesh}
if [[ ${BUILD:-1} == 0 || -n ${QUOTAMESH_JEPSEN_BIN:-} ]]; then
  # The binaries `cargo test --release --workspace` built (CI): a `cargo build` of the
  # binaries alone right after it was seen to compile the quotamesh crate again (minutes).
  for binary in "$QUOTAMESH_BIN" "$jepsen"; do
    [[ -x $binary ]] || { echo "$binary is missing: build it, or run without BUILD=0" >&2; exit 2; }
  done
else
  cargo build --release --bin quotamesh
  cargo build --release -p quotamesh-jepsen --bin quotamesh-jepsen
fi

# workload topology nemeses [options]: each line runs per_line seeds (three voters unless
# the options say --nodes).
if [[ $tier == ci ]]; then
  # The issue's CI tier: bank under partitions and kills, accuracy under kills,
  # linearizable reads under pauses; and holds under clock jumps.
  lines=(
    "bank netns partition,kill"
    "rls local kill,pause"
    "linear local pause,kill"
    "holds local clock,kill"
  )
else
  lines=(
    "bank local kill,pause,clock,clock-step"
    "rls local kill,pause,policy --gateways 2"
    "bank local membership,kill,policy,pause"
    "rls local clock-step,pause,membership"
    "linear local pause,kill,clock,membership"
    "holds local clock,clock-step,kill,pause"
    "bank netns partition,partition-one-way,partition-flap,kill,pause,disk"
    "rls netns partition,partition-flap,partition-one-way,majorities-ring,kill --gateways 1"
    "leases local kill,pause,clock,membership,policy --gateways 1"
    "bank netns majorities-ring,partition,kill,pause --nodes 5"
    "leases netns majorities-ring,partition-one-way,kill,clock-step --nodes 5 --gateways 1"
  )
fi
if [[ $tier == full ]]; then
  lines+=("bank docker kill,pause,partition --image quotamesh-jepsen:tier")
fi
worst=0
for line in "${lines[@]}"; do
  read -r workload topology nemeses extra <<<"$line"
  read -r -a options <<<"${extra:-}"
  [[ " ${options[*]} " == *" --nodes "* ]] || options+=(--nodes 3)
  if [[ $topology == netns && $(id -u) != 0 ]]; then
    echo "skipped ($topology needs root): $line" >&2
    seed=$((seed + 1000))
    continue
  fi
  if [[ $topology == docker ]]; then
    if ! timeout 30 docker info >/dev/null 2>&1 || ! timeout 30 docker-compose version >/dev/null 2>&1; then
      echo "skipped (docker or docker-compose is not usable): $line" >&2
      seed=$((seed + 1000))
      continue
    fi
    # The image of the binary under test, however the tier got it.
    QUOTAMESH_BIN=$QUOTAMESH_BIN NODE_ONLY=1 timeout 300 cluster/build-image.sh quotamesh-jepsen:tier >/dev/null
  fi
  echo "== $workload on $topology under $nemeses, seeds $seed.. ($per_line runs)"
  code=0
  "$jepsen" soak --runs "$per_line" --topology "$topology" "${options[@]}" --workload "$workload" \
    --nemesis "$nemeses" --time-limit "$time_limit" --seed "$seed" --out "$out" >/dev/null || code=$?
  # A violation (1) outranks a run that could not be judged (2).
  if [[ $code == 1 || $worst == 1 ]]; then worst=1; elif ((code > worst)); then worst=$code; fi
  seed=$((seed + 1000))
done
"$jepsen" report "$out"
if [[ $tier == ci && $worst == 2 && ${STRICT:-0} != 1 ]]; then
  echo "some run could not be judged (see above); no violation found" >&2
  exit 0
fi
exit "$worst"
