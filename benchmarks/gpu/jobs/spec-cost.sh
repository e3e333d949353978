# spec-cost OUT ARGS: SGLang's plain decode step against one EAGLE-3 round per target shape, random weights, simulated acceptance, 3 repetitions (benchmarks/planner/spec_cost.py run) -> OUT/raw.json
# Here: `python benchmarks/planner/spec_cost.py record --raw A/raw.json [--raw B/raw.json]` -> results/spec_cost-<card>.json
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
# One shape a call keeps inside the call's limit: k 1,3,5,7 and c 1,8,32,64 with three repetitions, e.g.
#   spec-cost OUT/dense --shapes smollm2-135m,llama-3.2-1b      spec-cost OUT/8b --shapes llama-3.1-8b
#   spec-cost OUT/moe --shapes qwen3-30b-a3b          (Qwen3-30B-A3B's config, dummy weights: --load-format dummy)
# The speculative engines run under SGLANG_SIMULATE_ACC_LEN (--accept-length, 2.5 by default): rounds that accept.
NEEDS=sglang
run() {
  local out=${1:?spec-cost OUT [spec_cost.py run ARGS]}; shift
  logged "$out" spec_cost "$PY" "$ROOT/benchmarks/planner/spec_cost.py" run --out "$out" "$@"
}
