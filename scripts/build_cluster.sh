#!/usr/bin/env bash
# Build a pinned Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler) and etcd (tools/cluster), and the Gateway API implementation
# the cluster runs, Envoy Gateway (tools/gateway), from Go modules, into a cache
# outside the repo keyed by a hash of the build inputs.
#
#   scripts/build_cluster.sh          # prints progress, last line = bin directory
#   BIN=$(scripts/build_cluster.sh | tail -n1)
#   scripts/build_cluster.sh --cached # the bin directory if already built, else exit 3
#
# Output: ${KVGATE_CLUSTER_CACHE:-$HOME/.cache/kvgate-cluster}/<hash>/ with gateway-crds.yaml
# (Envoy Gateway's CRDs) and bin/ with one
# multi-call binary (kvgate-cluster) and symlinks kube-apiserver,
# kube-controller-manager, kube-scheduler, etcd pointing at it, envoy-gateway, and
# echo-basic (tools/conformance: the backend the conformance suites deploy).
# A cache hit is a no-op. Only the Go module proxy is needed (GOMODCACHE stays
# at its default, outside the repo). Honours GOFLAGS; uses -mod=vendor when
# tools/cluster/vendor exists, else -mod=readonly unless GOFLAGS sets -mod.
set -euo pipefail

SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
ROOT="$(cd "$(dirname "$SCRIPT")/.." && pwd)"
MOD_DIR="$ROOT/tools/cluster"
GW_DIR="$ROOT/tools/gateway"
CONF_DIR="$ROOT/tools/conformance"
CACHE="${KVGATE_CLUSTER_CACHE:-$HOME/.cache/kvgate-cluster}"
COMMANDS=(kube-apiserver kube-controller-manager kube-scheduler etcd)
NICE=(nice -n 10)

START=$SECONDS
log() { echo "cluster-build: [$((SECONDS - START))s] $*" >&2; }
die() { echo "cluster-build: error: $*" >&2; exit 1; }

command -v go >/dev/null 2>&1 ||
  die "'go' not found in PATH; install Go >= 1.26 (the module in tools/cluster needs it)"
[ -f "$MOD_DIR/go.mod" ] || die "$MOD_DIR/go.mod not found"
command -v sha256sum >/dev/null 2>&1 || die "'sha256sum' not found in PATH"
# Run inside the module so a GOTOOLCHAIN switch (go.mod says go 1.26.0) is seen.
GO_VERSION="$(cd "$MOD_DIR" && go version)" || die "'go version' failed in $MOD_DIR"

# Versions come from the wrapper module's go.mod (single source of truth).
K8S_VERSION="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$MOD_DIR/go.mod")"
[[ "$K8S_VERSION" =~ ^v([0-9]+)\.([0-9]+)\.[0-9]+ ]] ||
  die "cannot read the k8s.io/kubernetes version from $MOD_DIR/go.mod"
K8S_MAJOR="${BASH_REMATCH[1]}"
K8S_MINOR="${BASH_REMATCH[2]}"
EG_VERSION="$(awk '$1 == "github.com/envoyproxy/gateway" && $2 ~ /^v/ {print $2; exit}' "$GW_DIR/go.mod")"
[ -n "$EG_VERSION" ] || die "cannot read the github.com/envoyproxy/gateway version from $GW_DIR/go.mod"

# Cache key: both modules' go.mod, go.sum and *.go, this script and `go version`.
HASH="$(
  {
    for dir in "$MOD_DIR" "$GW_DIR" "$CONF_DIR"; do
      for f in go.mod go.sum $(cd "$dir" && find . -name '*.go' -not -path './vendor/*' | LC_ALL=C sort); do
        [ -f "$dir/$f" ] || continue
        printf '%s/%s\n' "$(basename "$dir")" "$f"
        sha256sum <"$dir/$f"
      done
    done
    printf 'script\n'
    sha256sum <"$SCRIPT"
    printf '%s\n' "$GO_VERSION"
  } | sha256sum | cut -c1-16
)"
OUT="$CACHE/$HASH"

complete() {
  [ -x "$1/bin/kvgate-cluster" ] || return 1
  local c
  for c in "${COMMANDS[@]}" envoy-gateway echo-basic; do [ -x "$1/bin/$c" ] || return 1; done
  [ -s "$1/gateway-crds.yaml" ] || return 1
}

if complete "$OUT"; then
  log "cache hit ($K8S_VERSION, Envoy Gateway $EG_VERSION, key $HASH)"
  echo "$OUT/bin"
  exit 0
fi
if [ "${1:-}" = "--cached" ]; then
  log "not built yet (key $HASH)"
  exit 3
fi

mkdir -p "$CACHE"
TMP="$(mktemp -d "$CACHE/.build-$HASH.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
chmod 755 "$TMP" # mktemp -d makes it 0700
mkdir -p "$TMP/bin"

MODFLAG=()
if [ -d "$MOD_DIR/vendor" ]; then
  MODFLAG=(-mod=vendor)
