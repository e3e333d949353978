"""The extraction stage through real SGLang on this CPU (the process launcher, SGLang's own environment,
aerie's dump plugin), on the embedded default's corpus (a few ShareGPT conversations merged by the corpus
stage, as the pipeline builds it):

- fp8 storage, the canary's numeric check against a transformers forward passing;
- the SGLang server SIGKILLed once it is extracting: the stage restarts it and still ends with every
  corpus sample exactly once, in order, holding exactly the corpus's tokens and loss masks;
- the hidden states agree with the reference server's shards of the same samples (bf16 there) within
  fp8's tolerance; the largest relative error is printed and kept as a test property;
- no CPU shim was called in the whole run.

One SGLang scenario: each start of SGLang costs a minute or two here."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aerie.extract import work
from aerie.extract.config import ExtractConfig
from aerie.manifest import StageResult, load_manifest
from aerie.serving import ServerConfig
from aerie.shards.format import HiddenSample
from aerie.shards.reader import ShardReader
from aerie.store import ArtifactStore, LocalStore
from tests.evaluate_support import corpus_result
from tests.extract_support import KillServer
from tests.processes import free_port
from tests.sglang_support import cpu_config, shim_calls
from tests.stage_work import staged

run = staged("extract", work.run)

# Two extractions, one through SGLang with a kill and a restart: three server starts, 2.5 minutes on a
# 2-core machine multiplying fp32 matrices at 165 GFLOPS, over 10 minutes on one at 48.
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

# A sample's states: per token, the largest error over the row's largest magnitude. fp8 (e4m3, a scale
# per token) rounds each value to within 2^-4 of the row's largest; the rest (SGLang's fp16 forward
# against the reference server's float32, and bf16 storage) adds about 1e-3.
FP8_TOLERANCE = 0.08
CAPTURED = [2, 15, 27]


def corpus_rows(store: ArtifactStore, corpus: StageResult) -> dict[str, list[dict[str, Any]]]:
    import polars as pl

    rows: dict[str, list[dict[str, Any]]] = {}
    for split, body in load_manifest(store, corpus.prefix)["splits"].items():
        frames = [pl.read_parquet(store.local_path(shard["key"])) for shard in body["shards"]]
        rows[split] = pl.concat(frames).to_dicts() if frames else []
    return rows


def stored_samples(store: ArtifactStore, result: StageResult) -> dict[str, list[HiddenSample]]:
    """Every stored sample per split, in shard order, states as float32."""
    manifest = load_manifest(store, result.prefix)
    out: dict[str, list[HiddenSample]] = {}
    for split, body in manifest["splits"].items():
        out[split] = []
        for entry in body["shards"]:
            path = store.local_path(f"{result.prefix}/{entry['path']}")
            reader = ShardReader(path, dtype=torch.float32)
            assert reader.tokens == entry["tokens"] and len(reader) == entry["samples"]
            out[split].extend(reader)
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs().amax(-1) / want.abs().amax(-1)).max())


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, smollm2) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sglang-extract")
    store = LocalStore(tmp / "store")
    corpus = corpus_result(store, "c", smollm2, n=8)
    common = {"shard_bytes": 1 << 20, "batch_tokens": 256, "requests_in_flight": 1, "dump_timeout_s": 120}
    reference = run(
        # Its canary's own numeric check is not what this module tests.
        ExtractConfig(
            storage_dtype="bf16", work_dir=str(tmp / "ref-work"), canary_reference="never", **common
        ),
        store=store,
        run_name="ref",
        target=smollm2,
        corpus=corpus,
        server=ServerConfig(backend="reference", device="cpu", port=free_port()),
    )
    port = free_port()
    calls = tmp / "shim-calls"
    kill = KillServer(port, 0.0)  # at the first progress report once the server is extracting
    result = run(
        ExtractConfig(storage_dtype="fp8", work_dir=str(tmp / "work"), max_restarts=1, **common),
        store=store,
        run_name="sgl",
        target=smollm2,
        corpus=corpus,
        server=cpu_config(port, calls),
        progress=kill,
    )
    return {
        "store": store,
        "rows": corpus_rows(store, corpus),
        "reference": reference,
        "result": result,
        "killed": kill.killed,
        "shim_calls": shim_calls(calls),
    }


def test_the_canary_checks_sglang_against_transformers(extracted) -> None:
    manifest = load_manifest(extracted["store"], extracted["result"].prefix)
    canary = manifest["canary"]
    assert canary["numeric"] is not None, "the numeric check against transformers did not run"
    assert [b["best"] for b in canary["numeric"]["blocks"]] == CAPTURED
    assert canary["greedy_token"] == canary["lm_head_token"]
    assert manifest["storage_dtype"] == "fp8"
    assert manifest["layers"] == {"input_of_layer": CAPTURED, "output_of_layer": [1, 14, 26]}


def test_a_killed_server_is_restarted_and_every_sample_is_stored_once(extracted) -> None:
    result, rows = extracted["result"], extracted["rows"]
    assert len(extracted["killed"]) == 1 and result.figures["server_restarts"] == 1
    stored = stored_samples(extracted["store"], result)
    assert set(stored) == set(rows)
    for split, samples in stored.items():
        assert [s.id for s in samples] == [r["id"] for r in rows[split]]
        for sample, row in zip(samples, rows[split], strict=True):
            assert sample.input_ids.tolist() == list(row["input_ids"])
            assert sample.loss_mask.tolist() == [bool(m) for m in row["loss_mask"]]
        assert result.figures[f"{split}_tokens"] == sum(len(r["input_ids"]) for r in rows[split])
    assert result.figures["samples"] == sum(len(r) for r in rows.values())
    assert extracted["shim_calls"] == []


def test_sglang_states_agree_with_the_reference_server(extracted, record_property) -> None:
    store = extracted["store"]
    mine = {s.id: s for split in stored_samples(store, extracted["result"]).values() for s in split}
    theirs = {s.id: s for split in stored_samples(store, extracted["reference"]).values() for s in split}
    assert mine.keys() == theirs.keys()
    aux = max(rel_err(mine[i].aux_hidden, theirs[i].aux_hidden) for i in mine)
    last = max(rel_err(mine[i].last_hidden, theirs[i].last_hidden) for i in mine)
    record_property("max_rel_err_aux", aux)
    record_property("max_rel_err_last", last)
    print(
        f"SGLang fp8 vs reference server bf16, {len(mine)} samples: max relative error aux {aux:.4f}, last {last:.4f}"
    )
    assert aux < FP8_TOLERANCE and last < FP8_TOLERANCE, (aux, last)
    assert aux > 0  # two different engines, and fp8 against bf16: equal bytes would mean one was copied
