# sweep OUT [--variant NAME k=v ...]: training recipes on the home's smollm2-gpu corpus, one extraction per drafter family, each kept by held-out acceptance (benchmarks/quality/train_sweep.py --until train) -> OUT/train_sweep-<card>.json (results/train_sweep-<card>.json)
# Needs a home holding the generation and corpus of the same overrides (GEN_OVERRIDES; the pipeline job
# with UNTIL=merge and OVERRIDES="$GEN_OVERRIDES" makes them). Extracts (reference server, fp8) EAGLE-3's
# layers and DFlash's, then trains the variants in order on the same shards, each on the same half of the
# train split for one epoch (equal tokens), until SWEEP_BUDGET_S is spent: a variant that would start with
# less than SWEEP_RESERVE_S left is recorded as skipped. Arguments after OUT replace the default variants.
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=home

# 6,000 conversations: two families' fp8 extractions (about 13 + 19 GB) fit a 64 GB disk beside the
# generation; the whole ShareGPT generation's (35 + 52 GB) would not, and its DFlash extraction would fail.
GEN_OVERRIDES=${GEN_OVERRIDES-"generate.datasets.0.num_samples=6000"}
SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-545}
SWEEP_RESERVE_S=${SWEEP_RESERVE_S:-75}

# In the order they matter (a budget cut leaves the last ones out). Current = the preset's EAGLE-3 and the
# DFlash comparison's settings (benchmarks/quality/dflash.py); converged = recipe=eagle3_converged; authors =
# recipe=dflash_authors. `_b64`: 64 samples a step instead of 512 (half the train split is ~2,850 samples:
# 512 a step leaves ~5 optimizer steps); a row of 2048 tokens for DFlash's 512 anchors a sample.
SWEEP_VARIANTS=(
  --variant eagle3_current
  --variant eagle3_converged_b64 recipe=eagle3_converged train.batch_sequences=64
  --variant dflash_current train.drafter=dflash train.drafter.block_size=8 train.drafter.anchors_per_sequence=64
  --variant dflash_authors_b64 recipe=dflash_authors train.batch_tokens=2048 train.batch_sequences=64
  --variant eagle3_converged recipe=eagle3_converged
  --variant eagle3_lr6e-4 train.lr=6e-4 train.warmup_ratio=0.04
  --variant eagle3_per_sample train.loss_normalization=sequence
  --variant dflash_authors recipe=dflash_authors train.batch_tokens=2048
)

run() {
  local out=${1:?sweep OUT [--variant NAME k=v ...]}; shift
  local began card
  began=$(date +%s)
  mkdir -p "$out"
  $PY -m tools.gpuhost install --home "$H" || return
  card=$($PY -c 'import sys; sys.path.insert(0, "benchmarks"); from records import hardware_name; print(hardware_name("cuda"))')
  local variants=("${SWEEP_VARIANTS[@]}")
  [ $# -gt 0 ] && variants=("$@")
  # shellcheck disable=SC2086  # GEN_OVERRIDES is a list of key=value words
  logged "$out" sweep "$PY" "$ROOT/benchmarks/quality/train_sweep.py" smollm2-gpu --store "$H/store" --until train \
    --budget-s $((SWEEP_BUDGET_S - $(date +%s) + began)) --reserve-s "$SWEEP_RESERVE_S" \
    --out "$out/train_sweep-$card.json" \
    --common $GEN_OVERRIDES deploy.enabled=false \
    --final train.train_fraction=0.5 train.epochs=1 train.eval_every=15 \
    "${variants[@]}"
}
