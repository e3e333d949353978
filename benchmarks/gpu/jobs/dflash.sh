# dflash (go): DFlash against EAGLE-3 over one corpus, the same training tokens and evaluator (benchmarks/quality/dflash.py) -> dflash.json (results/dflash-h200.json)
# The corpus is the peer job's: its bundles, and its pack-out to restore the generation (`go dflash 540 STATE_DIR`).
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
BACK_FILES="dflash.json"

plan_h200() {
  # The peer job's 3,000 conversations, four epochs per family, greedy at 7 drafts a round (EAGLE-3 chains of 7,
  # DFlash blocks of 8).
  PRESET=smollm2-gpu
  RUN=smollm2-gpu
  STEPS=7
  OVERRIDES="generate.datasets.0.num_samples=3000 corpus.eval_fraction=0.015 train.epochs=4 evaluate.temperatures=[0]"
  NOTE="one H200; 3,000 regenerated ShareGPT conversations (three turns), four epochs per family, greedy, 80 MT-Bench first turns and the held-out split at 384 new tokens"
}

steps() {
  step install $PY -m tools.gpuhost install --home "$H"
  # shellcheck disable=SC2086  # OVERRIDES is a list of key=value words
  step dflash $PY benchmarks/quality/dflash.py --preset "$PRESET" --steps "$STEPS" --out "$W/dflash.json" \
    --note "$NOTE" store.uri="$H/store" run="$RUN" $OVERRIDES
}
