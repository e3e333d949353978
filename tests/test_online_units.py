"""Online training's decisions without servers: `train.source` checked at load, `auto` decided by the
plan in the composer (a disk too small for the shards chooses online), the extract stage left out of an
online run, and how several servers and data-parallel ranks share the work."""

from __future__ import annotations

from dataclasses import replace

import pytest

from aerie.errors import ConfigError
from aerie.pipeline import choose_source, planned
from aerie.plan import make_plan
from aerie.presets import load_config
from aerie.train.online import rank_batches, rank_servers, server_gpus


def _short_disk(plan):
    """The plan with every location holding the shards short by half of them (as test_plan_online)."""
    locations = [
        replace(loc, free=loc.need - loc.parts.get("shards", 0) - loc.parts.get("local shards", 0) // 2)
        if loc.parts.get("shards") or loc.parts.get("local shards")
        else loc
        for loc in plan.disk.locations
    ]
    return replace(plan, disk=replace(plan.disk, locations=locations))


def test_source_is_checked_at_load():
    assert load_config("smollm2-local", ["train.source=online"]).train.source == "online"
    with pytest.raises(ConfigError, match="train.source"):
        load_config("smollm2-local", ["train.source=disk"])
    with pytest.raises(ConfigError, match="buffer_tokens"):
        load_config("smollm2-local", ["train.online.buffer_tokens=0"])


def test_auto_follows_the_plan_and_a_short_disk_chooses_online(roomy_disk):
    cfg = load_config("smollm2-local", ["train.source=auto"])
    plan = make_plan(cfg)
    assert choose_source(cfg, _short_disk(plan)).train.source == "online"
    kimi = load_config("kimi-k2.5-8gpu", ["train.source=auto"])
    assert choose_source(kimi, make_plan(kimi)).train.source == "shards"  # the plan recommends shards there
    assert choose_source(cfg, None).train.source == "shards"  # no plan: as before there was a choice
    fixed = load_config("smollm2-local", ["train.source=online"])
    assert choose_source(fixed, _short_disk(plan)) is fixed


def test_an_online_run_has_no_extract_stage_and_auto_never_reaches_training():
    names = [s.name for s in planned(load_config("smollm2-local", ["train.source=online"]))]
    assert "extract" not in names and names.index("train") == names.index("merge") + 1
    assert "extract" in [s.name for s in planned(load_config("smollm2-local", []))]
    from aerie.train.work import key_of

    cfg = load_config("smollm2-local", ["train.source=auto"]).train
    with pytest.raises(ConfigError, match="undecided"):
        key_of(cfg, None, None, None)  # type: ignore[arg-type]


def test_each_rank_runs_its_own_servers_on_the_gpus_after_the_trainers():
    assert [list(rank_servers(2, r)) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    # 4 trainer GPUs, servers of 2 GPUs each: server 0 on 4,5, server 3 on 10,11.
    assert server_gpus(4, 0, 2) == "4,5" and server_gpus(4, 3, 2) == "10,11"
    assert server_gpus(0, 1, 1) == "1"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_take_every_batch_exactly_once(world):
    steps = 7
    taken = sorted(b for rank in range(world) for b in rank_batches(5 * world + rank, world, steps))
    assert taken == list(
        range(5 * world, 5 * world + steps * world)
    )  # resumed at step 5, each rank its share


def test_the_loader_gives_up_waiting_once_asked_to_stop_and_ends_every_later_call():
    """The trainer's wait for a row that is not coming (a server starting, restarting) ends as soon as a
    stop is asked; a loader that ran out says so to every later call instead of waiting."""
    import threading

    from aerie.train.data import Prefetcher

    release = threading.Event()

    def late():  # a source whose first row never comes until released
        release.wait()
        yield from ()

    asked: list[int] = []
    waiting = Prefetcher(late(), depth=2)
    threading.Timer(0.2, asked.append, args=(15,)).start()
    assert waiting.next_unless(lambda: bool(asked)) is None
    release.set()
    waiting.close()

    done = Prefetcher(iter([]), depth=1)
    for _ in range(2):
        with pytest.raises(StopIteration):
            done.next_unless(lambda: False)
    done.close()
