"""Extraction captures the layers the drafter family names: k layers for DFlash, EAGLE-3's three
unchanged (its shards, stage keys and disk figures as they were)."""

from __future__ import annotations

import pytest
import torch

from aerie.errors import ExtractionError
from aerie.extract import preflight
from aerie.extract.config import ExtractConfig
from aerie.extract.fleet import _server_args, _server_env
from aerie.extract.plan import extract_key
from aerie.extract.stage import extract_config
from aerie.manifest import StageResult, stage_key
from aerie.plan.disk import aux_layers, dumps_in_flight_bytes, shard_bytes_per_token
from aerie.plan.facts import target_facts
from aerie.presets import load_config
from aerie.serving import ServerConfig
from aerie.sglang_plugin.capture import AUX_LAYERS_ENV
from aerie.sglang_plugin.dumps import check_dump
from aerie.shards.format import HiddenSample
from aerie.shards.reader import ShardReader
from aerie.shards.schema import SHARD_SCHEMA_VERSION, bytes_per_token
from aerie.shards.writer import ShardWriter

H = 32
DFLASH = ["train.drafter=dflash", "train.drafter.num_target_layers=5", "deploy.enabled=false"]


def sample(i: int, t: int, layers: int) -> HiddenSample:
    g = torch.Generator().manual_seed(i)
    scale = torch.arange(1, layers + 1, dtype=torch.float32).repeat_interleave(H)
    return HiddenSample(
        id=f"s{i}",
        input_ids=torch.randint(0, 1000, (t,), generator=g),
        loss_mask=torch.ones(t, dtype=torch.bool),
        aux_hidden=(torch.randn(t, layers * H, generator=g) * scale).bfloat16(),
        last_hidden=torch.randn(t, H, generator=g).bfloat16(),
    )


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_a_five_layer_shard_round_trips_and_costs_what_the_schema_says(tmp_path, storage) -> None:
    samples = [sample(i, t, 5) for i, t in enumerate([9, 20, 3])]
    writer = ShardWriter(tmp_path, storage=storage, shard_bytes=1 << 30, hidden_size=H, aux_layers=5)
    assert all(writer.add(s) is None for s in samples)
    info = writer.close()
    assert info is not None
    header = 8 + int.from_bytes(info.path.read_bytes()[:8], "little")
    assert info.bytes - header == info.tokens * bytes_per_token(storage, H, None, 5) + 8 * (len(samples) + 1)
    for want, got in zip(samples, ShardReader(info.path, dtype=torch.float32), strict=True):
        assert got.aux_hidden.shape == (want.tokens, 5 * H)
        tol = 0 if storage == "bf16" else 0.07  # fp8: per-layer scales keep each layer within 2^-4
        torch.testing.assert_close(got.aux_hidden, want.aux_hidden.float(), rtol=tol, atol=tol * 5)


def test_a_writer_refuses_samples_of_another_layer_count(tmp_path) -> None:
    writer = ShardWriter(tmp_path, storage="bf16", shard_bytes=1 << 30, hidden_size=H, aux_layers=5)
    with pytest.raises(ExtractionError, match=r"aux_hidden has shape \(4, 96\), expected \(4, 160\)"):
        writer.add(sample(0, 4, 3))


def test_dumps_of_any_whole_number_of_layers_pass_the_dump_check() -> None:
    s = sample(0, 6, 5)
    tensors = {"input_ids": s.input_ids.int(), "aux_hidden": s.aux_hidden, "last_hidden": s.last_hidden}
    assert check_dump(tensors, "d.safetensors") is tensors
    with pytest.raises(ValueError, match="shapes do not agree"):
        check_dump({**tensors, "aux_hidden": s.aux_hidden[:, : 2 * H + 1]}, "d.safetensors")


