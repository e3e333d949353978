# extract-profiled OUT PYSPY_WHEEL PIPELINES [DELAY_S] [DURATION_S]: benchmarks/stages/extract.py with py-spy attached during the first pipeline -> OUT/extract.json, OUT/spy.txt, OUT/bench.log
# PYSPY_WHEEL: py-spy's manylinux wheel, unpacked here. DELAY_S counts from the benchmark's "baseline:" line.
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=home
run() {
  local out=${1:?extract-profiled OUT PYSPY_WHEEL PIPELINES [DELAY_S] [DURATION_S]} wheel=${2:?} pipelines=${3:?}
  local delay=${4:-22} duration=${5:-10} spy bench
  mkdir -p "$out" /tmp/pyspy && $PY -m zipfile -e "$wheel" /tmp/pyspy
  spy=$(ls /tmp/pyspy/*.data/scripts/py-spy) && chmod +x "$spy"
  $PY "$ROOT/benchmarks/stages/extract.py" --device cuda --samples 8192 --baseline-samples 192 --pipelines "$pipelines" \
    --results "$out/extract.json" > "$out/bench.log" 2>&1 &
  bench=$!
  until grep -q "^baseline:" "$out/bench.log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 1; done
  sleep "$delay"
  "$spy" record --nonblocking --subprocesses --threads --idle --format raw -r 100 -d "$duration" \
    -o "$out/spy.txt" --pid $bench > "$out/spy.log" 2>&1
  wait $bench
  echo "bench rc=$?" >> "$out/bench.log"
  grep "^pipeline\|^baseline\|^storage" "$out/bench.log" | cut -c1-300
}
