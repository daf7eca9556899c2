"""Shape sets and the model every benchmark shards.

Three shape sets, each scaled to a target number of parameter bytes (fp32):

* ``large``  — four large parameters ``(rows, 1024)``: the bandwidth-bound case;
* ``small``  — many 16 KiB parameters ``(32, 128)``: the per-parameter-overhead case;
* ``uneven`` — dims that do not divide the world size: ``(17, 257)``, ``(3, 1001)`` (dim 0 below
  world size 4), ``(2, 7)``, ``(13,)`` and one large ``(odd, 129)`` that carries the bulk.

Values are a deterministic function of (parameter index, element index), so every rank builds the
same originals without communicating, and a check can recompute what any rank should hold.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SHAPE_SETS = ("large", "small", "uneven")
MiB = 1 << 20
ELEM = 4  # fp32 bytes


def shapes(shape_set: str, size_mb: float) -> list[tuple[int, ...]]:
    numel = int(size_mb * MiB) // ELEM
    if shape_set == "large":
        rows = max(1, numel // (4 * 1024))
        return [(rows, 1024)] * 4
    if shape_set == "small":
        return [(32, 128)] * max(1, numel // (32 * 128))
    if shape_set == "uneven":
        fixed = [(17, 257), (3, 1001), (2, 7), (13,)]
        rest = max(1, numel - sum(math.prod(s) for s in fixed))
        rows = (rest // 129) | 1  # odd
        return [*fixed, (rows, 129)]
    raise ValueError(f"unknown shape set {shape_set!r} (known: {SHAPE_SETS})")


def original(i: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Parameter ``i``'s original value: distinct per element and per parameter, exact in fp32."""
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float32).remainder_(4093) + 0.25 * (i % 7) + 1).view(shape)


class Bag(nn.Module):
    """A module that only holds parameters ``p0, p1, ...`` (no forward is needed)."""

    def __init__(self, shape_list, device="cpu", values=None):
        """``values``: the originals already made (copies of them are registered: fresh memory
        without recomputing them)."""
        super().__init__()
        for i, shape in enumerate(shape_list):
            value = values[i].clone() if values is not None else original(i, shape).to(device)
            self.register_parameter(f"p{i}", nn.Parameter(value))

    def forward(self, x):  # pragma: no cover - the benchmarks never run forward
        return x


def dim0_padded_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Per-rank padded numel of a dim-0 shard: ``ceil(dim0 / ws) * prod(shape[1:])``."""
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def payload(shape_list, world_size: int) -> dict:
    """Unpadded bytes, per-parameter dim-0 padded bytes (all ranks) and their ratio."""
    unpadded = sum(math.prod(s) for s in shape_list) * ELEM
    padded = sum(dim0_padded_numel(s, world_size) for s in shape_list) * world_size * ELEM
    return {
        "unpadded_bytes": unpadded,
        "padded_bytes": padded,
        "payload_efficiency": unpadded / padded,
        "num_params": len(shape_list),
    }
