# sgl-serve OUT ARGS: SmolLM2 served by SGLang without speculation and with aerie's EAGLE-3 drafter, tokens/s per concurrency (sgl_serve.py) -> OUT/serve.json
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=sglang
CALL_S=${CALL_S:-560}
run() {
  local out=${1:?sgl-serve OUT [sgl_serve.py ARGS]}; shift
  local model drafter=/tmp/drafter-trained
  model=$(ls -d /tmp/aerie-cache/targets/smollm2-135m-instruct-*/ | head -1)
  [ -f $drafter/config.json ] || drafter=/tmp/small/drafter-test
  echo "model $model drafter $drafter"
  logged "$out" serve "$PY" "$GPU/sgl_serve.py" --out "$out" --model "$model" --drafter $drafter \
    --prompts /tmp/small/prompts.json --sglang-args \
    "--dtype bfloat16 --attention-backend fa3 --mem-fraction-static 0.6 --cuda-graph-max-bs-decode 32 --max-running-requests 64 --log-level info" "$@"
}
