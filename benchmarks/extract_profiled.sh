#!/usr/bin/env bash
# benchmarks/extract.py on the GPU host with py-spy attached to it (and its servers) for a while during
# the first pipeline; what comes back: $OUT/bench.log, $OUT/extract-cuda.json, $OUT/spy.txt (raw stacks,
# one line per stack and thread).
#
#   bash benchmarks/extract_profiled.sh PYSPY_WHEEL PIPELINES [DELAY_S] [DURATION_S]
#
# py-spy is not on the host: carry its manylinux wheel (`pip download --only-binary=:all: --platform
# manylinux2014_x86_64 py-spy`) in an ignored folder. DELAY_S counts from the benchmark's "baseline:"
# line (the last figure before the pipelines): a pipeline's server start and canary took 10-25 s on the
# H200 hosts of session 9, so 20-25 s lands in the first pipeline's steady state.
set -u
wheel=$1 pipelines=$2 delay=${3:-22} duration=${4:-10}
mkdir -p /tmp/pyspy && python3 -m zipfile -e "$wheel" /tmp/pyspy
spy=$(ls /tmp/pyspy/*.data/scripts/py-spy) && chmod +x "$spy"
python benchmarks/extract.py --device cuda --samples 8192 --baseline-samples 192 --pipelines "$pipelines" \
    > "$OUT/bench.log" 2>&1 &
bench=$!
until grep -q "^baseline:" "$OUT/bench.log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 1; done
sleep "$delay"
"$spy" record --nonblocking --subprocesses --threads --idle --format raw -r 100 -d "$duration" \
    -o "$OUT/spy.txt" --pid $bench > "$OUT/spy.log" 2>&1
wait $bench
echo "bench rc=$?" >> "$OUT/bench.log"
cp benchmarks/results/extract-cuda.json "$OUT/" 2>/dev/null
grep "^pipeline\|^baseline\|^storage" "$OUT/bench.log" | cut -c1-300
