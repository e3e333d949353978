# merge-repeats --out FILE [--preset P] [--runs N]: the merge stage again on the home's generation, its seconds and phases, and the cold tokenizer load (merge_repeats.py) -> FILE (results/merge_repeats-h200.json)
NEEDS=home
run() { $PY "$GPU/merge_repeats.py" --home "$H" "$@"; }
