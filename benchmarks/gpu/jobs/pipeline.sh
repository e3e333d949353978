# pipeline (go): the whole smollm2-gpu preset on one H200, each stage's GPU seconds over every call that worked on it -> h200-pipeline.json (results/h200-pipeline.json)
# Steps: install -> decode (when DECODE_RUNNING is set) -> `gpuhost run --until U` for each U of UNTIL, each
# packed out to $W/state-U -> record. A fresh host resumes from a pack-out (`go pipeline WAIT_S STATE_DIR`).
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
BACK_FILES="h200-pipeline.json decode_running-h200.json state-*/state.json state-*/state.tgz.*"

plan_h200() {
  # The preset as it ships, within BUDGET_S seconds from the driver's first start on this host; DECODE_RUNNING:
  # the decoder's batch sizes on prompts of 16-900 tokens, 200-384 new (near the run's mean context).
  PRESET=smollm2-gpu
  RUN=smollm2-gpu
  OVERRIDES=${OVERRIDES:-""}  # e.g. a smaller generation for the sweep job (jobs/sweep.sh: GEN_OVERRIDES)
  UNTIL=${UNTIL:-"merge deploy"}
  BUDGET_S=${BUDGET_S:-1600}
  DECODE_RUNNING=${DECODE_RUNNING:-}
  DECODE_SHAPES="16,900:200,384"
  MACHINE="one NVIDIA H200 GPU (about 139 GiB), 16 CPU cores, 128 GiB memory, 64 GiB disk"
}

# The same preset on one H100 (80 GB): the reference server sizes its KV cache and generation batch to the
# card (its log's "KV cache plan:" line); the files keep their names.
plan_h100() {
  plan_h200
  MACHINE="one NVIDIA H100 GPU (about 80 GiB), 16 CPU cores, 128 GiB memory, 64 GiB disk"
}

# A pipeline step within what is left of $BUDGET_S (counted from this host's first driver start): stopped at
# it (gpuhost's exit 75), it marks the job stopped, and the steps after it do not start.
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

steps() {
  date +%s > "$W/t0.tmp" && { [ -f "$W/t0" ] || mv "$W/t0.tmp" "$W/t0"; }
  step install $PY -m tools.gpuhost install --home "$H"
  if [ -n "$DECODE_RUNNING" ]; then
    # shellcheck disable=SC2086  # DECODE_SHAPES is a list of shapes
    step decode $PY benchmarks/stages/decode.py --device cuda --backends slots-graphs --concurrency "$DECODE_RUNNING" \
      --requests-per-slot 2 --shapes $DECODE_SHAPES --budget-s 15 --record decode_running \
      --out "$W/decode_running-h200.json"
  fi
  local until
  for until in $UNTIL; do
    step "pipeline-$until" budgeted "$until"
  done
  step record $PY benchmarks/gpu/record.py pipeline --home "$H" --run "$RUN" --job "$W" --machine "$MACHINE" \
    --command "PLAN=$PLAN bash benchmarks/gpu/job.sh go pipeline (UNTIL='$UNTIL' $OVERRIDES)" \
    --out "$W/h200-pipeline.json"
}
