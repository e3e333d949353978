"""The plan's offline/online comparison: shard bytes against the GPU time of extracting every epoch."""

from __future__ import annotations

from dataclasses import replace

from aerie.plan import make_plan, online
from aerie.plan.render import table
from aerie.presets import load_config


def test_kimi_plan_prints_the_comparison_with_its_numbers(roomy_disk):
    plan = make_plan(load_config("kimi-k2.5-8gpu", []))
    c = online.of_plan(plan)
    extract, train = plan.stage("extract"), plan.stage("train")
    assert extract is not None and train is not None
    assert c.shard_bytes == plan.disk.shard_bytes == c.s3_bytes > 0
    # Ten epochs re-extract the train split ten times, plus the held-out split at every evaluation.
    assert c.online_extract_tokens >= plan.sizes.train_tokens and c.extractions > plan.cfg.train.epochs / 2
    assert c.offline_gpu_s == extract.gpu_seconds + train.gpu_seconds
    assert c.online_gpu_s > c.offline_gpu_s and c.choice == "shards"
    text = table(plan)
    assert "recommended: shards" in text and "GB of shards" in text


def test_a_disk_that_cannot_hold_the_shards_recommends_online():
    plan = make_plan(load_config("smollm2-local", []))
    locations = [
        replace(loc, free=loc.need - loc.parts.get("shards", 0) - loc.parts.get("local shards", 0) // 2)
        if loc.parts.get("shards") or loc.parts.get("local shards")
        else loc
        for loc in plan.disk.locations
    ]
    short = replace(plan, disk=replace(plan.disk, locations=locations))
    c = online.of_plan(short)
    assert c.short and c.choice == "online" and "cannot hold the shards" in c.reason


def test_one_epoch_recommends_online_when_it_costs_no_more():
    plan = make_plan(load_config("smollm2-local", ["train.epochs=1", "train.eval_every=100000"]))
    c = online.of_plan(plan)
    assert 0.9 <= c.extractions <= 1.2
    assert c.choice == ("online" if c.online_cost - c.offline_cost <= 0.1 * c.offline_cost else "shards")
    assert f"{c.extractions:.1f}x the corpus" in c.reason


def test_an_online_run_plans_no_shards_and_a_disk_short_only_for_them_is_no_refusal(monkeypatch):
    from aerie.errors import NotEnoughDiskError
    from aerie.pipeline import choose_source
    from aerie.plan import disk

    def plan(source):
        return make_plan(load_config("smollm2-local", [f"train.source={source}"]))

    online_need = sum(loc.need for loc in plan("online").disk.locations)
    shards = plan("shards").disk.shard_bytes
    # One filesystem for everything, with room for the online run and half the shards.
    monkeypatch.setattr(disk, "_free", lambda path: (1, online_need + shards // 2))
    offline, on, auto = plan("shards"), plan("online"), plan("auto")

    assert on.disk.shard_bytes == 0 and not any(
        n for loc in on.disk.locations for p, n in loc.parts.items() if "shards" in p
    )
    assert [type(r) for r in offline.refusals] == [NotEnoughDiskError] and "shards" in str(
        offline.refusals[0]
    )
    assert on.refusals == [] and auto.refusals == []
    assert choose_source(auto.cfg, auto).train.source == "online"
    # The online plan still compares with offline on the same disk: the shards it would not hold.
    c = online.of_plan(on)
    assert c.shard_bytes == shards and c.short and c.choice == "online"
