# cached [--preset P] [--expect STAGE] [k=v ...]: which stages a run in the home would take as finished, before any GPU time goes to it (cached.py); exit 1 when one up to STAGE would run again
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=home
run() { $PY "$GPU/cached.py" --home "$H" "$@"; }
