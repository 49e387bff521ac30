#!/usr/bin/env bash
# Gateway API's standard-channel CRDs (HTTPRoute, Gateway, ...) from the sigs.k8s.io/gateway-api
# Go module, pinned here, through the Go module proxy (checksum-verified, cached in GOMODCACHE).
# Prints the folder of the CRD manifests; scripts/cluster.sh applies them.
set -euo pipefail
VERSION=v1.6.3 # v1.7.0 needs a newer Go than 1.26
command -v go >/dev/null || { echo "gateway-api-crds: error: 'go' not found" >&2; exit 1; }
DIR=$(cd /tmp && go mod download -json "sigs.k8s.io/gateway-api@$VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
[[ -d $DIR/config/crd/standard ]] || { echo "gateway-api-crds: error: no config/crd/standard in $DIR" >&2; exit 1; }
echo "$DIR/config/crd/standard"
