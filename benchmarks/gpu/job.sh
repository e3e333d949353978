#!/bin/bash
# A job longer than one device call on a GPU host with no network (docs/gpu-host.md), from the root of the
# working tree a call copies in. JOB is a folder holding driver.sh (the job's steps), one PLAN.env per
# plan (its settings) and back.txt (the files, relative to the job's work folder, that come back):
#   bash benchmarks/hostjob.sh JOB unpack BUNDLE_DIR             one staged bundle into the home
#   PLAN=h200 bash benchmarks/hostjob.sh JOB go WAIT_S [STATE]    start the driver detached, wait up to
#                                                                WAIT_S for it, copy its files to $BACK
# The driver runs from a private copy of the repository, so the tree the next call copies in cannot change
# the code under a running step. A driver that stopped on a failure is started again by the next `go`,
# from that call's tree: its finished steps are skipped and the pipeline's stages resume from the store,
# so a fix made between calls costs only the step that failed.
# STATE: a pack-out of an earlier host (state.json + state.tgz.NNN), restored into a fresh home first.
# Inside the driver, `step NAME COMMAND...` runs COMMAND once; its wall seconds go to $W/seconds.NAME.
set -u
JOB=${1:?usage: hostjob.sh JOB unpack BUNDLE_DIR | JOB go WAIT_S [STATE_DIR]}
JOB=${JOB%/}
NAME=$(basename "$JOB")
W=${JOB_WORK:-/tmp/$NAME}
H=${JOB_HOME:-/tmp/aerie-host}
PY=${PY:-python3}
PLAN=${PLAN:-h200}
BACK=${BACK:-$W/back}
export JOB_WORK=$W JOB_HOME=$H PY PLAN PYTHONUNBUFFERED=1
export CALL_TREE=${CALL_TREE:-$PWD}  # the tree of the call that started the driver (its .stage/ stays there)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

step() {
  local name=$1; shift
  [ -f "$W/done.$name" ] && return 0
  local t0; t0=$(date +%s.%N)
  echo "== $name start $(date -u +%H:%M:%S)"
  if "$@"; then
    awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f\n", b - a }' > "$W/seconds.$name"
    touch "$W/done.$name"
    echo "== $name done in $(cat "$W/seconds.$name") s"
  else
    local rc=$?
    echo "== $name FAILED with $rc"
    echo "$rc" > "$W/failed.$name"
    exit "$rc"
  fi
}

seconds_note() {  # every finished step's wall seconds, for a record's note
  (cd "$W" && for f in seconds.*; do [ -f "$f" ] && printf '%s=%s ' "${f#seconds.}" "$(cat "$f")"; done)
}

start() {  # a fresh copy of the repository, the plan, then the driver detached
  local state=${1:-}
  rm -rf "$W/repo" "$W"/failed.* && mkdir -p "$W/repo" || exit 1
  tar --exclude=./.stage --exclude=./.venv --exclude=./.venv-sglang --exclude=./.git -cf - . |
    tar -xf - -C "$W/repo" || exit 1
  [ -f "$JOB/$PLAN.env" ] || { echo "hostjob: no plan $JOB/$PLAN.env"; exit 2; }
  { cat "$JOB/$PLAN.env"; echo "PLAN=$PLAN"; } > "$W/plan.env"
  if [ -n "$state" ] && [ ! -f "$W/restored" ]; then
    $PY -m tools.gpuhost restore --home "$H" "$state" || exit 3
    touch "$W/restored"
  fi
  (cd "$W/repo" && setsid nohup bash benchmarks/hostjob.sh "$JOB" drive >> "$W/driver.log" 2>&1 < /dev/null &
    echo "$!" > "$W/driver.pid")
  echo "hostjob: $NAME driver started (pid $(cat "$W/driver.pid"), plan $PLAN, log $W/driver.log)"
}

running() { [ -f "$W/driver.pid" ] && kill -0 "$(cat "$W/driver.pid")" 2>/dev/null; }

collect() {  # the log tail and the job's files new since the last call's (a call brings back 64 MiB)
  mkdir -p "$BACK"
  tr '\r' '\n' < "$W/driver.log" | grep -v '‰' | tail -n 400 > "$BACK/driver-tail.log"
  local stamp="$W/collected" next="$W/collecting"
  touch "$next"
  while read -r f; do
    [ -n "$f" ] && for g in "$W"/$f; do
      local rel=${g#"$W"/}
      [ -f "$g" ] && { [ ! -f "$stamp" ] || [ "$g" -nt "$stamp" ]; } && mkdir -p "$BACK/$(dirname "$rel")" &&
        cp "$g" "$BACK/$rel"
    done
  done < "$JOB/back.txt"
  mv "$next" "$stamp"
  ls -laR "$BACK"
}

case "${2:-}" in
unpack)
  $PY -m tools.gpuhost unpack "$3" --home "$H"
  ;;
drive)  # what `start` runs detached, in the private copy
  set -a; . "$W/plan.env"; set +a  # the plan's settings reach the steps too
  eval "$($PY -m tools.gpuhost env --home "$H")"
  export TOKENIZERS_PARALLELISM=false
  . "$JOB/driver.sh"
  touch "$W/done.all"
  echo "== all done $(date -u +%H:%M:%S)"
  ;;
go)
  wait_s=${3:-540}
  t0=$(date +%s)
  mkdir -p "$W"
  [ -f "$W/done.all" ] || running || start "${4:-}"
  until [ -f "$W/done.all" ] || ! running || [ $(( $(date +%s) - t0 )) -ge "$wait_s" ]; do sleep 5; done
  tr '\r' '\n' < "$W/driver.log" | grep -v '‰' | grep -E '^(==|gpuhost:|hostjob:|Traceback|[A-Za-z]*Error)|τ=' | tail -n 40
  echo "--- log tail"; tr '\r' '\n' < "$W/driver.log" | grep -v '‰' | tail -n 25
  collect
  if [ -f "$W/done.all" ]; then echo "hostjob: ALL DONE"; elif running; then echo "hostjob: STILL RUNNING"
  else echo "hostjob: DRIVER STOPPED (the next go starts it again from that call's tree)"; fi
  ;;
*)
  echo "usage: hostjob.sh JOB unpack BUNDLE_DIR | JOB go WAIT_S [STATE_DIR]"; exit 64
  ;;
esac
