"""Pure sharding arithmetic for FSDP2: sizes, padding and offsets, with no process group.

[Note: chunk sharding]
A parameter is split along its shard dim ``d`` as ``torch.chunk(t, world_size, d)`` splits it:
every chunk has ``ceil(size[d] / world_size)`` rows except the tail, and ranks past the last
non-empty chunk get an *empty* chunk (size ``0`` at ``d``, every other dim kept). Chunk 0 is the
largest, so its size is the *padded* shard size: every rank stores its shard in a buffer of that
size, zero past its data. Rank ``r``'s rows start at ``r * ceil(size[d] / world_size)``.
(A zero-numel parameter such as ``(4, 0)`` follows the same rule, ``(2, 0)`` per rank at world
size 2; upstream 2.13 reports ``(0, 0)`` there because it tests the chunk's numel.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def chunk_dim_sizes(dim_size: int, world_size: int) -> list[int]:
    """Each rank's chunk length along the shard dim; ranks past the last chunk get 0."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    step = math.ceil(dim_size / world_size)
    return [max(0, min(step, dim_size - rank * step)) for rank in range(world_size)]


def sharded_size(size: Sequence[int], world_size: int, rank: int, dim: int = 0) -> tuple[int, ...]:
    """The shape of ``rank``'s shard: the original shape with dim ``dim`` replaced by its chunk."""
    out = list(size)
    out[dim] = chunk_dim_sizes(size[dim], world_size)[rank]
    return tuple(out)


def padded_sharded_size(size: Sequence[int], world_size: int, dim: int = 0) -> tuple[int, ...]:
    """The shape of every rank's padded shard buffer: chunk 0's shape."""
    return sharded_size(size, world_size, 0, dim)


def shard_offset(size: Sequence[int], world_size: int, rank: int, dim: int = 0) -> int:
    """Index along ``dim`` of the original where ``rank``'s chunk starts (if non-empty)."""
    return rank * padded_sharded_size(size, world_size, dim)[dim]


def padded_numel(size: Sequence[int], world_size: int, dim: int = 0) -> int:
    """Elements in one rank's padded shard buffer (the per-rank all-gather input numel)."""
    return math.prod(padded_sharded_size(size, world_size, dim))


def dim0_padded_size(size: Sequence[int], world_size: int) -> tuple[int, ...]:
    """``size`` with dim 0 rounded up to a multiple of ``world_size`` (reduce-scatter input)."""
    return (math.ceil(size[0] / world_size) * world_size, *size[1:])


def contiguous_strides(size: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of ``size`` (a size-0 dim counts as 1)."""
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
