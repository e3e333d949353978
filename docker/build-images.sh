#!/usr/bin/env bash
# Build aerie's images with no registry (`make images`):
#   aerie/base:bookworm   Debian bookworm from a debootstrap root filesystem (cached as a tarball)
#   aerie/worker-cpu      aerie + Prefect + prefect-docker + CPU torch, from a local wheelhouse
#   aerie/sglang-cpu:<v>  SGLang's CPU lane (envs/sglang) + aerie's plugin
# Each image carries `aerie.image` and `aerie.input-digest` labels; an image whose digest matches its
# inputs is left as it is, so an unchanged rebuild does nothing.
#   AERIE_CACHE   cache root (default ~/.cache/aerie): rootfs/ tarballs and wheelhouse/
#   IMAGES        which images (default "base worker-cpu sglang-cpu")
#   AERIE_IMAGE_NS  the images' namespace (default aerie)
#   DOCKER_TESTS=0  skip (no engine wanted)
set -euo pipefail

if [ "${DOCKER_TESTS:-1}" = "0" ]; then
  echo "images: DOCKER_TESTS=0, nothing built"
  exit 0
fi

repo="$(cd "$(dirname "$0")/.." && pwd)"
cache="${AERIE_CACHE:-$HOME/.cache/aerie}"
wheelhouse="$cache/wheelhouse"
lock="$repo/docker/worker-cpu.lock"
images="${IMAGES:-base worker-cpu sglang-cpu}"
# The images' namespace: aerie's own, or another for a build that must not touch them (a benchmark).
NS="${AERIE_IMAGE_NS:-aerie}"
BASE="$NS/base:bookworm"
# The legacy builder: Debian's engine has no BuildKit front end here, and it builds with --network host.
export DOCKER_BUILDKIT=0

# The root filesystem's recipe; its hash names the cached tarball, so a changed recipe makes a new one.
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
INCLUDE=python3,python3-venv,ca-certificates,procps
ROOTFS_RECIPE="debootstrap --variant=minbase --include=$INCLUDE $SUITE $MIRROR"

sha() { sha256sum | cut -c1-16; }
label_of() { docker image inspect "$1" --format "{{ index .Config.Labels \"aerie.input-digest\" }}" 2>/dev/null || true; }
# A build's output only when it fails (it is long, and the legacy builder warns on every call).
quietly() {
  local out
  out="$("$@" 2>&1)" || { echo "$out" | grep -v -e '^DEPRECATED' -e 'BuildKit' -e 'environment-variable' >&2; return 1; }
}
seconds_since() { echo "$(( $(date +%s) - $1 ))"; }

