# served OUT STEP [ARGS]: the served check (benchmarks/planner/served.py): STEP predict (first), then baseline, speculative, ngram (one a call) -> OUT/<step>.json
# Here: `python benchmarks/planner/served.py record --parts OUT --card <card> ...` -> results/served-<card>.json
# Needs SGLang's set and a drafter: DRAFTER (a promoted drafter directory, default /tmp/drafter-trained) and
# FIGURES (the evaluate stage's figures as JSON, default /tmp/drafter-figures.json) for the prediction.
# Each server runs c1, c8, c32, c64 at steady state (20 s windows, 8 requests per slot, 3 repetitions):
# about 2.5 min to start and 5-6 min of levels, so one server a call (CALL_S 590).
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=sglang
CALL_S=${CALL_S:-590}
run() {
  local out=${1:?served OUT STEP [served.py ARGS]} step=${2:?STEP: predict, baseline, speculative or ngram}
  shift 2
  local drafter=${DRAFTER:-/tmp/drafter-trained} figures=${FIGURES:-/tmp/drafter-figures.json}
  local sgl="--dtype bfloat16 --attention-backend fa3 --mem-fraction-static 0.6 --cuda-graph-max-bs-decode 64"
  mkdir -p "$out"
  case $step in
    predict)
      logged "$out" predict "$PY" "$ROOT/benchmarks/planner/served.py" predict --out "$out" --figures "$figures" \
        --sglang-args "$sgl" "$@" ;;
    baseline|speculative|ngram)
      [ -f "$out/prediction.json" ] || { echo "served: no $out/prediction.json: run STEP predict first"; return 3; }
      [ -f "$drafter/config.json" ] || { echo "served: no drafter at $drafter (set DRAFTER)"; return 3; }
      logged "$out" "$step" "$PY" "$ROOT/benchmarks/planner/served.py" serve --server "$step" --drafter "$drafter" \
        --out "$out" --sglang-args "$sgl" "$@" ;;
    *) echo "served: STEP is predict, baseline, speculative or ngram, not $step"; return 64 ;;
  esac
}
