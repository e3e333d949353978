#!/bin/bash
# benchmarks/decode.py on a GPU host without network (docs/gpu-host.md), from the root of a working tree
# copied there. decode.py needs only the target's GGUF and the few wheels aerie's engine imports, so the
# staging is the GGUF and those wheels (here: `tools.gpuhost stage --no-wheels --wheels-from DIR`):
#   bash benchmarks/decode_host.sh unpack BUNDLE_DIR       one staged bundle into the home
#   bash benchmarks/decode_host.sh run DECODE_ARGS...      the shipped wheels into HOME/site (once), then
#                                                          decode.py in the host environment
set -u
H=${DECODE_HOME:-/tmp/aerie-host}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1

case "${1:-}" in
unpack)
  $PY -m tools.gpuhost unpack "$2" --home "$H"
  ;;
run)
  shift
  wheels=("$H"/staged/wheels/*.whl)
  if [ -e "${wheels[0]}" ] && [ ! -f "$H/site/.decode-installed" ]; then
    # Not `tools.gpuhost install`: its check imports the whole pipeline, whose other wheels are not shipped.
    $PY -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$H/site" "${wheels[@]}" || exit 2
    touch "$H/site/.decode-installed"
  fi
  eval "$($PY -m tools.gpuhost env --home "$H")"
  $PY benchmarks/decode.py "$@"
  ;;
*)
  echo "usage: decode_host.sh unpack BUNDLE_DIR | run DECODE_ARGS..."; exit 64
  ;;
esac
