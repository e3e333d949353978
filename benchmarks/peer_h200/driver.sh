#!/bin/bash
# The whole peer run on one host, step by step; a step that finished is skipped on a re-run:
#   install -> pipeline (generate, merge, extract, aerie's train stage) -> specforge -> evaluate -> record
# Started (detached) by dev.sh go, from a private copy of the repository ($W/repo), so that the working
# tree each device call copies in cannot change the code under a running step.
set -u
W=${PEER_WORK:-/tmp/peer}
H=${PEER_HOME:-/tmp/aerie-host}
PY=${PY:-python3}
. "$W/plan.env"
cd "$W/repo" || exit 1
eval "$($PY -m tools.gpuhost env --home "$H")"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME COMMAND...: run once; its wall seconds go to $W/seconds.NAME
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

pipeline() {
  # shellcheck disable=SC2086  # OVERRIDES is a list of key=value words
  $PY -m tools.gpuhost run "$PRESET" $OVERRIDES --until train --home "$H" --out "$W/state" \
    --max-out-mb 45 --part-mb 15 --max-parts 3
}

aerie_drafter() { ls -d "$H/store/$RUN"/train/*/drafter | head -1; }
run_config() { ls -t "$H"/configs/"$PRESET"-*.yaml | head -1; }

step install $PY -m tools.gpuhost install --home "$H"
step pipeline pipeline
step specforge $PY benchmarks/peer_drafter.py --store "$H/store" --run "$RUN" --specforge-path "$W/sf" \
  --out "$W/sf-out" --device "$DEVICE" --deadline-s "$SF_DEADLINE_S"
step evaluate $PY benchmarks/peer_h200/evaluate_pair.py --config "$(run_config)" \
  --drafter "aerie=$(aerie_drafter)" --drafter "specforge=$W/sf-out/specforge-drafter" --out "$W/pair.json"
step record $PY benchmarks/peer_h200/record.py --home "$H" --run "$RUN" \
  --specforge "$W/sf-out/specforge-train.json" --pair "$W/pair.json" --machine "$MACHINE" \
  --command "bash benchmarks/peer_h200/dev.sh go (plan $PLAN: $PRESET $OVERRIDES; gpuhost run --until train, benchmarks/peer_drafter.py, benchmarks/peer_h200/evaluate_pair.py)" \
  --note "steps' wall seconds on the host: $(cd "$W" && for f in seconds.*; do printf '%s=%s ' "${f#seconds.}" "$(cat "$f")"; done)" \
  --out "$W/peer-drafter.json"
touch "$W/done.all"
echo "== all done $(date -u +%H:%M:%S)"
