# plan-validate [--dir D] [--out FILE] [--docs ROOT] [--any-load] [PRESET k=v ...]: a validation run of `aerie plan` on this machine, its rows appended to results/plan-accuracy.json
# The plan before the run, the run from a fresh store (`aerie run --no-prefect`), the load while it ran and the
# commit, then every stage's row appended by plan_accuracy.py --validate (docs/plan.md). No PRESET: smollm2-local
# at a size no calibration run used. PYTHON: the interpreter (this checkout's .venv by default).
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=""
run() {
  set -euo pipefail
  cd "$ROOT"
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  local PY=${PYTHON:-$ROOT/.venv/bin/python}

  DIR=/tmp/plan-validate-$(date -u +%Y%m%dT%H%M%S)
  RECORD=$ROOT/benchmarks/results/plan-accuracy.json
  DOCS=$ROOT
  ANY_LOAD=0
  while [[ $# -gt 0 && $1 == --* ]]; do
      case $1 in
          --dir) DIR=$2; shift 2 ;;
          --out) RECORD=$2; shift 2 ;;
          --docs) DOCS=$2; shift 2 ;;
          --any-load) ANY_LOAD=1; shift ;;
          *) echo "plan-validate: unknown option $1" >&2; exit 2 ;;
      esac
  done
  if [[ $# -gt 0 ]]; then
      PRESET=$1; shift
      OVERRIDES=("$@")
  else
      # The calibration runs were 6 and 12 conversations with 3 and 6 epochs, and the default 24 with 12,
      # all with 32-token answers in evaluation and deployment: this size is none of them.
      PRESET=smollm2-local
      DEFAULT_OVERRIDES=(generate.datasets.0.num_samples=20 train.epochs=16 evaluate.max_new_tokens=64 deploy.max_new_tokens=64)
      OVERRIDES=("${DEFAULT_OVERRIDES[@]}")
  fi

  if [[ -e $DIR/artifacts ]]; then
      echo "plan-validate: $DIR/artifacts exists; a validation run needs a fresh store (--dir elsewhere)" >&2
      exit 2
  fi
  cores=$(nproc)
  load=$(cut -d' ' -f1 /proc/loadavg)
  if [[ $ANY_LOAD == 0 ]] && awk -v l="$load" -v c="$cores" 'BEGIN { exit !(l > 0.5 * c) }'; then
      echo "plan-validate: load average $load on $cores cores: other work would slow every stage." >&2
      echo "Run it when the machine is idle, or pass --any-load (the rows record the load either way)." >&2
      exit 2
  fi
  mkdir -p "$DIR"
  # The run's own working directories, so no leftover of an earlier run of the same config is reused.
  RUN_ONLY=("store.uri=$DIR/artifacts" "extract.work_dir=$DIR/work" "train.cache_dir=$DIR/cache")

  commit=$(git rev-parse HEAD)
  git diff --quiet HEAD -- aerie flows || commit="$commit+uncommitted"
  echo "$commit" > "$DIR/commit"
  echo "${OVERRIDES[*]}" > "$DIR/overrides"

  (while true; do echo "$(date +%s) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 5; done) > "$DIR/load.txt" &
  SAMPLER=$!
  trap 'kill "$SAMPLER" 2>/dev/null || true' EXIT

  echo "plan (before the run): $DIR/plan-before.json"
  "$PY" -m aerie.cli plan "$PRESET" "${OVERRIDES[@]}" "${RUN_ONLY[@]}" --json "$DIR/plan-before.json" | tee "$DIR/plan.txt"
  date -u +%FT%TZ > "$DIR/start"
  echo "run: aerie run $PRESET --no-prefect ${OVERRIDES[*]} (log: $DIR/run.log)"
  set +e
  "$PY" -m aerie.cli run "$PRESET" --no-prefect "${OVERRIDES[@]}" "${RUN_ONLY[@]}" > "$DIR/run.log" 2>&1
  rc=$?
  set -e
  date -u +%FT%TZ > "$DIR/end"
  if [[ $rc != 0 ]]; then
      tail -20 "$DIR/run.log" >&2
      echo "plan-validate: the run failed (exit $rc); no rows written. Its files: $DIR" >&2
      exit "$rc"
  fi
  tail -15 "$DIR/run.log"
  "$PY" benchmarks/planner/plan_accuracy.py --validate "$DIR/artifacts" --plan "$DIR/plan-before.json" \
      --load "$DIR/load.txt" --preset "$PRESET" --overrides "${OVERRIDES[*]}" --out "$RECORD" --docs "$DOCS"
  echo "rows appended to $RECORD; the run's files: $DIR"
}
