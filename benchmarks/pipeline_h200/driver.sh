# The whole smollm2-gpu pipeline on one H200, sourced by benchmarks/hostjob.sh (which defines `step`, $W,
# $H, $PY and the plan's settings); a step that finished is skipped on a re-run:
#   install -> decode (the generation server's decoder at the preset's batch and twice it, random
#   requests of the run's shape: the planner's calibration) -> pipeline --until $UNTIL
# The pipeline's stages resume from the store, and a fresh host from a pack-out (`go WAIT_S STATE_DIR`):
# one run spans several hosts when one host's time cannot hold it, and every stage's seconds, its server
# starts included, are summed over the calls that worked on it (benchmarks/pipeline_h200/record.py).
step install $PY -m tools.gpuhost install --home "$H"
step decode $PY benchmarks/decode.py --device cuda --backends slots-graphs --concurrency "$DECODE_RUNNING" \
  --requests-per-slot 2 --shapes $DECODE_SHAPES --budget-s 15 --record decode_running \
  --out "$W/decode_running-h200.json"
# shellcheck disable=SC2086  # OVERRIDES is a list of key=value words
step "pipeline-$UNTIL" $PY -m tools.gpuhost run "$PRESET" $OVERRIDES --until "$UNTIL" --home "$H" \
  --out "$W/state" --budget-s "$BUDGET_S" --max-out-mb 54 --part-mb 13.5 --max-parts 4
