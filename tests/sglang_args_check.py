"""Run by SGLang's own interpreter (not aerie's): parse command lines with SGLang's server parser.

    python sglang_args_check.py COMMANDS.json RESULTS.json

COMMANDS.json is a list of {"name", "argv", "resolve"}: `argv` is what `sglang.launch_server` receives.
Each is parsed by `prepare_server_args` (SGLang's argparse and `ServerArgs.from_cli_args`, the code its
launcher runs first); with `resolve`, `ServerArgs.resolve_once` then derives everything else from the
model's config, as the server does before it starts (only for a model on local disk). RESULTS.json gets,
per name: the parser's own error line (None when accepted), the deprecation notices it logged, and the
fields as parsed. One process for all commands: importing SGLang takes seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

FIELDS = (
    "model_path",
    "host",
    "port",
    "tp_size",
    "weight_version",
    "device",
    "attention_backend",
    "skip_tokenizer_init",
    "chunked_prefill_size",
    "disable_radix_cache",
    "trust_remote_code",
    "mem_fraction_static",
    "max_total_tokens",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
)


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, bool | int | float | str) else str(value)


def check(argv: list[str], resolve: bool) -> dict[str, Any]:
    # SGLang's argparse actions for retired flags all report through this one function.
    from sglang.srt.arg_groups import argparse_actions
    from sglang.srt.server_args import prepare_server_args

    notices: list[str] = []
    report = argparse_actions.print_deprecated_warning
    argparse_actions.print_deprecated_warning = notices.append
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = prepare_server_args(argv)
    except SystemExit:
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        return {
            "error": lines[-1] if lines else "the parser exited",
            "deprecated": notices,
            "fields": {},
        }
    finally:
        argparse_actions.print_deprecated_warning = report
    fields = {name: _plain(getattr(args, name, None)) for name in FIELDS}
    result: dict[str, Any] = {
        "error": None,
        "deprecated": notices,
        "fields": fields,
        "resolved": False,
    }
    if resolve:
        try:
            args.resolve_once()
            result["resolved"] = True
        except Exception as exc:  # noqa: BLE001 - the point is to report SGLang's own refusal
            result["error"] = f"resolve_once: {type(exc).__name__}: {exc}"
    return result


def main() -> None:
    commands = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    results = {c["name"]: check(c["argv"], c["resolve"]) for c in commands}
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
