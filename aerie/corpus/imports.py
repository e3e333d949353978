"""Raw datasets that already carry assistant turns, written as stage results the merge stage reads.

`import_conversations` stores `Conversation` objects as `<run>/import-<name>/<key>/conversations.parquet`
in the generation stage's schema, keyed by the content, so merging them with generated data goes
through the same checks, dedupe and template as everything else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from aerie.conversation import Conversation
from aerie.corpus.schema import conversations_frame
from aerie.corpus.work import CONVERSATIONS
from aerie.diskspace import writing
from aerie.errors import DataError
from aerie.manifest import StageDir, StageResult, stage_key
from aerie.store import ArtifactStore, sha256_file
from aerie.workdirs import work_dir


def import_conversations(
    conversations: Iterable[Conversation], *, store: ArtifactStore, run_name: str, name: str
) -> StageResult:
    """Write raw conversations as stage `import-<name>`; the same conversations give the same key."""
    stage_name = f"import-{name}"
    with work_dir("aerie-import-") as tmp:
        path = Path(tmp) / CONVERSATIONS
        items = list(conversations)
        # Parquet bytes are not guaranteed stable across writers; the key hashes the conversations themselves.
        h = hashlib.sha256()
        for c in items:
            h.update(c.model_dump_json().encode() + b"\n")
        digest = h.hexdigest()
        frame = conversations_frame(items)
        with writing(path, DataError):
            frame.write_parquet(path, compression="zstd")
        stage = StageDir(store, run_name, stage_name, stage_key(stage_name, {"rows": digest}))
        if (cached := stage.cached_result()) is not None:
            return cached
        store.put_file(stage.path(CONVERSATIONS), path)
        messages = int(frame["messages"].list.len().sum())
        return stage.finish(
            {
                "rows": frame.height,
                "sha256": sha256_file(path),
                "figures": {"conversations": frame.height, "messages": messages},
            }
        )
