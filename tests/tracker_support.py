"""Reading back what aerie's trackers wrote, with each tracker's own reader: TensorBoard's event
accumulator, an MLflow client on the local sqlite store, and W&B's offline run file (a record log of
W&B's protobuf records, the format `wandb sync` uploads)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

# W&B's offline run file: a 7-byte file header, then 32 KiB blocks of records, each record a 7-byte
# header (crc32c, little-endian length, type) and its data; a record too long for its block is split
# (FIRST, MIDDLE..., LAST). The layout of LevelDB's log, which W&B's datastore follows.
_BLOCK, _HEADER, _FILE_HEADER = 32768, 7, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag of a TensorBoard run directory: step -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def tensorboard_texts(log_dir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    return [
        value.decode()
        for tag in events.Tags()["tensors"]
        for e in events.Tensors(tag)
        for value in e.tensor_proto.string_val
    ]


def mlflow_runs(db: Path, experiment: str) -> dict[str, Any]:
    """The MLflow runs of an experiment in a sqlite store, by their `aerie.stage` tag."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} in {db}"
    return {run.data.tags["aerie.stage"]: run for run in client.search_runs([found.experiment_id])}


def mlflow_history(db: Path, run_id: str, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def wandb_offline_run(run_file: Path) -> dict[str, Any]:
    """An offline W&B run file parsed: its history rows (key -> value) and its config updates."""
    from wandb.proto import wandb_internal_pb2 as pb

    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    for data in _records(run_file.read_bytes()):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    return {"history": history, "config": config}


def _records(raw: bytes) -> list[bytes]:
    assert raw[:4] == b":W&B", "not a W&B run file"
    out: list[bytes] = []
    pending = b""
    pos = _FILE_HEADER
    while pos + _HEADER <= len(raw):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # the block's tail is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + _HEADER])
        data = raw[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(data)
        elif kind == _FIRST:
            pending = data
        elif kind == _MIDDLE:
            pending += data
        elif kind == _LAST:
            out.append(pending + data)
            pending = b""
        elif kind == 0 and length == 0:  # zero padding
            continue
    return out
