"""Choosing the device and backend for a world size."""

from __future__ import annotations

import torch

CPU_WORLD_SIZES = (1, 2, 3, 4)
GPU_WORLD_SIZES = (1, 2, 4, 8)


def accelerator_count(device_type: str) -> int:
    if device_type == "cpu":
        return 0
    module = getattr(torch, device_type, None)
    return module.device_count() if module is not None and module.is_available() else 0


def choose(
    world_size: int, device: str | None = None, backend: str | None = None
) -> tuple[str, str]:
    """``(device, backend)`` for ``world_size`` ranks.

    Auto: CUDA + NCCL when there are at least ``world_size`` CUDA devices, else CPU + gloo. An explicit
    ``device`` (``cpu``, ``cuda``, ``hpu``, ``xpu``, ...) picks its default backend from
    ``torch.distributed`` unless ``backend`` is given too.
    """
    if device is None:
        device = "cuda" if accelerator_count("cuda") >= world_size else "cpu"
    if backend is None:
        backend = _default_backend(device)
    return device, backend


def _default_backend(device: str) -> str:
    if device == "cpu":
        return "gloo"
    try:
        from torch.distributed import Backend

        return Backend.default_device_backend_map[device]
    except (ImportError, KeyError):
        return {"cuda": "nccl", "xpu": "xccl", "hpu": "hccl"}.get(device, "gloo")


def default_world_sizes(device: str | None = None) -> list[int]:
    """1-4 on CPU; 1, 2, 4, 8 capped at the device count on accelerators."""
    device = device or ("cuda" if accelerator_count("cuda") > 0 else "cpu")
    count = accelerator_count(device)
    if device == "cpu" or count == 0:
        return list(CPU_WORLD_SIZES)
    return [ws for ws in GPU_WORLD_SIZES if ws <= count]
