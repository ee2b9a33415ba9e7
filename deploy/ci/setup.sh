#!/usr/bin/env bash
# What tests/test_image.py needs on a machine of our kind (no Docker daemon, no container registry or
# PyTorch index reachable; the package registries are): podman from apt with the settings this machine
# needs, a local stand-in for python:3.11-slim made with debootstrap, and the CPU torch wheel that pip
# finds here, which deploy/build-image.sh serves to the build from a local index. Then what the state
# store's tests (PostgreSQL, Redis) and the console's (chromium, chromedriver) need.
# See /work/shared/reference/containers.md. Idempotent: each step is skipped when its result is there.
# Run as root. Prints each step's time.
set -euo pipefail

BASE_IMAGE=${LLMGW_CI_BASE_IMAGE:-localhost/llmgw-base:3.11}
WHEELS=${TORCH_WHEELS:-/var/cache/llmgw-ci/wheels}
TORCH_VERSION=2.13.0

step_started=0
step() { step_started=$SECONDS; echo "== setup: $* ..."; }
done_() { echo "== setup: $* ($((SECONDS - step_started)) s)"; }

if [ "$(id -u)" != 0 ]; then
    echo "deploy/ci/setup.sh: not root, nothing set up (apt, debootstrap and podman's root storage need it);" \
         "tests/test_image.py uses a docker daemon or podman where there is one"
    exit 0
fi

# 1. podman, buildah and debootstrap from Debian (4.3.1 / 1.28.2 on bookworm)
step "container engine"
if command -v podman >/dev/null && command -v buildah >/dev/null && command -v debootstrap >/dev/null \
        && command -v runc >/dev/null; then
    done_ "podman $(podman --version | awk '{print $3}') already installed"
else
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        podman buildah debootstrap runc uidmap fuse-overlayfs slirp4netns containernetworking-plugins \
        ca-certificates >/dev/null
    done_ "installed podman $(podman --version | awk '{print $3}')"
fi

# 2. the settings this machine needs: no CAP_SYS_RESOURCE (podman's default nofile 1048576 fails),
#    cgroups in hybrid mode (crun refuses: runc), no systemd (cgroupfs, events to a file)
step "containers.conf"
nofile=$(ulimit -Hn)
[ "$nofile" = unlimited ] && nofile=1048576
conf=$(cat <<CONF
# written by deploy/ci/setup.sh (llm-gateway CI)
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
)
mkdir -p /etc/containers
if [ -f /etc/containers/containers.conf ] && [ "$(cat /etc/containers/containers.conf)" = "$conf" ]; then
    done_ "unchanged"
else
    if [ -f /etc/containers/containers.conf ] && ! grep -q 'deploy/ci/setup.sh' /etc/containers/containers.conf; then
        cp /etc/containers/containers.conf "/etc/containers/containers.conf.before-llmgw-ci"
    fi
    printf '%s\n' "$conf" >/etc/containers/containers.conf
    done_ "written"
fi

# 3. the stand-in base image, from the Debian mirror apt already uses (Debian's python3 is 3.11.2);
#    kept in podman's storage between runs
step "base image $BASE_IMAGE"
if podman image exists "$BASE_IMAGE"; then
    done_ "already in podman's storage"
else
    mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$mirror" ] || mirror=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    work=$(mktemp -d /var/tmp/llmgw-base.XXXXXX)
    trap 'rm -rf "$work"' EXIT
    rootfs=$work/rootfs
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python3-dev,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || { tail -30 "$work/debootstrap.log"; exit 1; }
    # pip inside a build must trust the roots the host trusts (an egress proxy's CA, if any)
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
    chroot "$rootfs" update-ca-certificates >/dev/null
    ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
    ln -sf /usr/bin/pip3 "$rootfs/usr/local/bin/pip"
    rm -f "$rootfs"/usr/lib/python3.*/EXTERNALLY-MANAGED  # as in the official image: pip installs anywhere
    chroot "$rootfs" apt-get clean
    rm -rf "$rootfs"/var/lib/apt/lists/*
    tar --numeric-owner -C "$rootfs" -c . | podman import \
        --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$work"
    trap - EXIT
    podman run --rm --network none "$BASE_IMAGE" python -c 'import sys; print("base:", sys.version)'
    done_ "made with debootstrap from $mirror"
fi

# 4. the CPU torch wheel pip resolves here (from this machine's disk), for the local index
step "torch $TORCH_VERSION CPU wheel in $WHEELS"
if compgen -G "$WHEELS/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null; then
    done_ "already there"
else
    mkdir -p "$WHEELS"
    python3 -m pip download -q --no-deps "torch==$TORCH_VERSION" -d "$WHEELS"
    compgen -G "$WHEELS/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null || {
        echo "pip did not find torch $TORCH_VERSION's CPU build here (got: $(ls "$WHEELS"))" >&2; exit 1; }
    done_ "downloaded"
fi

# 5. bounded storage: the layer cache grows with every change; past the limit, everything but tagged
#    images goes (the next build is a cold one; the base image stays)
step "podman storage"
limit_gb=${LLMGW_CI_STORAGE_LIMIT_GB:-30}
used_kb=$(du -sk /var/lib/containers/storage 2>/dev/null | cut -f1 || true)
used_gb=$(( ${used_kb:-0} / 1048576 ))
if [ "$used_gb" -ge "$limit_gb" ]; then
    podman system prune -f >/dev/null
    done_ "pruned: ${used_gb} GB used, over the ${limit_gb} GB limit"
else
    done_ "${used_gb} GB used (limit ${limit_gb} GB)"
fi

# 6. PostgreSQL and redis-server for the state store's tests (tests/services.py starts throwaway servers on free
#    ports as needed; nothing is started here). Debian's postgresql puts initdb and pg_ctl off PATH.
step "postgresql and redis-server"
pg_bin() { command -v initdb >/dev/null && command -v pg_ctl >/dev/null && { dirname "$(command -v initdb)"; return; }
           for d in /usr/lib/postgresql/*/bin; do [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && { echo "$d"; return; }; done
           return 1; }
if pg_bin >/dev/null && command -v redis-server >/dev/null; then
    done_ "already installed ($(pg_bin), $(redis-server --version | awk '{print $3}'))"
else
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql redis-server >/dev/null
    # the packages' own services are not needed: stop whatever the install started
    { service postgresql stop; service redis-server stop; } >/dev/null 2>&1 || true
    done_ "installed ($(pg_bin), $(redis-server --version | awk '{print $3}'))"
fi

# 7. chromium and its chromedriver for tests/test_console.py, which drives the admin console through Selenium with
#    these two (Selenium Manager is kept offline: nothing is downloaded at test time)
step "chromium and chromedriver"
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    done_ "already installed ($(chromium --version 2>/dev/null | awk '{print $2}'))"
else
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    done_ "installed ($(chromium --version 2>/dev/null | awk '{print $2}'))"
fi

echo "== setup: podman $(podman info --format '{{.Host.OCIRuntime.Name}} {{.Store.GraphDriverName}}'), \
$(du -sh /var/lib/containers 2>/dev/null | cut -f1) in /var/lib/containers"
