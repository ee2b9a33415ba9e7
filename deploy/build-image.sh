#!/usr/bin/env bash
# `make image`: build the image with whichever engine is here, docker (when its daemon answers) or
# podman (with --format docker, which keeps the HEALTHCHECK), reusing the engine's layer cache.
#
# Environment (all optional):
#   IMAGE        the tag (default llm-gateway:$VARIANT)
#   VARIANT      cpu (default) or cuda
#   ENGINE       docker or podman (default: the first that works)
#   BASE_IMAGE   the Python 3.11 base (default python:3.11-slim; where that is not pulled and
#                localhost/llmgw-base:3.11, made by deploy/ci/setup.sh, is there: that one)
#   TORCH_INDEX  the index torch comes from (default: the variant's PyTorch index; for the CPU variant,
#                where $TORCH_WHEELS holds torch's CPU wheel: a local index serving it, started here)
#   TORCH_WHEELS a folder with torch's CPU wheel (default /var/cache/llmgw-ci/wheels, from deploy/ci/setup.sh)
#   KERNEL_ISAS  the ISA levels the CPU kernels are prebuilt for (default: the Dockerfile's)
#   BUILD_FLAGS  more flags for the engine's build command
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT=${VARIANT:-cpu}
IMAGE=${IMAGE:-llm-gateway:$VARIANT}
LOCAL_BASE=localhost/llmgw-base:3.11
TORCH_WHEELS=${TORCH_WHEELS:-/var/cache/llmgw-ci/wheels}
INDEX_PORT=${TORCH_INDEX_PORT:-18631}  # fixed, so that the build argument (and the layer cache) stays the same

if [ -z "${ENGINE:-}" ]; then
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        ENGINE=docker
    elif command -v podman >/dev/null; then
        ENGINE=podman
    else
        echo "build-image: no container engine (a docker daemon, or podman); deploy/ci/setup.sh installs podman" >&2
        exit 1
    fi
fi

args=(build -t "$IMAGE" --build-arg "VARIANT=$VARIANT")
[ "$ENGINE" = podman ] && args+=(--format docker --layers)

if [ -z "${BASE_IMAGE:-}" ]; then
    BASE_IMAGE=python:3.11-slim
    if ! "$ENGINE" image inspect "$BASE_IMAGE" >/dev/null 2>&1 \
            && "$ENGINE" image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
        BASE_IMAGE=$LOCAL_BASE
    fi
fi
args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")

index_pid= log=
cleanup() {
    if [ -n "$index_pid" ]; then kill "$index_pid" 2>/dev/null || true; wait "$index_pid" 2>/dev/null || true; fi
    if [ -n "$log" ]; then rm -f "$log"; fi
}
trap cleanup EXIT

if [ -z "${TORCH_INDEX:-}" ] && [ "$VARIANT" = cpu ] && compgen -G "$TORCH_WHEELS/torch-*+cpu-*.whl" >/dev/null; then
    # the PyPI index pip already uses here, for everything but torch
    upstream=${PIP_INDEX_URL:-$(python3 -m pip config get global.index-url 2>/dev/null || true)}
    upstream=${upstream:-https://pypi.org/simple}
    log=$(mktemp /tmp/llmgw-torch-index.XXXXXX.log)
    python3 deploy/ci/torch_index.py --wheels "$TORCH_WHEELS" --port "$INDEX_PORT" --upstream "$upstream" \
        >"$log" 2>&1 &
    index_pid=$!
    for _ in $(seq 1 100); do
        grep -q '^serving ' "$log" && break
        kill -0 "$index_pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
        sleep 0.2
    done
    grep -q '^serving ' "$log" || { cat "$log" >&2; exit 1; }
    echo "build-image: $(head -1 "$log")"
    TORCH_INDEX=http://127.0.0.1:$INDEX_PORT/simple
    args+=(--network host)  # the build's pip reaches the index on the host's loopback
fi
[ -n "${TORCH_INDEX:-}" ] && args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
[ -n "${KERNEL_ISAS:-}" ] && args+=(--build-arg "KERNEL_ISAS=$KERNEL_ISAS")
# shellcheck disable=SC2206
[ -n "${BUILD_FLAGS:-}" ] && args+=($BUILD_FLAGS)

echo "build-image: $ENGINE ${args[*]} ."
previous=$("$ENGINE" image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
started=$SECONDS
"$ENGINE" "${args[@]}" .
# the image this tag named before, if it changed: its layers are no one's cache (the build stage's are kept)
if [ -n "$previous" ] && [ "$previous" != "$("$ENGINE" image inspect --format '{{.Id}}' "$IMAGE")" ]; then
    "$ENGINE" rmi "$previous" >/dev/null 2>&1 || true
fi
echo "build-image: built $IMAGE with $ENGINE in $((SECONDS - started)) s" \
     "($("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}'))"
