"""Pure layout arithmetic of the flat parameter (no tensors of a model, no process group).

Vocabulary: see ``[Note: flat-parameter vocabulary]`` in :mod:`reference._fsdp1._flat_param`. These are
the rules the property tests check against ``torch.chunk`` and the 16-byte alignment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

_ALIGNMENT_BYTES = 16


class ParamInfo(NamedTuple):
    """Where an original parameter lives: ``module_name`` + "." + ``param_name`` is its FQN
    relative to the wrapped module."""

    param_name: str
    module: nn.Module
    module_name: str


class SharedParamInfo(NamedTuple):
    """A second (or later) name of a parameter already flattened under ``prim_*``."""

    param_name: str
    module: nn.Module
    module_name: str
    prim_param_name: str
    prim_module: nn.Module
    prim_module_name: str


class _ShardParamInfo(NamedTuple):
    """The part of one original parameter inside this rank's shard.

    ``flat_param[offset_in_shard : offset_in_shard + numel_in_shard]`` equals
    ``param.flatten()[intra_param_start_idx : intra_param_end_idx + 1]`` (end index inclusive).
    All fields but ``in_shard`` are ``None`` when the parameter has no element in the shard.
    """

    in_shard: bool
    offset_in_shard: int | None
    numel_in_shard: int | None
    intra_param_start_idx: int | None
    intra_param_end_idx: int | None


def aligned_numel(dtype: torch.dtype) -> int:
    """Element count of the 16-byte address alignment for ``dtype``."""
    return _ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size()


def flat_layout(numels: Sequence[int], world_size: int, align: int) -> tuple[list[int], list[bool]]:
    """Segments of the flat tensor: ``(numels_with_padding, is_padding_mask)``.

    ``align == 0`` gives exactly ``numels`` (no padding entries). ``align > 0`` inserts a padding
    entry before each parameter whose start is not a multiple of ``align``, then one that makes the
    total a multiple of ``world_size``.
    """
    segments: list[int] = []
    mask: list[bool] = []
    total = 0
    for numel in numels:
        if align > 0 and total % align:
            segments.append(align - total % align)
            mask.append(True)
            total += segments[-1]
        segments.append(numel)
        mask.append(False)
        total += numel
    if align > 0 and total % world_size:
        segments.append(world_size - total % world_size)
        mask.append(True)
    return segments, mask


def shard_range(total_numel: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """``(start, end, numel_padded)`` of rank ``rank`` 's shard of a flat tensor of ``total_numel``.

    The chunk size is ``C = ceil(total_numel / world_size)`` (``torch.chunk`` 's rule); the shard
    holds flat elements ``[start, end)`` followed by ``numel_padded`` zeros, so every rank's shard
    has exactly ``C`` elements.
    """
    chunk = math.ceil(total_numel / world_size)
    start = min(rank * chunk, total_numel)
    end = min((rank + 1) * chunk, total_numel)
    return start, end, chunk - (end - start)


def shard_param_infos(
    numels_with_padding: Sequence[int],
    is_padding_mask: Sequence[bool],
    start: int,
    end: int,
) -> tuple[_ShardParamInfo, ...]:
    """One :class:`_ShardParamInfo` per non-padding segment for the shard ``[start, end)``."""
    infos = []
    offset = 0
    for numel, is_padding in zip(numels_with_padding, is_padding_mask):
        seg_start, seg_end = offset, offset + numel
        offset = seg_end
        if is_padding:
            continue
        lo, hi = max(seg_start, start), min(seg_end, end)
        if lo >= hi:
            infos.append(_ShardParamInfo(False, None, None, None, None))
        else:
            infos.append(
                _ShardParamInfo(True, lo - start, hi - lo, lo - seg_start, hi - seg_start - 1)
            )
    return tuple(infos)
