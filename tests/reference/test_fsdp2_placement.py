"""``shard_placement_fn`` validation of the reference FSDP2 (spec P13), without a process group.

Expected results come from the rule: ``Shard(d)`` with ``-ndim <= d < ndim`` names dim
``d % ndim``; any other ``d`` is rejected up front with upstream's "Shard dim ... is invalid" text.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from reference._fully_shard._fsdp_init import _resolve_shard_placement


class _MeshInfo:  # the one field placement validation reads
    shard_mesh_size = 1


@given(ndim=st.integers(1, 4), dim=st.integers(-6, 6))
def test_shard_dim_is_normalized_or_rejected(ndim, dim):
    param = torch.nn.Parameter(torch.zeros((2,) * ndim))
    if -ndim <= dim < ndim:
        assert _resolve_shard_placement(param, lambda p: Shard(dim), _MeshInfo()) == Shard(
            dim % ndim
        )
    else:
        with pytest.raises(AssertionError, match=rf"Shard dim -?\d+ is invalid for {ndim}D tensor"):
            _resolve_shard_placement(param, lambda p: Shard(dim), _MeshInfo())


def test_none_means_dim_0_and_other_placements_are_rejected():
    param = torch.nn.Parameter(torch.zeros(4, 2))
    assert _resolve_shard_placement(param, None, _MeshInfo()) == Shard(0)
    assert _resolve_shard_placement(param, lambda p: None, _MeshInfo()) == Shard(0)
    with pytest.raises(ValueError, match="Invalid shard_placement_fn result"):
        _resolve_shard_placement(param, lambda p: Replicate(), _MeshInfo())
