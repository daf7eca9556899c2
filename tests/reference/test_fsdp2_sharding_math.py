"""Property tests of FSDP2's pure sharding arithmetic (``reference._fully_shard._shard_math``).

Expected values come from the rules (``torch.chunk`` semantics, ``ceil(dim / world_size)``),
never from the functions under test.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from reference._fully_shard import _shard_math as sm

world_sizes = st.integers(min_value=1, max_value=16)
dims = st.integers(min_value=0, max_value=40)
shapes = st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=4)


@given(dim_size=dims, ws=world_sizes)
def test_chunk_dim_sizes_match_torch_chunk_padded_with_empty(dim_size, ws):
    lengths = [c.size(0) for c in torch.chunk(torch.empty(dim_size), ws)] if dim_size else []
    expected = lengths + [0] * (ws - len(lengths))
    assert sm.chunk_dim_sizes(dim_size, ws) == expected


@given(dim_size=dims, ws=world_sizes)
def test_chunks_cover_the_dim_and_never_exceed_ceil(dim_size, ws):
    sizes = sm.chunk_dim_sizes(dim_size, ws)
    step = math.ceil(dim_size / ws)
    assert len(sizes) == ws
    assert sum(sizes) == dim_size
    assert all(0 <= s <= step for s in sizes)
    assert sizes == sorted(sizes, reverse=True)  # only the tail is short or empty
    assert sum(1 for s in sizes if 0 < s < step) <= 1


@given(shape=shapes, ws=world_sizes, data=st.data())
def test_sharded_and_padded_sizes(shape, ws, data):
    dim = data.draw(st.integers(min_value=0, max_value=len(shape) - 1))
    step = math.ceil(shape[dim] / ws)
    padded = sm.padded_sharded_size(shape, ws, dim)
    assert padded == tuple(step if i == dim else s for i, s in enumerate(shape))
    assert sm.padded_numel(shape, ws, dim) == math.prod(padded)
    for rank in range(ws):
        expected_len = max(0, min(step, shape[dim] - rank * step))
        size = sm.sharded_size(shape, ws, rank, dim)
        assert size == tuple(expected_len if i == dim else s for i, s in enumerate(shape))
        assert sm.shard_offset(shape, ws, rank, dim) == rank * step


@given(shape=shapes, ws=world_sizes)
def test_dim0_padded_size_is_a_multiple_of_world_size(shape, ws):
    padded = sm.dim0_padded_size(shape, ws)
    assert padded[0] % ws == 0
    assert shape[0] <= padded[0] < shape[0] + ws
    assert padded[1:] == tuple(shape[1:])


@given(shape=shapes)
def test_contiguous_strides_match_torch(shape):
    from torch._prims_common import make_contiguous_strides_for

    assert sm.contiguous_strides(shape) == tuple(make_contiguous_strides_for(shape))
    if all(s > 0 for s in shape):
        assert sm.contiguous_strides(shape) == torch.empty(shape).stride()


@given(shape=shapes, ws=world_sizes, data=st.data())
def test_round_trip_shard_then_all_gather(shape, ws, data):
    """Padded shards laid out rank after rank, un-padded, give back the original tensor."""
    dim = data.draw(st.integers(min_value=0, max_value=len(shape) - 1))
    original = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1
    padded = sm.padded_sharded_size(shape, ws, dim)
    buffers = []
    for rank in range(ws):
        buf = torch.zeros(padded)
        length = sm.sharded_size(shape, ws, rank, dim)[dim]
        if length:
            start = sm.shard_offset(shape, ws, rank, dim)
            buf.narrow(dim, 0, length).copy_(original.narrow(dim, start, length))
            assert not buf.narrow(dim, length, padded[dim] - length).any()  # zero padding
        buffers.append(buf.reshape(-1))
    gathered = torch.cat(buffers)  # what the all-gather output holds
    assert gathered.numel() == ws * sm.padded_numel(shape, ws, dim)
    rows = [b.view(padded) for b in gathered.chunk(ws)] if gathered.numel() else []
    rebuilt = torch.cat(rows, dim=dim).narrow(dim, 0, shape[dim]) if rows else original
    assert torch.equal(rebuilt, original)
    if dim == 0 and gathered.numel():  # dim 0: the unsharded param is a prefix view
        assert torch.equal(gathered[: original.numel()].view(shape), original)