rootfs_tarball() {
  local key tarball root began
  key="$(printf '%s' "$ROOTFS_RECIPE" | sha256sum | cut -c1-12)"
  tarball="$cache/rootfs/$SUITE-$key.tar"
  if [ -f "$tarball" ]; then echo "$tarball"; return; fi
  command -v debootstrap >/dev/null 2>&1 || {
    [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1 \
      || { echo "images: debootstrap is needed to make the root filesystem (apt-get install debootstrap)" >&2; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null >&2
  }
  mkdir -p "$cache/rootfs"
  root="$(mktemp -d "$cache/rootfs/make.XXXXXX")"
  began=$(date +%s)
  echo "images: making the $SUITE root filesystem ($ROOTFS_RECIPE)" >&2
  # shellcheck disable=SC2086
  debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$root" "$MIRROR" >"$cache/rootfs/debootstrap.log" 2>&1 \
    || { echo "images: debootstrap failed; see $cache/rootfs/debootstrap.log" >&2; rm -rf "$root"; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar --numeric-owner -C "$root" -cf "$tarball.part" .
  mv "$tarball.part" "$tarball"
  rm -rf "$root"
  echo "images: root filesystem made in $(seconds_since "$began") s: $tarball" >&2
  echo "$tarball"
}

build_base() {
  local tarball digest ctx
  tarball="$(rootfs_tarball)"
  digest="$( { basename "$tarball"; cat "$repo/docker/base.Dockerfile"; } | sha)"
  if [ "$(label_of "$BASE")" = "$digest" ]; then
    echo "images: $BASE is up to date ($digest)"; return
  fi
  ctx="$(mktemp -d)"
  ln "$tarball" "$ctx/rootfs.tar" 2>/dev/null || cp "$tarball" "$ctx/rootfs.tar"
  quietly docker build -f "$repo/docker/base.Dockerfile" -t "$BASE" \
    --label aerie.image=base --label aerie.input-digest="$digest" "$ctx"
  rm -rf "$ctx"
  echo "images: built $BASE ($digest)"
}

# Every wheel a lock names (and any extra name==version given), downloaded once, with pip's own
# configuration (index, find-links).
fill_wheelhouse() {
  local lockfile="$1" missing=() line name version
  shift
  mkdir -p "$wheelhouse"
  while IFS= read -r line; do
    case "$line" in ''|\#*) continue ;; esac
    name="${line%%==*}" version="${line##*==}"
    name="$(echo "$name" | tr 'A-Z-.' 'a-z__')"
    compgen -G "$wheelhouse/${name}-${version}-*.whl" >/dev/null \
      || compgen -G "$wheelhouse/${name}-${version}+*.whl" >/dev/null || missing+=("$line")
  done < <(cat "$lockfile"; printf '%s\n' "$@")
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "images: downloading ${#missing[@]} wheels into $wheelhouse"
    "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: -d "$wheelhouse" "${missing[@]}"
  fi
}

# Tracked (or new, not ignored) files under the given paths, each named then its content.
tracked() {
  (cd "$repo" && git ls-files -co --exclude-standard -- "$@" \
    | grep -v -e '__pycache__' -e '\.pyc$' | LC_ALL=C sort | while IFS= read -r f; do [ -f "$f" ] && { echo "$f"; cat "$f"; }; done)
}

# The worker's inputs: its recipe, the lock, aerie's tracked sources and the base image it builds on (not
# README.md: the image gets a stub in its place, so a doc edit does not rebuild it).
worker_digest() {
  {
    cat "$repo/docker/worker-cpu.Dockerfile" "$lock" "$repo/.dockerignore"
    docker image inspect "$BASE" --format '{{.Id}}'
    tracked aerie flows deployments pyproject.toml prefect.yaml
  } | sha
}

# The CPU SGLang image's inputs: its recipe, SGLang's version and lock, the CPU shims, the plugin layer.
sglang_digest() {
  {
    cat "$repo/docker/sglang-cpu.Dockerfile" "$SGLANG_LOCK" "$repo/envs/sglang/VERSION" "$repo/.dockerignore"
    echo "$TORCH_SPEC"
    docker image inspect "$BASE" --format '{{.Id}}'
    tracked tests/sglang_cpu_shims aerie/__init__.py aerie/errors.py aerie/version.py aerie/sglang_plugin
  } | sha
}

# The wheel server's port is a build argument, and a build argument that changes misses the layer cache
# of every RUN after it: a fixed port keeps the dependency layer cached across builds. Only when that
# port is taken does the build take a free one (and reinstall every wheel).
WHEEL_PORT="${AERIE_WHEEL_PORT:-38517}"
wheel_port() {
  python3 - "$WHEEL_PORT" <<'PY'
import socket, sys
fixed = int(sys.argv[1])
s = socket.socket()
try:
    s.bind(("127.0.0.1", fixed))
except OSError:
    s.bind(("127.0.0.1", 0))
    print(f"images: port {fixed} is taken; the wheel server takes {s.getsockname()[1]} and the dependency layer is rebuilt", file=sys.stderr)
print(s.getsockname()[1])
PY
}
wait_for_wheels() {
  for _ in $(seq 1 50); do
    python3 -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$1/', timeout=1)" 2>/dev/null && return
    sleep 0.1
  done
  echo "images: the wheel server on port $1 did not answer" >&2; exit 1
}

# build_with_wheels NAME TAG RECIPE DIGEST [--build-arg ...]: the wheelhouse served over the host network
# for the build's pip, aerie's labels on the image, the image it replaced pruned.
build_with_wheels() {
  local name="$1" tag="$2" recipe="$3" digest="$4" port began
  shift 4
  port="$(wheel_port)"
  python3 -m http.server --bind 127.0.0.1 "$port" --directory "$wheelhouse" >/dev/null 2>&1 &
  wheel_server=$!
  trap 'kill "$wheel_server" 2>/dev/null || true' EXIT
  wait_for_wheels "$port"
  began=$(date +%s)
  quietly docker build --network host -f "$repo/docker/$recipe" -t "$tag" \
    --build-arg WHEELS="http://127.0.0.1:$port/" --build-arg BASE="$BASE" "$@" \
    --label aerie.image="$name" --label aerie.input-digest="$digest" "$repo"
  kill "$wheel_server" 2>/dev/null || true
  # The image it replaced, now untagged: only aerie's own dangling images are pruned.
  docker image prune -f --filter label=aerie.image="$name" >/dev/null
  echo "images: built $tag ($digest) in $(seconds_since "$began") s"
}

build_worker() {
  local digest tag="$NS/worker-cpu:latest"
  digest="$(worker_digest)"
  if [ "$(label_of "$tag")" = "$digest" ]; then
    echo "images: $tag is up to date ($digest)"; return
  fi
  fill_wheelhouse "$lock"
  build_with_wheels worker-cpu "$tag" worker-cpu.Dockerfile "$digest"
}

# SGLang's CPU lane as `make setup-sglang` makes it: the CPU torch, sglang without its requirements, the lock.
SGLANG_LOCK="$repo/envs/sglang/requirements.lock"
SGLANG_VERSION="$(cat "$repo/envs/sglang/VERSION")"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
build_sglang() {
  local digest tag="$NS/sglang-cpu:$SGLANG_VERSION"
  digest="$(sglang_digest)"
  if [ "$(label_of "$tag")" = "$digest" ]; then
    echo "images: $tag is up to date ($digest)"; return
  fi
  fill_wheelhouse "$SGLANG_LOCK" "$TORCH_SPEC" "sglang==$SGLANG_VERSION"
  build_with_wheels sglang-cpu "$tag" sglang-cpu.Dockerfile "$digest" \
    --build-arg SGLANG_VERSION="$SGLANG_VERSION" --build-arg TORCH_SPEC="$TORCH_SPEC"
}

docker info >/dev/null 2>&1 || { echo "images: no Docker engine answers; run \`make docker-engine\` first" >&2; exit 1; }
for image in $images; do
  case "$image" in
    base) build_base ;;
    worker-cpu) build_worker ;;
    sglang-cpu) build_sglang ;;
    *) echo "images: unknown image $image (base, worker-cpu, sglang-cpu)" >&2; exit 1 ;;
  esac
done
