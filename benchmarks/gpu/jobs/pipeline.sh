# The whole smollm2-gpu pipeline on one H200, sourced by benchmarks/hostjob.sh (which defines `step`, $W,
# $H, $PY and the plan's settings); a step that finished is skipped on a re-run:
#   install -> decode (optional: the generation server's decoder at $DECODE_RUNNING rows, random requests
#   of the run's shape, for the planner's calibration) -> pipeline --until U, for each U of $UNTIL, each
#   packed out to $W/state-U -> record ($W/h200-pipeline.json, from the stage manifests)
# The pipeline's stages resume from the store, and a fresh host from a pack-out (`go WAIT_S STATE_DIR`):
# one run spans several hosts when one host's time cannot hold it; every stage's seconds, its server
# starts included, are summed over the calls that worked on it.
date +%s > "$W/t0.tmp" && { [ -f "$W/t0" ] || mv "$W/t0.tmp" "$W/t0"; }

# A pipeline step within what is left of $BUDGET_S (counted from this host's first driver start): stopped
# at it (gpuhost's exit 75), it marks the job stopped, and the steps after it do not start.
budgeted() {
  local until=$1 left
  left=$(( BUDGET_S - ($(date +%s) - $(cat "$W/t0")) ))
  if [ -f "$W/stopped" ] || [ "$left" -lt 120 ]; then
    echo "== pipeline-$until not started: $left s of the budget left"; touch "$W/stopped"; return 0
  fi
  # shellcheck disable=SC2086  # OVERRIDES is a list of key=value words
  $PY -m tools.gpuhost run "$PRESET" $OVERRIDES --until "$until" --home "$H" --out "$W/state-$until" \
    --budget-s "$left" --max-out-mb 54 --part-mb 13.5 --max-parts 4
  local rc=$?
  [ "$rc" -eq 75 ] && { touch "$W/stopped"; return 0; }
  return "$rc"
}

step install $PY -m tools.gpuhost install --home "$H"
if [ -n "$DECODE_RUNNING" ]; then
  step decode $PY benchmarks/decode.py --device cuda --backends slots-graphs --concurrency "$DECODE_RUNNING" \
    --requests-per-slot 2 --shapes $DECODE_SHAPES --budget-s 15 --record decode_running \
    --out "$W/decode_running-h200.json"
fi
for until in $UNTIL; do
  step "pipeline-$until" budgeted "$until"
done
step record $PY benchmarks/pipeline_h200/record.py --home "$H" --run "$RUN" --job "$W" --machine "$MACHINE" \
  --command "PLAN=$PLAN bash benchmarks/hostjob.sh benchmarks/pipeline_h200 go (UNTIL='$UNTIL' $OVERRIDES)" \
  --out "$W/h200-pipeline.json"
