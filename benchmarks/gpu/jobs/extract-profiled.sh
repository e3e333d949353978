#!/usr/bin/env bash
# benchmarks/extract.py on a GPU machine with py-spy attached to it (and its servers) for a while during
# the first pipeline. Writes into OUT_DIR: bench.log, the benchmark's record extract.json and
# spy.txt (raw stacks, one line per stack and thread).
#
#   bash benchmarks/extract_profiled.sh OUT_DIR PYSPY_WHEEL PIPELINES [DELAY_S] [DURATION_S]
#
# PYSPY_WHEEL is py-spy's manylinux wheel (`pip download --only-binary=:all: --platform
# manylinux2014_x86_64 py-spy`), unpacked here so that an offline machine needs nothing installed.
# DELAY_S counts from the benchmark's "baseline:" line (the last figure before the pipelines): a
# pipeline's server start and canary take 10-25 s on an H200 machine, so 20-25 s lands in the first
# pipeline's steady state.
set -u
out=$1 wheel=$2 pipelines=$3 delay=${4:-22} duration=${5:-10}
mkdir -p "$out" /tmp/pyspy && python3 -m zipfile -e "$wheel" /tmp/pyspy
spy=$(ls /tmp/pyspy/*.data/scripts/py-spy) && chmod +x "$spy"
python benchmarks/extract.py --device cuda --samples 8192 --baseline-samples 192 --pipelines "$pipelines" \
    --results "$out/extract.json" > "$out/bench.log" 2>&1 &
bench=$!
until grep -q "^baseline:" "$out/bench.log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 1; done
sleep "$delay"
"$spy" record --nonblocking --subprocesses --threads --idle --format raw -r 100 -d "$duration" \
    -o "$out/spy.txt" --pid $bench > "$out/spy.log" 2>&1
wait $bench
echo "bench rc=$?" >> "$out/bench.log"
grep "^pipeline\|^baseline\|^storage" "$out/bench.log" | cut -c1-300
