#!/usr/bin/env bash
# Local stand-ins of the base images the deployables build on, and the deployables' images
# built on them, for `make sam-local` where public image registries cannot be reached:
#
#   spillway-local/debian:bookworm     Debian bookworm (debootstrap, minbase)
#   spillway-local/lambda-python:3.12  AWS's Lambda python3.12 base, rebuilt on Debian
#   spillway-local/ubuntu:24.04        Ubuntu 24.04 (debootstrap), the OS of the CUDA base
#   spillway-local/cpu-infer:latest    functions/cpu_infer/Dockerfile on the Lambda stand-in
#   spillway-local/gpu-service:cpu     gpu_service/Dockerfile on Ubuntu, CPU onnxruntime
#
# Idempotent: a base image carries a label with the hash of its inputs and is rebuilt only
# when they change; the two application images rely on Docker's layer cache. Needs root
# (debootstrap), a running Docker daemon, CPython 3.12 (pyenv) and the SAM CLI environment
# (its package bundles the runtime interface emulator).
set -euo pipefail
cd "$(dirname "$0")/../.."

HERE=infra/local-images
OUT=${SAM_LOCAL_OUT:-build/sam-local}/images
SAM_VENV=${SAM_VENV:-.venv-sam}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
UBUNTU_MIRROR=${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
HOST_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
# Ubuntu Archive Automatic Signing Key (2018): the trust anchor of the Ubuntu download.
UBUNTU_KEY_FPR=F6ECB3762474EDA9D21B7022871920D1991BC93C
UBUNTU_KEYRING_DEB=pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb
# Shared libraries of CPython's extension modules (ssl, sqlite3, ctypes, bz2, lzma, ...).
DEBIAN_PACKAGES=ca-certificates,libssl3,libsqlite3-0,libffi8,libbz2-1.0,liblzma5,zlib1g,libexpat1,libuuid1,libncursesw6,libreadline8,libgdbm6,libcrypt1

export DOCKER_BUILDKIT=0 # the classic builder: no frontend image to pull
mkdir -p "$OUT"
step() { printf '\n== %s\n' "$*"; }
elapsed() { echo $((SECONDS - STARTED)); }  # seconds since the script started
STARTED=$SECONDS
fail() { echo "infra/local-images/build.sh: $*" >&2; exit 1; }

# Run two steps side by side (each logs to OUT/NAME.out); wait for both, fail if either did.
in_parallel() {
    local first=$1 second=$2 rc1=0 rc2=0 pid1 pid2
    $first > "$OUT/$first.out" 2>&1 & pid1=$!
    $second > "$OUT/$second.out" 2>&1 & pid2=$!
    wait $pid1 || rc1=$?
    wait $pid2 || rc2=$?
    cat "$OUT/$first.out" "$OUT/$second.out"
    (( rc1 == 0 && rc2 == 0 )) || exit 1
}

docker info > /dev/null 2>&1 || fail "no Docker daemon answers (start dockerd as root)"
[[ $(id -u) == 0 ]] || fail "debootstrap needs root"

python312() {
    local root
    root=$(pyenv root 2> /dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
    compgen -G "$root/versions/3.12.*/bin/python3.12" > /dev/null \
        || fail "no CPython 3.12 under $root/versions (\`pyenv versions\`; \`pyenv install 3.12\`)"
    printf '%s\n' "$root"/versions/3.12.*/bin/python3.12 | sort -V | tail -n 1
}

rie() {
    local path
    path=$(compgen -G "$SAM_VENV/lib/python3*/site-packages/samcli/local/rapid/aws-lambda-rie-x86_64" \
        | head -n 1) || true
    [[ -n $path ]] || fail "no aws-lambda-rie-x86_64 in $SAM_VENV (make check-infra installs the SAM CLI)"
    echo "$path"
}

label() { docker image inspect -f '{{index .Config.Labels "spillway.inputs"}}' "$1" 2> /dev/null || true; }
digest() { sha256sum | cut -c1-32; }
# The code that makes a base image (its function and the import): a change to it is a
# change of the image's inputs.
recipe() { declare -f "$1" import_rootfs; }

# debootstrap into a fresh folder, trust the host's CA bundle (so pip in derived images
# works behind the same TLS-inspecting proxy as this machine) and import it.
import_rootfs() {
    local tag=$1 inputs=$2 rootfs=$3
    shift 3
    rm -rf "$rootfs"
    debootstrap --variant=minbase "$@" > "$rootfs.log" 2>&1 \
        || { tail -n 20 "$rootfs.log" >&2; fail "debootstrap $tag failed (log: $rootfs.log)"; }
    # The package lists stay: an `apt-get update` in a derived image then fetches only what
    # changed since (the release file), not every index again.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb
    # Also where update-ca-certificates collects local CAs: an image that installs the
    # ca-certificates package regenerates the bundle and keeps them.
    install -D -m 0644 "$HOST_CA_BUNDLE" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    install -D -m 0644 "$HOST_CA_BUNDLE" "$rootfs/usr/local/share/ca-certificates/host-ca-bundle.crt"
    tar -C "$rootfs" -c . | docker import \
        --change "LABEL spillway.inputs=$inputs" \
        --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
        --change 'CMD ["/bin/bash"]' - "$tag" > /dev/null
    rm -rf "$rootfs"
    echo "$tag: imported ($(elapsed) s)"
}

debian_base() {
    local tag=spillway-local/debian:bookworm inputs
    inputs=$({ echo "$DEBIAN_MIRROR $DEBIAN_PACKAGES"; recipe debian_base; cat "$HOST_CA_BUNDLE"; } | digest)
    if [[ $(label $tag) == "$inputs" ]]; then echo "$tag: up to date"; return; fi
    import_rootfs $tag "$inputs" "$OUT/rootfs-bookworm" \
        --include="$DEBIAN_PACKAGES" bookworm "$OUT/rootfs-bookworm" "$DEBIAN_MIRROR"
}

ubuntu_base() {
    local tag=spillway-local/ubuntu:24.04 inputs keys=$OUT/ubuntu-keyring
    inputs=$({ echo "$UBUNTU_MIRROR"; recipe ubuntu_base; cat "$HOST_CA_BUNDLE"; } | digest)
    if [[ $(label $tag) == "$inputs" ]]; then echo "$tag: up to date"; return; fi
    rm -rf "$keys" && mkdir -p "$keys/gnupg" && chmod 700 "$keys/gnupg"
    curl -fsS -o "$keys/keyring.deb" "$UBUNTU_MIRROR/$UBUNTU_KEYRING_DEB"
    dpkg-deb -x "$keys/keyring.deb" "$keys/deb"
    local keyring=$keys/deb/etc/apt/trusted.gpg.d/ubuntu-keyring-2018-archive.gpg
    gpg --homedir "$keys/gnupg" --show-keys --with-colons "$keyring" 2> /dev/null \
        | grep -qx "fpr:::::::::$UBUNTU_KEY_FPR:" || fail "the Ubuntu keyring is not key $UBUNTU_KEY_FPR"
    # debootstrap ships no script for noble; Ubuntu's releases share gutsy's.
    import_rootfs $tag "$inputs" "$OUT/rootfs-noble" --keyring="$keyring" \
        --components=main,universe noble "$OUT/rootfs-noble" "$UBUNTU_MIRROR" \
        /usr/share/debootstrap/scripts/gutsy
    rm -rf "$keys"
}

# CPython 3.12 as /var/lang (without its tests, IDLE and Tk; pip as the only package),
# awslambdaric under /var/runtime, the emulator and the entry scripts.
lambda_python() {
    local tag=spillway-local/lambda-python:3.12 python prefix emulator inputs ctx=$OUT/lambda-python
    python=$(python312)
    prefix=$(dirname "$(dirname "$python")")
    emulator=$(rie)
    inputs=$({
        "$python" -VV
        declare -f lambda_python
        docker image inspect -f '{{.Id}}' spillway-local/debian:bookworm
        sha256sum "$emulator" | cut -c1-64
        cat "$HERE/lambda-python.Dockerfile" "$HERE/requirements.txt" "$HERE/bootstrap" \
            "$HERE/lambda-entrypoint.sh"
    } | digest)
    if [[ $(label $tag) == "$inputs" ]]; then echo "$tag: up to date"; return; fi
    rm -rf "$ctx" && mkdir -p "$ctx/lang/lib/python3.12/site-packages" "$ctx/runtime"
    tar -C "$prefix" -cf - \
        --exclude=lib/python3.12/test --exclude=lib/python3.12/idlelib \
        --exclude=lib/python3.12/tkinter --exclude=lib/python3.12/turtledemo \
        --exclude='lib/python3.12/config-3.12-*' --exclude='lib/python3.12/lib-dynload/_tkinter*' \
        --exclude=lib/python3.12/site-packages \
        bin/python3.12 lib/python3.12 lib/libpython3.12.so.1.0 lib/libpython3.12.so lib/libpython3.so \
        | tar -C "$ctx/lang" -xf -
    (cd "$prefix/lib/python3.12/site-packages" && tar -cf - pip pip-*.dist-info) \
        | tar -C "$ctx/lang/lib/python3.12/site-packages" -xf -
    ln -s python3.12 "$ctx/lang/bin/python3"
    ln -s python3.12 "$ctx/lang/bin/python"
    for name in pip pip3 pip3.12; do
        printf '#!/bin/sh\nexec /var/lang/bin/python3.12 -m pip "$@"\n' > "$ctx/lang/bin/$name"
        chmod 0755 "$ctx/lang/bin/$name"
    done
    "$python" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts \
        --only-binary=:all: --platform manylinux2014_x86_64 --implementation cp \
        --python-version 3.12 --target "$ctx/runtime" -r "$HERE/requirements.txt" \
        > "$OUT/awslambdaric.log" 2>&1 \
        || { cat "$OUT/awslambdaric.log" >&2; fail "pip could not fetch awslambdaric"; }
    install -m 0755 "$emulator" "$ctx/aws-lambda-rie"
    install -m 0755 "$HERE/bootstrap" "$ctx/runtime/bootstrap"
    install -m 0755 "$HERE/lambda-entrypoint.sh" "$ctx/lambda-entrypoint.sh"
    docker build --label "spillway.inputs=$inputs" -t $tag -f "$HERE/lambda-python.Dockerfile" \
        "$ctx" > "$OUT/lambda-python.log" 2>&1 \
        || { tail -n 30 "$OUT/lambda-python.log" >&2; fail "docker build $tag failed"; }
    rm -rf "$ctx"
    echo "$tag: built ($(elapsed) s)"
}

# The deployables' Dockerfiles as they are, with the base and onnxruntime build arguments.
app_image() {
    local tag=$1 log=$OUT/$2.log
    shift 2
    docker build --platform linux/amd64 -t "$tag" "$@" . > "$log" 2>&1 \
        || { tail -n 30 "$log" >&2; fail "docker build $tag failed (log: $log)"; }
    echo "$tag: built, $(docker image inspect -f '{{.Id}}' "$tag" | cut -c8-19) ($(elapsed) s)"
}

cpu_image() {
    app_image spillway-local/cpu-infer:latest cpu-infer -f functions/cpu_infer/Dockerfile \
        --build-arg LAMBDA_BASE_IMAGE=spillway-local/lambda-python:3.12
}

gpu_image() {
    app_image spillway-local/gpu-service:cpu gpu-service -f gpu_service/Dockerfile \
        --build-arg CUDA_BASE_IMAGE=spillway-local/ubuntu:24.04 --build-arg ONNXRUNTIME=onnxruntime
}

# The GPU image needs only the Ubuntu base: it builds while the Lambda images do.
lambda_images() { debian_base && lambda_python && cpu_image; }
gpu_images() { ubuntu_base && gpu_image; }

step "images (the Lambda and the GPU chains side by side)"
in_parallel lambda_images gpu_images
