#!/usr/bin/env bash
# `make images`: builds docker/{engine,epp,operator}.Dockerfile into OCI archives under
# dist/images/ (git-ignored), without a Docker engine or a registry: Debian's buildah builds
# them (chroot isolation, no daemon), FROM a Debian bookworm base made by debootstrap and
# cached outside the repo (so a second run is fast), and writes each image to an oci-archive.
#
#   scripts/images.sh [engine] [epp] [operator]   build these (default: all three)
#   scripts/images.sh --list                      print "name reference archive", build nothing
#   FLAVOR=auto|cpu|cuda  the engine's torch: cpu (the CPU torch wheel on local disk,
#                     TORCH_WHEEL or pip's find-links) or cuda (PyPI's torch, a CUDA build that
#                     also runs on a CPU; the chart's default engine image); auto (the default):
#                     cpu where that wheel is found, else cuda
#
# Tools (buildah, skopeo, debootstrap) come from Debian's packages, installed like
# scripts/setup.sh installs Prometheus. Every step prints a progress line; a failure names the
# image and the Dockerfile step, with the end of its log.
set -euo pipefail
cd "$(dirname "$0")/.."

FLAVOR=${FLAVOR:-auto}
REGISTRY=${IMAGE_REGISTRY:-ghcr.io/kvgate}
OUT=${IMAGES_DIR:-dist/images}
CACHE=${KVGATE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate-images}
SUITE=bookworm  # Debian 12: python3 is 3.11, the CPython the local torch wheel is built for
BASE_REF=localhost/kvgate-base:$SUITE
TORCH_VERSION=2.13.0
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
# buildah without a container engine or daemon: RUN steps in a chroot, on the host's network.
export BUILDAH_ISOLATION=chroot

say() { printf '\033[1mimages:\033[0m %s\n' "$*"; }
die() {
    printf '\033[1mimages: error:\033[0m %s\n' "$*" >&2
    exit 1
}

TORCH_CPU_WHEEL="torch-$TORCH_VERSION+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
# The CPU torch wheel on this machine, if any: TORCH_WHEEL, else pip's find-links, else /opt/wheels.
find_cpu_torch() {
    if [[ -n ${TORCH_WHEEL:-} ]]; then
        [[ -f $TORCH_WHEEL ]] && echo "$TORCH_WHEEL"
        return 0
    fi
    local dir
    for dir in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true) /opt/wheels; do
        [[ -f $dir/$TORCH_CPU_WHEEL ]] && echo "$dir/$TORCH_CPU_WHEEL" && return 0
    done
    return 0
}

case "$FLAVOR" in
cpu | cuda) ;;
auto) if [[ -n $(find_cpu_torch) ]]; then FLAVOR=cpu; else FLAVOR=cuda; fi ;;
*) die "FLAVOR=$FLAVOR: the engine flavours are auto, cpu and cuda" ;;
esac

# The one place image names are made; tests/test_images_chart.py reads them via --list.
ref_of() {
    case "$1" in
    engine) if [[ $FLAVOR == cuda ]]; then echo "$REGISTRY/engine:$VERSION"; else echo "$REGISTRY/engine:$VERSION-cpu"; fi ;;
    *) echo "$REGISTRY/$1:$VERSION" ;;
    esac
}
archive_of() {
    case "$1" in
    engine) echo "$OUT/kvgate-engine-$FLAVOR.oci.tar" ;;
    *) echo "$OUT/kvgate-$1.oci.tar" ;;
    esac
}

images=()
for arg in "$@"; do
    case "$arg" in
    --list)
        for name in engine epp operator; do echo "$name $(ref_of "$name") $(archive_of "$name")"; done
        exit 0
        ;;
    engine | epp | operator) images+=("$arg") ;;
    -h | --help)
        sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *) die "unknown argument '$arg' (images: engine, epp, operator; or --list)" ;;
    esac
