# peer (go): aerie's drafter beside SpecForge 0.2.0's, trained on one run's features, scored by one evaluator -> peer-drafter.json (results/peer-drafter-h200.json)
# The SpecForge wheel: $SF_WHEEL, by default in .stage/peer-sf/ of the tree of the call that started the driver.
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
BACK_FILES="peer-drafter.json pair.json sf-out/specforge-train.json state/state.json state/state.tgz.*"

plan_h200() {
  # 3,000 regenerated conversations (stage them with the same num_samples), two epochs for both trainers; the
  # held-out split is 1.5% of the corpus, so that it holds the 40 prompts the preset evaluates.
  PRESET=smollm2-gpu
  RUN=smollm2-gpu
  OVERRIDES="generate.datasets.0.num_samples=3000 corpus.eval_fraction=0.015 train.epochs=2"
  DEVICE=cuda
  SF_DEADLINE_S=600  # SpecForge's loop stops here at the latest (the record then says so)
  MACHINE="one NVIDIA H200 GPU (about 139 GiB), 16 CPU cores, 128 GiB memory, 64 GiB disk"
}

plan_dry() {
  # The CPU dry run of the same steps on the embedded default: proves every step and the record.
  PRESET=smollm2-local
  RUN=smollm2-local
  OVERRIDES="train.epochs=2"
  DEVICE=cpu
  SF_DEADLINE_S=0
  MACHINE="CPU dry run"
}

steps() {
  SF_WHEEL=${SF_WHEEL:-$CALL_TREE/.stage/peer-sf/specforge-0.2.0-py3-none-any.whl}
  step install $PY -m tools.gpuhost install --home "$H"
  step sf-wheel $PY -m zipfile -e "$SF_WHEEL" "$W/sf"
  step pipeline peer_pipeline
  step specforge $PY benchmarks/quality/peer_drafter.py --store "$H/store" --run "$RUN" --specforge-path "$W/sf" \
    --out "$W/sf-out" --device "$DEVICE" --deadline-s "$SF_DEADLINE_S"
  step evaluate $PY benchmarks/gpu/evaluate_pair.py --config "$(ls -t "$H"/configs/"$PRESET"-*.yaml | head -1)" \
    --drafter "aerie=$(ls -d "$H/store/$RUN"/train/*/drafter | head -1)" \
    --drafter "specforge=$W/sf-out/specforge-drafter" --out "$W/pair.json"
  step record $PY benchmarks/gpu/record.py peer --home "$H" --run "$RUN" \
    --specforge "$W/sf-out/specforge-train.json" --pair "$W/pair.json" --machine "$MACHINE" \
    --command "bash benchmarks/gpu/job.sh go peer (plan $PLAN: $PRESET $OVERRIDES; gpuhost run --until train, benchmarks/quality/peer_drafter.py, benchmarks/gpu/evaluate_pair.py)" \
    --note "steps' wall seconds on the host: $(seconds_note)" \
    --out "$W/peer-drafter.json"
}

peer_pipeline() {
  # shellcheck disable=SC2086  # OVERRIDES is a list of key=value words
  $PY -m tools.gpuhost run "$PRESET" $OVERRIDES --until train --home "$H" --out "$W/state" \
    --max-out-mb 45 --part-mb 15 --max-parts 3
}
