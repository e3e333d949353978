# spec-cost OUT ARGS: SGLang's plain decode step against one EAGLE-3 round per target shape, random weights (benchmarks/spec_cost.py run) -> OUT/raw.json
# Here: `python benchmarks/spec_cost.py record --raw A/raw.json [--raw B/raw.json]` -> results/spec_cost-<card>.json
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=sglang
run() {
  local out=${1:?spec-cost OUT [spec_cost.py run ARGS]}; shift
  logged "$out" spec_cost "$PY" "$ROOT/benchmarks/spec_cost.py" run --out "$out" "$@"
}