done
((${#images[@]})) || images=(engine epp operator)

ensure_tools() {
    local missing=()
    for tool in buildah skopeo debootstrap; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    ((${#missing[@]})) || return 0
    if ! command -v apt-get >/dev/null 2>&1 || [[ $(id -u) -ne 0 ]]; then
        die "tools: ${missing[*]} not installed; install Debian's packages '${missing[*]}' (as root: apt-get install ${missing[*]})"
    fi
    say "tools: installing ${missing[*]} (apt)"
    { apt-get install -y -qq --no-install-recommends "${missing[@]}" ||
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; }; } \
        >"$OUT/logs/tools.log" 2>&1 ||
        die "tools: apt-get could not install ${missing[*]} (no network to Debian's package archive?); see $OUT/logs/tools.log"
}

# The base every Dockerfile is built FROM here (BASE_IMAGE): debootstrap's minbase of Debian
# bookworm with python3 and its venv module, the same distribution as the Dockerfiles' public
# default (debian:bookworm-slim), so the RUN steps that install python3 find it already there.
ensure_base() {
    local rootfs=$CACHE/$SUITE/rootfs tarball=$CACHE/$SUITE/rootfs.tar
    if buildah inspect --type image "$BASE_REF" >/dev/null 2>&1; then
        say "base: $BASE_REF (cached in buildah's storage)"
        return
    fi
    if [[ ! -f $tarball ]]; then
        mkdir -p "$CACHE/$SUITE"
        rm -rf "$rootfs.partial"
        say "base: debootstrap --variant=minbase $SUITE into $CACHE/$SUITE (once; about a minute)"
        if ! nice -n 10 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            "$SUITE" "$rootfs.partial" >"$OUT/logs/base.log" 2>&1; then
            tail -n 5 "$OUT/logs/base.log" >&2
            die "base: debootstrap of Debian $SUITE failed (no network to Debian's package archive?); see $OUT/logs/base.log"
        fi
        # What a container image does not carry: downloaded .debs, package lists, device nodes.
        rm -rf "$rootfs.partial"/var/cache/apt/archives/*.deb "$rootfs.partial"/var/lib/apt/lists/*
        tar -C "$rootfs.partial" --numeric-owner --exclude='./dev/*' --exclude='./proc/*' \
            --exclude='./sys/*' -cf "$tarball.partial" .
        mv "$tarball.partial" "$tarball"
        rm -rf "$rootfs.partial"
    fi
    say "base: importing $tarball as $BASE_REF"
    local ctr
    ctr=$(buildah from --quiet scratch)
    buildah add --quiet "$ctr" "$tarball" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd /bin/bash "$ctr"
    buildah commit --quiet --rm "$ctr" "$BASE_REF" >/dev/null
}

# The cpu engine installs torch from a wheel in docker/wheels/ (git-ignored): PyPI's Linux
# x86_64 torch wheels are CUDA builds, and no other index is reachable from here.
stage_cpu_torch() {
    local name=$TORCH_CPU_WHEEL wheel
    wheel=$(find_cpu_torch)
    [[ -n $wheel ]] ||
        die "engine (cpu): no CPU torch wheel ($name) found; set TORCH_WHEEL=/path/to/it, or build FLAVOR=cuda (PyPI's torch)"
    mkdir -p docker/wheels
    if ! cmp -s "$wheel" "docker/wheels/$name"; then
        ln -f "$wheel" "docker/wheels/$name" 2>/dev/null || cp "$wheel" "docker/wheels/$name"
    fi
}

# The ID an image reference names in buildah's storage, or nothing.
image_id() { buildah images --quiet --noheading "$1" 2>/dev/null | head -n 1 || true; }

# Runs buildah bud, printing each Dockerfile step as it starts; on failure names the step.
build_image() {
    local name=$1 ref archive log started step="" rc
    ref=$(ref_of "$name")
    archive=$(archive_of "$name")
    log=$OUT/logs/$name.log
    local args=(--layers --pull=never --network host --build-arg "BASE_IMAGE=$BASE_REF"
        -f "docker/$name.Dockerfile" --ignorefile "docker/$name.Dockerfile.dockerignore")
    if [[ $name == engine ]]; then
        args+=(--build-arg "FLAVOR=$FLAVOR" --build-arg "TORCH_VERSION=$TORCH_VERSION")
        [[ $FLAVOR == cpu ]] && stage_cpu_torch
    fi
    # A host whose TLS to the registries goes through its own CA (pip's PIP_CERT here) lends
    # that bundle to the pip steps as the optional build secret pip_ca: mounted while they run,
    # never written into a layer.
    if [[ -n ${PIP_CERT:-} && -f $PIP_CERT ]]; then
        args+=(--secret "id=pip_ca,src=$(realpath "$PIP_CERT")")
    fi
    # The build stage is tagged too, so its step caches (the engine's: torch, several GB) outlive
    # the removal of what this build replaces, below.
    local stage_tag=latest
    [[ $name == engine ]] && stage_tag=$FLAVOR
    local stage_ref="localhost/kvgate-$name-build:$stage_tag" replaced
    replaced="$(image_id "$ref") $(image_id "$stage_ref")"
    started=$(date +%s)
    say "$name: building $ref from docker/$name.Dockerfile (log: $log)"
    set +e
    nice -n 10 buildah bud "${args[@]}" -t "$ref" . 2>&1 | while IFS= read -r line; do
        printf '%s\n' "$line" >>"$log"
        if [[ $line =~ ^(\[[0-9]+/[0-9]+\]\ )?STEP\ [0-9]+/[0-9]+: ]]; then
            say "$name: ${line:0:120}"
            printf '%s\n' "$line" >"$log.step"
        fi
    done
    rc=${PIPESTATUS[0]}
    set -e
    if ((rc != 0)); then
        step=$(cat "$log.step" 2>/dev/null || echo "before the first step")
        tail -n 15 "$log" >&2
        local hint=""
        if grep -qiE "Temporary failure (in name )?resolution|Could not resolve|Failed to establish a new connection|Network is unreachable|Failed to fetch|No matching distribution found" "$log"; then
            hint=" (no network to the package registries?)"
        fi
        if grep -q "CERTIFICATE_VERIFY_FAILED" "$log"; then
            hint=" (TLS to the package registry not trusted: set PIP_CERT to the CA bundle your pip uses)"
        fi
        die "$name image: failed at ${step:0:160}$hint; full log: $log"
    fi
    rm -f "$log.step"
    # every step already cached: seconds
    buildah bud "${args[@]}" --target build -t "$stage_ref" . >>"$log" 2>&1 ||
        die "$name image: tagging its build stage failed; see $log"
    # What the tags pointed at before, now untagged: ~11 GB a rebuild of the three if kept.
    local id kept
    kept=" $(image_id "$ref") $(image_id "$stage_ref") "
    for id in $replaced; do
        [[ $kept == *" $id "* ]] || buildah rmi "$id" >/dev/null 2>&1 || true
    done
    say "$name: writing $archive"
    rm -f "$archive.partial"
    buildah push --quiet "$ref" "oci-archive:$archive.partial:$ref" >>"$log" 2>&1 ||
        die "$name image: writing the OCI archive $archive failed; see $log"
    mv "$archive.partial" "$archive"
    say "$name: done in $(($(date +%s) - started)) s, $(du -h "$archive" | cut -f1) ($ref)"
}

mkdir -p "$OUT/logs"
: >"$OUT/logs/.keep"
for name in "${images[@]}"; do : >"$OUT/logs/$name.log"; done
ensure_tools
t0=$(date +%s)
ensure_base
for name in "${images[@]}"; do build_image "$name"; done
say "all built in $(($(date +%s) - t0)) s (FLAVOR=$FLAVOR):"
for name in "${images[@]}"; do
    printf '  %-9s %6s  %s  %s\n' "$name" "$(du -h "$(archive_of "$name")" | cut -f1)" "$(archive_of "$name")" "$(ref_of "$name")"
done
