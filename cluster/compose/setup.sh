# The one-shot steps of docker-compose.yml, run by dash in the quotamesh-setup image (which
# has the quotamesh binary and a shell, nothing else: no mkdir, no rm), so every step is
# a quotamesh command or a shell builtin. Each step may run again on a later `up`.
#
#   sh setup.sh certs   the cluster CA and every node's certificate, in the volume at /certs
#   sh setup.sh init    forms each region's quota group through its node 1
set -eu

# certs: one CA for the cluster "quotamesh-mesh" (both regions: the regions accept each
# other's certificates by it, and each certificate names its region), and per region the
# certificates of voters 1 to 3 (valid for their compose name and their mesh address, which
# the other region's QUIC dials) and of gateway 4. Files are never overwritten, so a file
# already there is kept (from an earlier `up`).
certs() {
  [ -f /certs/ca.pem ] || /quotamesh cluster certs init --cluster-id quotamesh-mesh --out /certs
  for region in a b; do
    # The mesh addresses of docker-compose.yml: region-a's voters .11 to .13, region-b's
    # .21 to .23.
    case $region in a) mesh=192.168.243.1 ;; b) mesh=192.168.243.2 ;; esac
    for node in 1 2 3; do
      [ -f "/certs/region-$region/node-$node.pem" ] \
        || /quotamesh cluster certs issue --ca /certs --out "/certs/region-$region" \
          --region "region-$region" --node-id "$node" \
          --san "region-$region-node-$node" --san "$mesh$node"
    done
    [ -f "/certs/region-$region/node-4.pem" ] \
      || /quotamesh cluster certs issue --ca /certs --out "/certs/region-$region" \
        --region "region-$region" --node-id 4 --san "region-$region-gateway" --gateway
  done
}

# init: `cluster init` on node 1 of each region. A group formed by an earlier `up` answers
# AlreadyExists, which is success here.
init() {
  for region in a b; do
    if ! answer=$(/quotamesh cluster init --admin-addr "region-$region-node-1:8083" 2>&1); then
      case $answer in
        *AlreadyExists*) answer="region-$region: quota group already formed" ;;
        *) echo "$answer" >&2; exit 1 ;;
      esac
    fi
    echo "$answer"
  done
}

case ${1:-} in
  certs) certs ;;
  init) init ;;
  *) echo "usage: setup.sh certs|init" >&2; exit 2 ;;
esac
