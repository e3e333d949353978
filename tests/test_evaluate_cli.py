"""`aerie evaluate`: a drafter directory measured on the user's own prompt files, no pipeline run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aerie.cli import main
from aerie.datasets import mtbench_path
from aerie.draft.export import export_drafter
from aerie.evaluate.standalone import prompt_set_for_file
from tests.evaluate_support import random_drafter

SETTINGS = ["evaluate.max_new_tokens=6", "evaluate.num_steps=[2]", "evaluate.proposers=[eagle3]"]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, smollm2):
    return export_drafter(random_drafter(smollm2), tmp_path_factory.mktemp("d") / "drafter", smollm2, {})


@pytest.fixture
def prompt_files(tmp_path):
    prompts = tmp_path / "support.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "a", "prompt": "Write a haiku about rain.", "category": "writing"},
                {"id": "b", "prompt": "What is 12 times 7?", "category": "math"},
            ]
        )
    )
    chats = tmp_path / "chats.jsonl"
    turns = [
        {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "I am a helpful assistant."},
        {"role": "user", "content": "Name three colours."},
    ]
    chats.write_text(json.dumps({"id": "c1", "messages": turns}) + "\n")
    mtbench = tmp_path / "bench.jsonl"
    mtbench.write_text("".join(mtbench_path().read_text().splitlines(keepends=True)[:2]))
    return prompts, chats, mtbench


def test_a_drafter_is_evaluated_on_prompt_files(drafter_dir, prompt_files, tmp_path, capsys):
    prompts, chats, mtbench = prompt_files
    out = tmp_path / "report.json"
    args = ["evaluate", "--drafter", str(drafter_dir), "--json", str(out)]
    for f in prompt_files:
        args += ["--prompts", str(f)]
    assert main([*args, *SETTINGS, "evaluate.temperatures=[0,1]"]) == 0
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if "acceptance length" in line]
    assert len(lines) == 3 * 2  # three files x two temperatures
    report = json.loads(out.read_text())
    assert report["prompts"] == {"support": 2, "chats": 2, "bench": 2}  # the chat's two user turns
    assert {(r["dataset"], r["temperature"]) for r in report["results"]} == {
        (d, t) for d in ("support", "chats", "bench") for t in (0.0, 1.0)
    }
    assert all(1.0 <= r["accept_length"] <= 3.0 for r in report["results"])
    for r in report["results"]:  # by position in the output: the buckets partition the verify rounds
        buckets = r["acceptance_by_position"]
        assert list(buckets) == ["0-512", "512-2K", "2K-8K", "8K+"]
        assert sum(b["rounds"] for b in buckets.values()) == r["spec_verify_ct"]
        assert buckets["0-512"]["accept_length"] == pytest.approx(r["accept_length"], abs=1e-3)
    groups = {(g["dataset"], g["group"]) for g in report["by_group"]}
    assert {("support", "writing"), ("support", "math")} <= groups


def test_file_kinds_are_told_by_their_first_record(prompt_files):
    prompts, chats, mtbench = prompt_files
    assert prompt_set_for_file(prompts).kind == "prompts"
    chat = prompt_set_for_file(chats)
    assert chat.kind == "conversations" and chat.source is not None
    assert (chat.source.role_field, chat.source.content_field) == ("role", "content")
    assert prompt_set_for_file(mtbench).kind == "mtbench"


def test_a_bad_prompt_file_is_named_with_its_line(drafter_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    assert main(["evaluate", "--drafter", str(drafter_dir), "--prompts", str(bad), *SETTINGS]) == 2
    assert f"{bad}:2: no prompt text in field 'prompt'" in capsys.readouterr().err
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"q": 1}) + "\n")
    assert main(["evaluate", "--drafter", str(drafter_dir), "--prompts", str(odd), *SETTINGS]) == 2
    assert "cannot tell what its records hold" in capsys.readouterr().err


# -- the drafter directory is checked before the target loads ----------------------------------------


def _copy(drafter_dir, tmp_path):
    import shutil

    return Path(shutil.copytree(drafter_dir, tmp_path / "copy"))


def _refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("damage", ["missing", "cut_in_half", "not_safetensors"])
def test_a_broken_drafter_is_refused_before_the_target_is_touched(
    drafter_dir, prompt_files, tmp_path, capsys, damage
):
    broken = _copy(drafter_dir, tmp_path)
    weights = broken / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    elif damage == "cut_in_half":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_text("<html>not weights</html>")
    # A target that does not exist: reaching it would fail otherwise, so the drafter is checked first.
    args = ["evaluate", "--drafter", str(broken), "--prompts", str(prompt_files[0]), *SETTINGS]
    err = _refused([*args, f"target.name={tmp_path / 'no-such-target'}"], capsys)
    expected = {
        "missing": f"drafter directory {broken} lacks ['model.safetensors']",
        "cut_in_half": f"{weights} is cut short",
        "not_safetensors": f"{weights} is not a readable safetensors file",
    }[damage]
    assert expected in err


def test_a_drafter_for_another_target_is_refused_unless_allowed(drafter_dir, prompt_files, tmp_path, capsys):
    other = _copy(drafter_dir, tmp_path)
    provenance = json.loads((other / "aerie.json").read_text())
    base = ["evaluate", "--drafter", str(other), "--prompts", str(prompt_files[0]), "--limit", "1", *SETTINGS]

    (other / "aerie.json").write_text(json.dumps({**provenance, "target": "Qwen/Qwen3-8B"}))
    err = _refused(base, capsys)
    assert "was trained for target 'Qwen/Qwen3-8B' (its aerie.json), not 'smollm2-135m-instruct'" in err
    assert "--allow-other-target" in err

    (other / "aerie.json").write_text(json.dumps({**provenance, "target_revision": "0123abcd"}))
    err = _refused(base, capsys)
    assert "at revision 0123abcd (its aerie.json)" in err and "target.revision=0123abcd" in err

    # The explicit override measures it anyway (same shapes: the weights fit this target).
    assert main([*base, "--allow-other-target"]) == 0
    assert "acceptance length" in capsys.readouterr().out
