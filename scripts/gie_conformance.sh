#!/usr/bin/env bash
# Run the Gateway API Inference Extension's own conformance suite (its Go `conformance/`
# package) against `make cluster`: Envoy Gateway with kvgate's InferencePool extension as the
# gateway under test, GatewayClass `kvgate`, and kvgate's EPP (its `conformance` profile) in the
# place of the suite's lightweight EPP image; the suite's echo-basic backends are built from Go
# modules (tools/conformance) and run as processes on the node.
#
#   make cluster                                   # in another terminal
#   scripts/gie_conformance.sh GIE_SRC [-- FLAG...]
#
# GIE_SRC: a checkout of github.com/kubernetes-sigs/gateway-api-inference-extension at the tag
# kvgate's CRDs name (api/k8s/crds.py GIE_BUNDLE_VERSION, e.g. v1.6.0). The suite is its own Go
# module there, which the Go module proxy does not serve, so it is not vendored here: clone it
# (git clone --branch v1.6.0 https://github.com/kubernetes-sigs/gateway-api-inference-extension).
# Extra flags go to the suite (e.g. -- --run-test=GatewayFollowingEPPRouting).
# Writes the suite's report to ${KVGATE_CLUSTER_DIR:-.cluster}/gie-conformance-report.yaml and its
# log beside it; exit status is the suite's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${KVGATE_CLUSTER_DIR:-$ROOT/.cluster}"
SRC="${1:-}"
[ -n "$SRC" ] && [ -f "$SRC/conformance/go.mod" ] ||
  { echo "usage: $0 GIE_SRC [-- FLAG...]  (GIE_SRC: a gateway-api-inference-extension checkout)" >&2; exit 2; }
shift
[ "${1:-}" = "--" ] && shift
[ -s "$DIR/kubeconfig" ] || { echo "no $DIR/kubeconfig: start make cluster first" >&2; exit 2; }

WANT="$(sed -n 's/^GIE_BUNDLE_VERSION = "\(.*\)"/\1/p' "$ROOT/api/k8s/crds.py")"
HAVE="$(git -C "$SRC" describe --tags --exact-match 2>/dev/null || echo unknown)"
[ "$HAVE" = "$WANT" ] || echo "warning: GIE_SRC is at $HAVE, kvgate's CRDs are $WANT's" >&2

SUITE="$DIR/gie-conformance.test"
echo "gie-conformance: building the suite from $SRC/conformance ($HAVE)" >&2
(cd "$SRC/conformance" && nice -n 10 go test -c -o "$SUITE" .)

REPORT="$DIR/gie-conformance-report.yaml"
echo "gie-conformance: running (report: $REPORT, log: $DIR/gie-conformance.log)" >&2
cd "$SRC/conformance"
set +e
KUBECONFIG="$DIR/kubeconfig" "$SUITE" -test.v -test.timeout 60m \
  --gateway-class=kvgate --allow-crds-mismatch \
  --report-output="$REPORT" --organization=kvgate --project=kvgate \
  --url=https://kvgate.dev --version="$(git -C "$ROOT" rev-parse --short HEAD)" --contact=kvgate \
  "$@" 2>&1 | tee "$DIR/gie-conformance.log"
status=${PIPESTATUS[0]}
set -e
echo "gie-conformance: results" >&2
grep -E '^\s*--- (PASS|FAIL|SKIP)' "$DIR/gie-conformance.log" >&2 || true
exit "$status"
