# The DFlash-against-EAGLE-3 run's steps, sourced by benchmarks/hostjob.sh (which defines `step`, $W, $H,
# $PY and the plan's settings): install -> benchmarks/dflash.py (both families over one corpus, from the
# home's store: a restored generation is a cache hit).
step install $PY -m tools.gpuhost install --home "$H"
# shellcheck disable=SC2086  # OVERRIDES is a list of key=value words
step dflash $PY benchmarks/dflash.py --preset "$PRESET" --steps "$STEPS" --out "$W/dflash.json" \
  --note "$NOTE" store.uri="$H/store" run="$RUN" $OVERRIDES
