#!/bin/sh
# Makes the CA and node certificates of the example region (cluster/region-a): one CA for
# cluster "region-a", and a certificate for each of the nodes 1 to 5 (three voters, a
# gateway's for node 4, and node 5's, to grow the region with) naming its Raft node id and
# valid for its loopback address 127.0.0.N.
#
#   cluster/make-certs.sh            # uses `quotamesh` on PATH; QUOTAMESH=path/to/quotamesh
#
# Writes cluster/region-a/certs/ (ca.pem, ca.key, node-N.pem, node-N.key); refuses to
# overwrite, so remove the directory to start over. The CA key (ca.key) is what issues
# certificates: in a real region it stays with the operator, never on a node.
set -eu

quotamesh=${QUOTAMESH:-quotamesh}
certs=$(dirname "$0")/region-a/certs

"$quotamesh" cluster certs init --cluster-id region-a --out "$certs"
for node in 1 2 3 5; do
    "$quotamesh" cluster certs issue --ca "$certs" --node-id "$node" --region region-a \
        --san "127.0.0.$node" --san localhost
done
# The gateway's certificate lets it lease for itself, nothing more.
"$quotamesh" cluster certs issue --ca "$certs" --node-id 4 --region region-a \
    --san 127.0.0.4 --san localhost --gateway
