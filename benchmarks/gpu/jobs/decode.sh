# decode DECODE_ARGS: the reference server's decoder at chosen batch sizes and shapes (benchmarks/decode.py) -> decode.py's --record / --out
# decode.py needs only the wheels aerie's engine imports (pydantic and its requirements; gguf too when it
# reads the checkpoint) and, with --target-config, the target's config.json instead of its GGUF: one 3 MiB
# bundle, so one call. Here: `tools.gpuhost stage --out .stage/decode --no-target --no-wheels --wheels-from
# WHEELS_DIR generate.datasets.0.num_samples=1`; there: `unpack .stage/decode/bundle-1 && decode --device cuda
# --target-config CONFIG_DIR --concurrency 256 --backends slots-graphs,slots --shapes 256,2048:200,384
# 16,900:200,384 16,256:64,384 --budget-s 15 --record decode_context`.
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=""
run() {
  local wheels=("$H"/staged/wheels/*.whl)
  if [ -e "${wheels[0]}" ] && [ ! -f "$H/site/.decode-installed" ]; then
    # Not `tools.gpuhost install`: its check imports the whole pipeline, whose other wheels are not shipped.
    $PY -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$H/site" "${wheels[@]}" || exit 2
    touch "$H/site/.decode-installed"
  fi
  needs_home
  $PY "$ROOT/benchmarks/decode.py" "$@"
}
