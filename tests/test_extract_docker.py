"""The extract stage with `server.launcher=docker`: the embedded target's corpus goes through a server in a
container into shards, with the reference server in aerie's worker image, and with SGLang's CPU engine and
aerie's dump plugin in aerie/sglang-cpu (both built locally by `make images`, never pulled). The dump dir
is a bind mount the container writes as root; the canary checks the container's hidden states against the
host's transformers forward; nothing of aerie's is left on the engine afterwards.

In aerie/sglang-cpu, SGLang imports `sgl_kernel` and `torchvision` from CPU shims (CPU-lane scaffolding,
tests/sglang_cpu_shims): any call into them raises, so an extraction that needed them fails here."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from aerie.extract import work as extract_work
from aerie.extract.canary import reference_hidden_states
from aerie.extract.config import ExtractConfig
from aerie.manifest import load_manifest
from aerie.serving import ServerConfig
from aerie.serving.container import LABEL_SERVER
from aerie.shards.reader import ShardReader
from aerie.store import LocalStore
from tests.conftest import free_port
from tests.docker_support import SGLANG_CPU_IMAGE, WORKER_IMAGE, engine, require_image
from tests.extract_support import corpus_rows, write_corpus
from tests.stage_work import staged

extract = staged("extract", extract_work.run)

pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def client() -> Any:
    found = engine()
    require_image(found, WORKER_IMAGE)
    return found


def servers_of(client: Any, name: str) -> list[Any]:
    return client.containers.list(all=True, filters={"label": f"{LABEL_SERVER}={name}"})


def extract_in_a_container(
    tmp_path: Path, smollm2: Any, server: ServerConfig, batch_tokens: int
) -> tuple[Path, Any]:
    """The stage on a small corpus of the embedded target; its shards checked against the target's own
    hidden states; the stage's work dir returned."""
    store = LocalStore(tmp_path / "store")
    rows = corpus_rows(smollm2.load_tokenizer(), 6, seed=7)
    corpus = write_corpus(store, "dock", {"train": rows[:5], "eval": rows[5:]})
    work = tmp_path / "work"
    cfg = ExtractConfig(
        work_dir=str(work), dump_dir=str(work / "dumps"), shard_bytes=1 << 20, batch_tokens=batch_tokens
    )
    result = extract(cfg, store=store, run_name="dock", target=smollm2, corpus=corpus, server=server)

    assert result.figures["tokens"] == corpus.figures["tokens"] and result.figures["canary_passed"]
    manifest = load_manifest(store, result.prefix)
    assert manifest["layers"] == {"input_of_layer": [2, 15, 27], "output_of_layer": [1, 14, 26]}
    samples = {}
    for split, split_rows in (("train", rows[:5]), ("eval", rows[5:])):
        ids = []
        for entry in manifest["splits"][split]["shards"]:
            path = store.local_path(f"{result.prefix}/{entry['path']}")
            assert path is not None
            for sample in ShardReader(path, dtype=torch.float32):
                ids.append(sample.id)
                samples[sample.id] = sample
        assert ids == [r["id"] for r in split_rows]
    # The hidden states computed in the container are the target's (storage rounding aside).
    probe = rows[5]
    hs = reference_hidden_states(smollm2, probe["input_ids"])
    want = torch.cat([hs[i] for i in (2, 15, 27)], -1)
    got = samples[probe["id"]].aux_hidden
    assert float(((got - want).abs().amax(-1) / want.abs().amax(-1)).max()) < 0.08
    dumps = [p for p in (work / "dumps").rglob("*") if p.is_file()]
    assert dumps == []  # the client deleted every dump the container wrote (as root)
    return work, result


def started_containers(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("started extract-s0: ")]


def test_extract_stage_with_the_reference_server_in_the_worker_image(
    client: Any, tmp_path: Path, smollm2: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aerie.serving.container")
    server = ServerConfig(
        backend="reference",
        launcher="docker",
        image=WORKER_IMAGE,
        device="cpu",
        gpus=0,
        hf_cache=None,
        port=free_port(),
        memory_limit="4g",
        # A container's start beside the suite's other workers on two cores can outrun the default
        # deadline (import, weights); what is tested here is the container's work, not its start's speed.
        startup_timeout_s=600,
    )
    work, _ = extract_in_a_container(tmp_path, smollm2, server, batch_tokens=256)
    started = started_containers(caplog)
    assert len(started) == 1 and "container aerie-extract-s0-" in started[0]  # a container, not a process
    (log,) = work.rglob("server-s0-0.log")
    assert "max_prefill_tokens=256," in log.read_text()  # the container's own log reached the host file
    assert servers_of(client, "extract-s0") == []  # the container is gone


def test_extract_stage_with_sglang_in_the_cpu_sglang_image(
    client: Any, tmp_path: Path, smollm2: Any, caplog: pytest.LogCaptureFixture
) -> None:
    require_image(client, SGLANG_CPU_IMAGE)
    caplog.set_level(logging.INFO, logger="aerie.serving.container")
    server = ServerConfig(
        backend="sglang",
        launcher="docker",
        image=SGLANG_CPU_IMAGE,
        device="cpu",  # SGLang's CPU engine: spec_for adds its flags
        gpus=0,
        hf_cache=None,
        port=free_port(),
        memory_limit="8g",
        startup_timeout_s=600,
    )
    work, _ = extract_in_a_container(tmp_path, smollm2, server, batch_tokens=256)
    started = started_containers(caplog)
    assert len(started) == 1 and "container aerie-extract-s0-" in started[0]
    (log,) = work.rglob("server-s0-0.log")
    text = log.read_text()
    # SGLang's own start-up, and aerie's plugin capturing the drafter's layers inside it.
    assert "capturing the residual stream entering layers [2, 15, 27]" in text, text[-3000:]
    assert servers_of(client, "extract-s0") == []
