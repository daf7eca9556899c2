"""Pure sharding arithmetic for FSDP2: sizes, padding and offsets, with no process group.

[Note: chunk sharding]
A parameter is split along its shard dim ``d`` the way ``torch.chunk(t, world_size, d)`` splits
it: every chunk has ``ceil(size[d] / world_size)`` rows except the tail, and ranks past the last
non-empty chunk get an *empty* chunk. An empty chunk keeps every other dim (size ``0`` at ``d``),
so shape arithmetic stays uniform. Chunk 0 is always the largest, so its size is the *padded*
shard size: every rank stores its shard in a buffer of that size, zero-filled past its data. Rank
``r``'s rows start at ``r * ceil(size[d] / world_size)`` in the original (when non-empty).

These functions take plain ints and tuples so that they can be property-tested without a process
group; ``FSDPParam`` takes its ``sharded_size`` / ``padded_sharded_param_size`` from them. (A
zero-numel parameter such as ``(4, 0)`` follows the same rule: ``(2, 0)`` per rank at world size 2;
upstream 2.13 reports ``(0, 0)`` there because it tests the chunk's numel.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def chunk_dim_sizes(dim_size: int, world_size: int) -> list[int]:
    """Return the length along the shard dim of each rank's chunk (``torch.chunk`` rule).

    ``torch.chunk`` uses ``step = ceil(dim_size / world_size)`` and may return fewer than
    ``world_size`` chunks; missing trailing chunks are empty (length 0).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    step = math.ceil(dim_size / world_size) if dim_size > 0 else 0
    sizes = []
    for rank in range(world_size):
        start = rank * step
        sizes.append(max(0, min(step, dim_size - start)))
    return sizes


def sharded_size(size: Sequence[int], world_size: int, rank: int, dim: int = 0) -> tuple[int, ...]:
    """The shape of ``rank``'s shard: the original shape with dim ``dim`` replaced by its chunk."""
    out = list(size)
    out[dim] = chunk_dim_sizes(size[dim], world_size)[rank]
    return tuple(out)


def padded_sharded_size(size: Sequence[int], world_size: int, dim: int = 0) -> tuple[int, ...]:
    """The shape every rank's padded shard buffer has: chunk 0's shape."""
    return sharded_size(size, world_size, 0, dim)


def shard_offset(size: Sequence[int], world_size: int, rank: int, dim: int = 0) -> int:
    """Index along ``dim`` of the original where ``rank``'s chunk starts (for non-empty chunks)."""
    return rank * padded_sharded_size(size, world_size, dim)[dim]


def padded_numel(size: Sequence[int], world_size: int, dim: int = 0) -> int:
    """Elements in one rank's padded shard buffer (the per-rank all-gather input numel)."""
    return math.prod(padded_sharded_size(size, world_size, dim))


def dim0_padded_size(size: Sequence[int], world_size: int) -> tuple[int, ...]:
    """``size`` with dim 0 rounded up to a multiple of ``world_size`` (reduce-scatter input)."""
    return (math.ceil(size[0] / world_size) * world_size, *size[1:])


def contiguous_strides(size: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of ``size`` (size-0/1 dims get stride 1 rules)."""
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
