#!/usr/bin/env bash
# SGLang's own environment (Python 3.11), for server.backend=sglang and the `sglang` tests: the CPU torch,
# sglang itself without its requirements (they name CUDA builds that would replace that torch), then the
# exact pins of envs/sglang/requirements.lock. The version is named once, in envs/sglang/VERSION.
#
# The environment is 3.4 GB and takes minutes to install, so it is built once per machine: under
# $AERIE_SGLANG_ENVS (default ~/.cache/aerie/sglang-envs) in a directory named by the hash of what goes
# into it, and $SGLANG_VENV (default .venv-sglang) is a link to it. Another clone, or a re-run, with the
# same inputs only makes the link. A build cut short has no completion mark and is rebuilt.
#   SGLANG_PYTHON   the interpreter the venv is made from (default python3.11)
#   TORCH_SPEC      the torch requirement (default torch==2.13.0, this machine's CPU build)
#   TORCH_INDEX     an index URL for torch (default: pip's configured indexes)
set -euo pipefail

cd "$(dirname "$0")/.."
SGLANG_PYTHON="${SGLANG_PYTHON:-python3.11}"
SGLANG_VENV="${SGLANG_VENV:-.venv-sglang}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-}"
ENVS="${AERIE_SGLANG_ENVS:-$HOME/.cache/aerie/sglang-envs}"
VERSION="$(cat envs/sglang/VERSION)"
LOCK=envs/sglang/requirements.lock
# Bump when the install steps below change: environments built the old way are then rebuilt.
RECIPE=1

# A pin to a file on the machine that froze the lock ("name @ file:///...") works there and nowhere else.
if grep -n "@ file:" "$LOCK" >&2; then
  echo "setup-sglang: $LOCK pins a local file (above): pin the release (name==version) or drop the line" >&2
  exit 1
fi
if ! command -v "$SGLANG_PYTHON" >/dev/null 2>&1; then
  echo "setup-sglang: $SGLANG_PYTHON not found: SGLang's environment needs Python 3.11 (set SGLANG_PYTHON)" >&2
  exit 1
fi
python_version="$("$SGLANG_PYTHON" -c 'import sys; print(sys.version.split()[0])')"
key="$( { echo "recipe $RECIPE"; echo "sglang $VERSION"; echo "python $python_version";
          echo "torch $TORCH_SPEC $TORCH_INDEX"; cat "$LOCK"; } | sha256sum | cut -c1-16)"
env_dir="$ENVS/sglang-$VERSION-$key"
done_mark="$env_dir/.aerie-complete"


build() {
  rm -rf "$env_dir"
  echo "setup-sglang: building sglang $VERSION with $TORCH_SPEC (Python $python_version) in $env_dir"
  "$SGLANG_PYTHON" -m venv "$env_dir"
  local py="$env_dir/bin/python"
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
  "$py" -m pip install -q --no-deps "sglang==$VERSION"
  "$py" -m pip install -q --no-deps -r "$LOCK"
  touch "$done_mark"
}

# A directory built in place (before environments were shared) with the same version and lock is kept.
in_place_key="$(cat envs/sglang/VERSION "$LOCK" | sha256sum | cut -c1-16)"
if [ -d "$SGLANG_VENV" ] && [ ! -L "$SGLANG_VENV" ] \
   && { [ -f "$SGLANG_VENV/.aerie-setup-$key" ] || [ -f "$SGLANG_VENV/.aerie-setup-$in_place_key" ]; }; then
  echo "setup-sglang: sglang $VERSION already built in $SGLANG_VENV"
  exit 0
fi
if [ -e "$SGLANG_VENV" ] && [ ! -L "$SGLANG_VENV" ]; then
  echo "setup-sglang: $SGLANG_VENV is a directory, not a link to a built environment: remove it and re-run" >&2
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
  echo "setup-sglang: sglang $VERSION already built in $env_dir"
fi
ln -sfn "$env_dir" "$SGLANG_VENV"
