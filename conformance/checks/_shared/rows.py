"""The rows rule, written once: which part of a dimension (or of a flat buffer) rank r holds.

FSDP splits a dimension of size ``d`` over ``parts`` ranks as ``torch.chunk`` does: every rank gets
``ceil(d / parts)`` entries except the tail, and ranks past the last chunk get none (an *empty*
chunk; size 0 on that dim, every other dim kept). Rank ``r``'s entries start at
``r * ceil(d / parts)``. FSDP2 applies it to the shard dim of each parameter (rows of dim 0 unless
``shard_placement_fn`` picks another), FSDP1 to the elements of each flat parameter. Checks derive
every expected shard from these functions, never from the implementation under test.
"""

from __future__ import annotations

import math

import torch


def chunk_size(size: int, parts: int) -> int:
    """Entries per rank (the padded chunk): ``ceil(size / parts)``, 0 for an empty dimension."""
    return math.ceil(size / parts) if size else 0


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of the entries chunk ``index`` of ``parts`` holds (``start == end``: none)."""
    step = chunk_size(size, parts)
    return min(index * step, size), min((index + 1) * step, size)


def flat_range(numel: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(start, end, chunk) of the elements of a flat buffer of ``numel`` that ``rank`` holds."""
    return (*chunk_range(numel, world_size, rank), chunk_size(numel, world_size))


def chunk_of(full: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``full`` split into ``parts`` along ``dim`` (a view; possibly empty)."""
    start, end = chunk_range(full.shape[dim], parts, index)
    return full.narrow(dim, start, end - start)