def test_the_pipeline_fills_in_the_family_layers_and_eagle3_keys_stay(smollm2) -> None:
    corpus = StageResult.model_construct(manifest_sha256="c" * 64, prefix="run/corpus/k")
    server = ServerConfig()
    eagle = load_config("smollm2-local", [])
    dflash = load_config("smollm2-local", DFLASH)
    assert (
        extract_config(eagle, smollm2).capture_layers == smollm2.aux_layers_output
    )  # EAGLE-3's, filled in too
    assert extract_config(dflash, smollm2).capture_layers == [1, 8, 14, 21, 27]
    assert extract_config(dflash, smollm2).layers_input(smollm2) == [2, 9, 15, 22, 28]
    # The key an EAGLE-3 extraction had before the family existed, written out.
    ex = eagle.extract
    before = {
        "extract": {**ex.model_dump(mode="json", include={"storage_dtype", "shard_bytes", "splits"}),
                    "num_servers": ex.num_servers},
        "shard_schema_version": SHARD_SCHEMA_VERSION,
        "server_backend": server.backend,
        "target": smollm2.name,
        "target_revision": smollm2.revision,
    }  # fmt: skip
    old = stage_key("extract", before, [corpus.manifest_sha256])
    assert extract_key(extract_config(eagle, smollm2), server, smollm2, corpus) == old
    named = ex.model_copy(update={"capture_layers": smollm2.aux_layers_output})
    assert extract_key(named, server, smollm2, corpus) == old  # EAGLE-3's layers named: the same shards
    assert extract_key(extract_config(dflash, smollm2), server, smollm2, corpus) != old


def test_servers_are_told_the_layers_in_their_own_convention(smollm2) -> None:
    ex = extract_config(load_config("smollm2-local", DFLASH), smollm2)
    reference, sglang = ServerConfig(), ServerConfig(backend="sglang")
    args = _server_args(reference, ex, smollm2)
    assert args[args.index("--aux-layers") + 1 :][:5] == ["2", "9", "15", "22", "28"]  # input-of-layer
    assert _server_env(sglang, ex, smollm2) == {AUX_LAYERS_ENV: "1,8,14,21,27"}  # output-of-layer
    eagle = ExtractConfig()
    assert "--aux-layers" not in _server_args(reference, eagle, smollm2)
    assert _server_env(sglang, eagle, smollm2) == {}


def test_disk_figures_follow_the_layer_count(smollm2) -> None:
    for overrides, layers in (([], 3), (DFLASH, 5)):
        cfg = load_config("smollm2-local", overrides)
        facts = target_facts(cfg.target)
        assert aux_layers(cfg, facts) == layers
        ex = extract_config(cfg, smollm2)
        assert ex.aux_layers == layers
        for storage in ("bf16", "fp8"):
            assert shard_bytes_per_token(storage, H, 49152, layers) == bytes_per_token(
                storage, H, 49152, layers
            )
        assert dumps_in_flight_bytes(cfg, facts) == preflight.dumps_in_flight_bytes(
            ex, facts.geometry.hidden_size, facts.geometry.vocab_size
        )
    assert bytes_per_token("bf16", H, 49152, 5) - bytes_per_token("bf16", H, 49152) == 2 * 2 * H


def test_the_planner_counts_a_dflash_drafter_s_parameters(smollm2) -> None:
    from aerie.plan.disk import drafter_params
    from aerie.train.dflash_objective import DFlashObjective

    cfg = load_config("smollm2-local", [*DFLASH, "train.drafter.num_layers=2"])
    drafter = DFlashObjective(cfg.train).drafter(smollm2, smollm2.geometry.vocab_size)
    matrices = sum(p.numel() for p in drafter.parameters() if p.dim() == 2)
    assert drafter_params(cfg, target_facts(cfg.target)) == matrices


def test_the_run_config_is_resolved_once_and_each_stage_reads_its_own_section(smollm2) -> None:
    from aerie.evaluate.stage import evaluate_config
    from aerie.generate.stage import generate_config
    from aerie.pipeline import resolve

    cfg = load_config("smollm2-local", DFLASH)
    resolved = resolve(cfg, smollm2, None)
    assert resolved.extract == extract_config(cfg, smollm2)
    assert resolved.extract.capture_layers == [
        1,
        8,
        14,
        21,
        27,
    ]  # what the family reads, in extract's section
    assert resolved.evaluate == evaluate_config(cfg)
    assert resolved.generate == generate_config(cfg)
    assert resolved.generate.datasets[0].max_context_tokens == cfg.corpus.max_length
    assert resolve(resolved, smollm2, None) == resolved  # resolving again changes nothing
    assert cfg.extract.capture_layers is None  # the loaded config is left as it was
