"""The hardware part of a result file's name, `<benchmark>-<hardware>.json`: `cpu`, or the GPU's model
in lower case (`NVIDIA H200` -> `h200`)."""

from __future__ import annotations


def hardware_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else 0
    model = torch.cuda.get_device_name(index).lower()
    return model.removeprefix("nvidia ").split()[0].replace("-", "")