elif [[ " ${GOFLAGS:-} " != *" -mod="* ]]; then
  MODFLAG=(-mod=readonly)
fi

cd "$MOD_DIR"
if [ "${MODFLAG[*]}" != "-mod=vendor" ]; then
  log "downloading modules (k8s.io/kubernetes $K8S_VERSION; module cache $(go env GOMODCACHE))"
  "${NICE[@]}" go mod download ||
    die "go mod download failed (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
fi

LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$K8S_MAJOR -X $pkg.gitMinor=$K8S_MINOR"
  LDFLAGS+=" -X $pkg.gitTreeState=clean"
done

log "building kvgate-cluster = ${COMMANDS[*]} ($K8S_VERSION, CGO_ENABLED=0; a cold build takes a while)"
CGO_ENABLED=0 "${NICE[@]}" go build "${MODFLAG[@]}" -buildvcs=false -trimpath \
  -ldflags "$LDFLAGS" -o "$TMP/bin/kvgate-cluster" . ||
  die "go build failed"

for c in "${COMMANDS[@]}"; do ln -s kvgate-cluster "$TMP/bin/$c"; done

# Envoy Gateway: its own module (its client-go and controller-runtime differ from the control
# plane's), built with the `tool` directive of tools/gateway/go.mod.
cd "$GW_DIR"
if [ "${MODFLAG[*]}" != "-mod=vendor" ]; then
  log "downloading modules (github.com/envoyproxy/gateway $EG_VERSION)"
  "${NICE[@]}" go mod download || die "go mod download failed in $GW_DIR"
fi
log "building envoy-gateway ($EG_VERSION, CGO_ENABLED=0)"
CGO_ENABLED=0 "${NICE[@]}" go build "${MODFLAG[@]}" -buildvcs=false -trimpath \
  -ldflags "-s -w -X github.com/envoyproxy/gateway/internal/cmd/version.envoyGatewayVersion=$EG_VERSION" \
  -o "$TMP/bin/envoy-gateway" github.com/envoyproxy/gateway/cmd/envoy-gateway ||
  die "go build of envoy-gateway failed"
got="$("$TMP/bin/envoy-gateway" version | awk '/^ENVOY_GATEWAY_VERSION:/ {print $2}')" ||
  die "envoy-gateway version failed"
[ "$got" = "$EG_VERSION" ] || die "envoy-gateway version printed '$got', expected '$EG_VERSION'"
# Envoy Gateway's own CRDs (EnvoyProxy, policies, ...), from its module: the chart's templates
# minus their one `{{ if }}` guard line each.
EG_SRC="$(go list -m -f '{{.Dir}}' github.com/envoyproxy/gateway)" || die "cannot find the Envoy Gateway module"
for f in "$EG_SRC"/charts/gateway-crds-helm/templates/generated/*.yaml; do
  grep -v '^{{' "$f"
done >"$TMP/gateway-crds.yaml"
grep -q '^kind: CustomResourceDefinition' "$TMP/gateway-crds.yaml" || die "no CRDs found in $EG_SRC"

# echo-basic, the backend the conformance suites deploy (scripts/gie_conformance.sh): small.
cd "$CONF_DIR"
if [ "${MODFLAG[*]}" != "-mod=vendor" ]; then
  "${NICE[@]}" go mod download || die "go mod download failed in $CONF_DIR"
fi
log "building echo-basic ($(awk '$1 == "sigs.k8s.io/gateway-api/conformance" {print $2; exit}' go.mod))"
CGO_ENABLED=0 "${NICE[@]}" go build "${MODFLAG[@]}" -buildvcs=false -trimpath -ldflags "-s -w" \
  -o "$TMP/bin/echo-basic" sigs.k8s.io/gateway-api/conformance/echo-basic ||
  die "go build of echo-basic failed"

log "checking versions"
got="$("$TMP/bin/kube-apiserver" --version)" || die "kube-apiserver --version failed"
[ "$got" = "Kubernetes $K8S_VERSION" ] ||
  die "kube-apiserver --version printed '$got', expected 'Kubernetes $K8S_VERSION'"
etcd_version="$("$TMP/bin/etcd" --version | awk '/^etcd Version:/ {print $3}')" ||
  die "etcd --version failed"
[ -n "$etcd_version" ] || die "etcd --version printed no version"

{
  echo "key=$HASH"
  echo "kubernetes=$K8S_VERSION"
  echo "etcd=$etcd_version"
  echo "envoy-gateway=$EG_VERSION"
  echo "go=$GO_VERSION"
} >"$TMP/BUILDINFO"

# Atomic publish: rename the finished tree into place. If a concurrent build
# got there first, keep theirs.
if ! mv -T "$TMP" "$OUT" 2>/dev/null; then
  complete "$OUT" || die "could not move $TMP to $OUT"
fi
trap - EXIT
rm -rf "$TMP"

log "done: kubernetes $K8S_VERSION, etcd $etcd_version, envoy-gateway $EG_VERSION"
echo "$OUT/bin"
