# merge-repeats --out FILE [--preset P] [--runs N]: the merge stage again on the home's generation, its seconds and phases, and the cold tokenizer load (merge_repeats.py) -> FILE (results/merge_repeats-h200.json)
# shellcheck shell=bash disable=SC2034  # NEEDS, BACK_FILES: read by job.sh, which sources this file
NEEDS=home
run() { $PY "$GPU/merge_repeats.py" --home "$H" "$@"; }
