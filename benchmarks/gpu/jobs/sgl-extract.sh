# sgl-extract OUT ARGS: SmolLM2 through aerie's extract stage on SGLang (its dump plugin), beside the bare-forward roofline, then the train stage on its shards (sgl_extract.py) -> OUT/extract.json
# The drafter it trains goes to /tmp/drafter-trained, for sgl-serve.
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=sglang
CALL_S=${CALL_S:-560}
run() {
  local out=${1:?sgl-extract OUT [sgl_extract.py ARGS]}; shift
  logged "$out" extract "$PY" "$GPU/sgl_extract.py" --out "$out" --corpus /tmp/small/corpus.npz --sglang-args \
    "--dtype bfloat16 --attention-backend fa3 --max-prefill-tokens 65536 --disable-cuda-graph --mem-fraction-static 0.7 --log-level info" "$@"
  ls /tmp/aerie-servers/ 2>/dev/null && tail -n 60 /tmp/aerie-servers/*.log > "$out/servers-tail.log" 2>/dev/null
}
