#!/usr/bin/env bash
# A Docker engine for aerie's docker tests and images: leave one that answers alone; otherwise, as root
# on a Debian-like Linux, install Debian's docker.io (when dockerd is missing), start dockerd in the
# background and wait until it answers. Anywhere else: one line saying what to install, exit 1.
#   DOCKER_TESTS=0      skip: do nothing, exit 0 (the docker tests then skip, saying why)
#   AERIE_DOCKERD_LOG   where dockerd writes its log (default ~/.cache/aerie/dockerd.log)
set -euo pipefail

if [ "${DOCKER_TESTS:-1}" = "0" ]; then
  echo "docker-engine: DOCKER_TESTS=0, no engine started"
  exit 0
fi

# Debian's engine speaks API 1.41; a newer client elsewhere on PATH must not ask for more.
answers() { DOCKER_API_VERSION="${DOCKER_API_VERSION:-1.41}" docker info >/dev/null 2>&1; }

if command -v docker >/dev/null 2>&1 && answers; then
  echo "docker-engine: an engine answers; left alone"
  exit 0
fi

if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "docker-engine: no Docker engine answers; install and start one (Debian/Ubuntu: apt-get install docker.io; elsewhere Docker Engine from docs.docker.com/engine/install), or set DOCKER_TESTS=0" >&2
  exit 1
fi

if ! command -v dockerd >/dev/null 2>&1; then
  echo "docker-engine: installing Debian's docker.io"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null; }
fi

log="${AERIE_DOCKERD_LOG:-$HOME/.cache/aerie/dockerd.log}"
mkdir -p "$(dirname "$log")"
if ! pgrep -x dockerd >/dev/null 2>&1; then
  echo "docker-engine: starting dockerd (log $log)"
  # setsid: the engine outlives the make that started it.
  setsid dockerd >>"$log" 2>&1 < /dev/null &
fi
for _ in $(seq 1 120); do
  if answers; then
    echo "docker-engine: the engine answers"
    exit 0
  fi
  sleep 0.5
done
echo "docker-engine: dockerd did not answer within 60 s; see $log" >&2
tail -n 5 "$log" >&2 || true
exit 1
