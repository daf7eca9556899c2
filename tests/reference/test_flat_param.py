"""Property tests of the flat-parameter layout (reference/_fsdp1/_flat_param.py).

Expected values come from the rules, computed independently: ``torch.chunk`` for shard sizes,
``ceil(N / world_size)`` for the chunk size, ``16 bytes / itemsize`` for alignment, and the
parameters themselves for the round trips. Handles are built on a ``FakeProcessGroup`` (rank and
size only; construction needs no collective).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch._C._distributed_c10d import FakeProcessGroup

from reference._fsdp1._flat_layout import (
    aligned_numel,
    flat_layout,
    shard_param_infos,
    shard_range,
)
from reference._fsdp1._flat_param import FlatParamHandle

world_sizes = st.integers(min_value=1, max_value=8)
numel_lists = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6)
shape_lists = st.lists(
    st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=3).map(tuple),
    min_size=1,
    max_size=5,
)


@given(total=st.integers(min_value=0, max_value=200), ws=world_sizes)
def test_shard_range_matches_torch_chunk(total, ws):
    chunk = math.ceil(total / ws)
    pieces = torch.arange(total).chunk(ws) if total else ()
    covered = []
    for rank in range(ws):
        start, end, padded = shard_range(total, rank, ws)
        expected = pieces[rank].tolist() if rank < len(pieces) else []
        assert list(range(start, end)) == expected
        assert (end - start) + padded == chunk  # every shard is C elements long
        assert (end == start) == (rank * chunk >= total)  # pure-padding ranks
        covered.extend(range(start, end))
    assert covered == list(range(total))


@given(numels=numel_lists, ws=world_sizes)
def test_flat_layout_without_alignment_has_no_padding(numels, ws):
    segments, mask = flat_layout(numels, ws, 0)
    assert segments == numels
    assert not any(mask)


@given(numels=numel_lists, ws=world_sizes, align=st.sampled_from([2, 4, 8]))
def test_flat_layout_aligns_every_parameter(numels, ws, align):
    segments, mask = flat_layout(numels, ws, align)
    assert [n for n, pad in zip(segments, mask) if not pad] == numels
    assert sum(segments) % ws == 0
    offset = 0
    for i, (n, pad) in enumerate(zip(segments, mask)):
        if pad:
            trailing = i == len(segments) - 1
            assert 0 < n < (ws if trailing else align)
        else:
            assert offset % align == 0
        offset += n


def test_aligned_numel_is_16_bytes():
    assert aligned_numel(torch.float32) == 4
    assert aligned_numel(torch.float16) == 8
    assert aligned_numel(torch.float64) == 2


@given(numels=numel_lists, ws=world_sizes, align=st.sampled_from([0, 4]))
def test_shard_param_infos_reassemble_each_parameter(numels, ws, align):
    segments, mask = flat_layout(numels, ws, align)
    params = [torch.arange(n) + 1000 * i for i, n in enumerate(numels)]
    pieces, it = [], iter(params)
    for n, pad in zip(segments, mask):
        pieces.append(torch.full((n,), -1) if pad else next(it))
    flat = torch.cat(pieces)
    rebuilt = [[] for _ in numels]
    for rank in range(ws):
        start, end, padded = shard_range(flat.numel(), rank, ws)
        shard = torch.cat([flat[start:end], torch.zeros(padded, dtype=flat.dtype)])
        infos = shard_param_infos(segments, mask, start, end)
        assert len(infos) == len(numels)
        for i, info in enumerate(infos):
            if not info.in_shard:
                assert info.offset_in_shard is None
                continue
            part = shard[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
            lo, hi = info.intra_param_start_idx, info.intra_param_end_idx + 1
            assert torch.equal(part, params[i][lo:hi])
            rebuilt[i].append(part)
    for i, p in enumerate(params):
        got = torch.cat(rebuilt[i]) if rebuilt[i] else p.new_empty(0)
        assert torch.equal(got, p)


class _Tree(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.layers = nn.ModuleList()
        for shape in shapes:
            layer = nn.Module()
            layer.weight = nn.Parameter(torch.randn(shape))
            self.layers.append(layer)


def _handles(shapes, ws, use_orig_params, seed=0):
    """One handle per rank, each over a fresh copy of the same tree."""
    out = []
    for rank in range(ws):
        torch.manual_seed(seed)
        tree = _Tree(shapes)
        originals = [p.detach().clone() for p in tree.parameters()]
        pg = FakeProcessGroup._create_internal(rank=rank, world_size=ws)
        handle = FlatParamHandle(list(tree.parameters()), tree, pg, True, use_orig_params)
        out.append((tree, handle, originals))
    return out


@given(shapes=shape_lists, ws=world_sizes, use_orig=st.booleans())
def test_handle_shards_and_views_round_trip(shapes, ws, use_orig):
    handles = _handles(shapes, ws, use_orig)
    originals = handles[0][2]
    numels = [math.prod(s) for s in shapes]
    flat_expected = torch.cat([p.reshape(-1) for p in originals])
    shards = []
    for rank, (tree, handle, _) in enumerate(handles):
        fp = handle.flat_param
        assert fp._numels == tuple(numels)
        assert fp._shapes == tuple(torch.Size(s) for s in shapes)
        assert fp._fqns == tuple(f"layers.{i}.weight" for i in range(len(shapes)))
        total = fp._unpadded_unsharded_size.numel()
        chunk = math.ceil(total / ws)
        assert fp.numel() == chunk
        start, end = min(rank * chunk, total), min((rank + 1) * chunk, total)
        assert fp._shard_numel_padded == chunk - (end - start)
        assert torch.all(fp.detach()[end - start :] == 0)  # padding is zeros
        shards.append(fp.detach())
        # The unsharded views reproduce every original parameter.
        gathered = torch.cat([h.flat_param.detach() for _, h, _ in handles])
        handle.use_unsharded_views(gathered, as_params=True)
        for layer, orig in zip(tree.layers, originals):
            assert torch.equal(layer.weight, orig)
        handle.reshard()
        if use_orig:  # sharded views: this rank's 1-D part of each parameter
            for layer, orig, info in zip(tree.layers, originals, fp._shard_param_infos):
                expected = orig.reshape(-1)
                if info.in_shard:
                    lo, hi = info.intra_param_start_idx, info.intra_param_end_idx + 1
                    expected = expected[lo:hi]
                    assert layer.weight.data_ptr() == fp[info.offset_in_shard :].data_ptr()
                else:
                    expected = expected[:0]
                assert torch.equal(layer.weight.detach(), expected)
        else:
            for layer, shape in zip(tree.layers, shapes):
                assert "weight" not in layer._parameters  # hidden from parameters()/state_dict
                assert layer.weight.device.type == "meta" and layer.weight.shape == shape
    unpadded = torch.cat(shards)[: handles[0][1].flat_param._unpadded_unsharded_size.numel()]
    kept = [
        t
        for t, pad in zip(
            torch.split(unpadded, list(handles[0][1].flat_param._numels_with_padding)),
            handles[0][1].flat_param._is_padding_mask,
        )
        if not pad
    ]
    assert torch.equal(torch.cat(kept), flat_expected)


def test_pure_padding_rank_holds_only_zeros():
    # One parameter of 1 element on 4 ranks: ranks 1-3 hold only padding.
    for rank, (tree, handle, _) in enumerate(_handles([(1,)], 4, use_orig_params=True)):
        fp = handle.flat_param
        if rank == 0:
            assert fp._shard_param_infos[0].in_shard
        else:
            assert not fp._shard_param_infos[0].in_shard
            assert tree.layers[0].weight.numel() == 0


def test_shared_parameter_is_flattened_once():
    tree = _Tree([(3, 2), (4,)])
    tree.alias = nn.Module()
    tree.alias.weight = tree.layers[0].weight
    pg = FakeProcessGroup._create_internal(rank=0, world_size=2)
    handle = FlatParamHandle(list(tree.parameters()), tree, pg, True, False)
    fp = handle.flat_param
    assert fp._numels == (6, 4)
    assert [(s.module_name, s.param_name, s.prim_module_name) for s in fp._shared_param_infos] == [
        ("alias", "weight", "layers.0")
    ]


def test_scalar_parameter_is_rejected_before_any_change():
    tree = _Tree([(2,)])
    tree.scale = nn.Parameter(torch.tensor(1.0))
    pg = FakeProcessGroup._create_internal(rank=0, world_size=2)
    with pytest.raises(ValueError, match="scalar .*scale"):
        FlatParamHandle(list(tree.parameters()), tree, pg, True, False)
    assert "weight" in tree.layers[0]._parameters and "scale" in tree._parameters
