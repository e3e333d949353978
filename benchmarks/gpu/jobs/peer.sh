# The peer run's steps, sourced by benchmarks/hostjob.sh (which defines `step`, $W, $H, $PY and the plan's
# settings); a step that finished is skipped on a re-run:
#   install -> specforge wheel -> pipeline (generate, merge, extract, aerie's train stage) -> specforge
#   -> evaluate -> record
# The SpecForge wheel is read from $SF_WHEEL (default: .stage/peer-sf/ in the tree of the call that started
# the driver, $CALL_TREE).
SF_WHEEL=${SF_WHEEL:-$CALL_TREE/.stage/peer-sf/specforge-0.2.0-py3-none-any.whl}

pipeline() {
  # shellcheck disable=SC2086  # OVERRIDES is a list of key=value words
  $PY -m tools.gpuhost run "$PRESET" $OVERRIDES --until train --home "$H" --out "$W/state" \
    --max-out-mb 45 --part-mb 15 --max-parts 3
}

aerie_drafter() { ls -d "$H/store/$RUN"/train/*/drafter | head -1; }
run_config() { ls -t "$H"/configs/"$PRESET"-*.yaml | head -1; }

step install $PY -m tools.gpuhost install --home "$H"
step sf-wheel $PY -m zipfile -e "$SF_WHEEL" "$W/sf"
step pipeline pipeline
step specforge $PY benchmarks/peer_drafter.py --store "$H/store" --run "$RUN" --specforge-path "$W/sf" \
  --out "$W/sf-out" --device "$DEVICE" --deadline-s "$SF_DEADLINE_S"
step evaluate $PY benchmarks/peer_h200/evaluate_pair.py --config "$(run_config)" \
  --drafter "aerie=$(aerie_drafter)" --drafter "specforge=$W/sf-out/specforge-drafter" --out "$W/pair.json"
step record $PY benchmarks/peer_h200/record.py --home "$H" --run "$RUN" \
  --specforge "$W/sf-out/specforge-train.json" --pair "$W/pair.json" --machine "$MACHINE" \
  --command "bash benchmarks/hostjob.sh benchmarks/peer_h200 go (plan $PLAN: $PRESET $OVERRIDES; gpuhost run --until train, benchmarks/peer_drafter.py, benchmarks/peer_h200/evaluate_pair.py)" \
  --note "steps' wall seconds on the host: $(seconds_note)" \
  --out "$W/peer-drafter.json"
