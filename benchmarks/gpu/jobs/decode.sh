# decode DECODE_ARGS: the reference server's decoder at chosen batch sizes and shapes (benchmarks/stages/decode.py) -> decode.py's --record / --out
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
  $PY "$ROOT/benchmarks/stages/decode.py" "$@"
}
