#!/bin/bash
# benchmarks/decode.py on a GPU host without network (docs/gpu-host.md), from the root of a working tree
# copied there. decode.py needs only the wheels aerie's engine imports (pydantic and its requirements;
# gguf too when it reads the checkpoint) and, with --target-config, the target's config.json instead of
# its GGUF: one 3 MiB bundle, so one device call, e.g.
#   here:  tools.gpuhost stage --out .stage/decode --no-target --no-wheels --wheels-from WHEELS_DIR \
#            generate.datasets.0.num_samples=1           (the dataset export is not read)
#   host:  bash benchmarks/decode_host.sh unpack .stage/decode/bundle-1 &&
#          bash benchmarks/decode_host.sh run --device cuda --target-config CONFIG_DIR --concurrency 256 \
#            --backends slots-graphs,slots --shapes 256,2048:200,384 16,900:200,384 16,256:64,384 \
#            --budget-s 15 --record decode_context
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
