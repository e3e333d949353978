#!/bin/bash
# Device side of the peer run, from the root of the working tree a device call copies in:
#   bash benchmarks/peer_h200/dev.sh unpack BUNDLE_DIR            one staged bundle into the home
#   PLAN=h200 bash benchmarks/peer_h200/dev.sh go WAIT_S [STATE]   start driver.sh detached (once), wait
#                                                                 up to WAIT_S for it, copy results to $BACK
# STATE: a pack-out of an earlier host (state.json + state.tgz.NNN) restored into a fresh home first.
# The SpecForge wheel is read from $SF_WHEEL (default .stage/peer-sf/specforge-0.2.0-py3-none-any.whl).
set -u
W=${PEER_WORK:-/tmp/peer}
H=${PEER_HOME:-/tmp/aerie-host}
PY=${PY:-python3}
PLAN=${PLAN:-h200}
SF_WHEEL=${SF_WHEEL:-.stage/peer-sf/specforge-0.2.0-py3-none-any.whl}
BACK=${BACK:-$W/back}
export PEER_WORK=$W PEER_HOME=$H PY PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
here=$(cd "$(dirname "$0")" && pwd)

start() {  # the first go on this host: private repository copy, SpecForge unpacked, driver detached
  local state=${1:-}
  mkdir -p "$W/repo" "$W/sf" || exit 1
  tar --exclude=./.stage --exclude=./.venv --exclude=./.git -cf - . | tar -xf - -C "$W/repo" || exit 1
  [ -f "$SF_WHEEL" ] || { echo "dev.sh: no SpecForge wheel at $SF_WHEEL"; exit 2; }
  $PY -m zipfile -e "$SF_WHEEL" "$W/sf" || exit 2
  { cat "$here/$PLAN.env"; echo "PLAN=$PLAN"; } > "$W/plan.env"
  if [ -n "$state" ]; then $PY -m tools.gpuhost restore --home "$H" "$state" || exit 3; fi
  setsid nohup bash "$W/repo/benchmarks/peer_h200/driver.sh" > "$W/driver.log" 2>&1 < /dev/null &
  echo "$!" > "$W/driver.pid"
  echo "dev.sh: driver started (pid $(cat "$W/driver.pid"), plan $PLAN, log $W/driver.log)"
}

finished() { [ -f "$W/done.all" ] || ls "$W"/failed.* >/dev/null 2>&1 || ! kill -0 "$(cat "$W/driver.pid")" 2>/dev/null; }

collect() {  # at most 8 files come back
  mkdir -p "$BACK"
  tr '\r' '\n' < "$W/driver.log" | grep -v '‰' | tail -n 400 > "$BACK/driver-tail.log"
  for f in peer-drafter.json pair.json sf-out/specforge-train.json; do
    [ -f "$W/$f" ] && cp "$W/$f" "$BACK/"
  done
  [ -f "$W/state/state.json" ] && cp "$W/state"/state.json "$W/state"/state.tgz.* "$BACK/" 2>/dev/null
  ls -la "$BACK"
}

case "${1:-}" in
unpack)
  $PY -m tools.gpuhost unpack "$2" --home "$H"
  ;;
go)
  wait_s=${2:-540}
  t0=$(date +%s)
  [ -f "$W/driver.pid" ] || start "${3:-}"
  until finished || [ $(( $(date +%s) - t0 )) -ge "$wait_s" ]; do sleep 5; done
  tr '\r' '\n' < "$W/driver.log" | grep -v '‰' | grep -E '^(==|gpuhost:|Traceback|[A-Za-z]*Error)|τ=' | tail -n 40
  echo "--- log tail"; tr '\r' '\n' < "$W/driver.log" | grep -v '‰' | tail -n 25
  collect
  if [ -f "$W/done.all" ]; then echo "dev.sh: ALL DONE"; elif finished; then echo "dev.sh: DRIVER STOPPED"; else echo "dev.sh: STILL RUNNING"; fi
  ;;
*)
  echo "usage: dev.sh unpack BUNDLE_DIR | go WAIT_S [STATE_DIR]"; exit 64
  ;;
esac
