# targets OUT ARGS: tiny DeepSeek-V3 and Kimi-shaped MLA targets through every stage on SGLang (benchmarks/gpu/targets_gpu.py) -> OUT/targets_gpu-<card>.json
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=sglang
run() {
  local out=${1:?targets OUT [targets_gpu.py ARGS]}; shift
  PYTHONPATH=$SGL:$ROOT logged "$out" targets "$PY" "$ROOT/benchmarks/gpu/targets_gpu.py" --out "$out" "$@"
}
