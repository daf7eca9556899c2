"""Multi-rank tests of the reference's runtime APIs added for SPEC part R and P19, on gloo/CPU:
``FullyShardedDataParallel.clip_grad_norm_`` (R2) against ``torch.nn.utils.clip_grad_norm_`` on
the unsharded model and against torch's FSDP1, the summon re-entry error (R5), and FSDP2's
``set_reduce_scatter_unused_params`` (P19) against torch's ``fully_shard``.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from tests._spawn import run_on_ranks

CPU = torch.device("cpu")


class Net(nn.Module):
    """Linear(3, 7) -> tanh -> Linear(7, 2), plus ``unused`` Linear(3, 2) that forward never reads."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 7)
        self.b = nn.Linear(7, 2)
        self.unused = nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _batch(world_size: int) -> torch.Tensor:
    return torch.randn(2 * world_size, 3, generator=torch.Generator().manual_seed(11))


def _wrap_fsdp1(fsdp_cls, model, use_orig_params):
    model.b = fsdp_cls(model.b, device_id=CPU, use_orig_params=use_orig_params)
    return fsdp_cls(model, device_id=CPU, use_orig_params=use_orig_params)


def _flat_grads(model, fsdp_cls) -> list[torch.Tensor]:
    return [
        m._handle.flat_param.grad.clone()
        for m in model.modules()
        if isinstance(m, fsdp_cls) and m._handle is not None
    ]


def _clip_body(rank, world_size):
    import torch.distributed.fsdp as tfsdp

    import reference as ref

    x = _batch(world_size)
    mine = x[2 * rank : 2 * rank + 2]
    for use_orig_params in (False, True):
        for norm_type in (2.0, math.inf):
            torch.manual_seed(0)
            base = Net()
            oracle = copy.deepcopy(base)
            oracle(x).pow(2).mean().backward()
            want = torch.nn.utils.get_total_norm(
                [p.grad for p in oracle.parameters() if p.grad is not None], norm_type
            )
            max_norm = 0.5 * want.item()
            results = []
            for fsdp_cls in (ref.FullyShardedDataParallel, tfsdp.FullyShardedDataParallel):
                model = _wrap_fsdp1(fsdp_cls, copy.deepcopy(base), use_orig_params)
                model(mine).pow(2).mean().backward()
                try:
                    model.b.clip_grad_norm_(max_norm, norm_type)
                except RuntimeError as exc:
                    assert "root" in str(exc), exc
                else:
                    raise AssertionError(f"{fsdp_cls.__module__}: non-root clip accepted")
                got = model.clip_grad_norm_(max_norm, norm_type)
                where = f"rank {rank} {fsdp_cls.__module__} orig={use_orig_params} p={norm_type}"
                assert torch.allclose(got, want, rtol=1e-5), f"{where}: norm {got} != {want}"
                results.append(_flat_grads(model, fsdp_cls))
            if use_orig_params:  # the flat layouts may differ by alignment padding
                continue
            for mine_g, theirs in zip(*results):
                assert torch.allclose(mine_g, theirs, rtol=1e-5, atol=1e-7), (
                    f"rank {rank} orig={use_orig_params} p={norm_type}: clipped flat gradient "
                    "differs from torch's"
                )


def _summon_reentry_body(rank, world_size):
    import reference as ref

    FSDP = ref.FullyShardedDataParallel
    torch.manual_seed(0)
    model = _wrap_fsdp1(FSDP, Net(), False)
    with FSDP.summon_full_params(model, recurse=False):
        try:
            with FSDP.summon_full_params(model):
                pass
        except AssertionError as exc:
            assert "already unsharding" in str(exc), exc
        else:
            raise AssertionError("a nested summon_full_params on the same module was accepted")
        with FSDP.summon_full_params(model.b):  # a disjoint unit nests fine
            assert model.b.weight.shape == (2, 7)


def _unused_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import reference as ref

    mesh = init_device_mesh("cpu", (world_size,))
    x = _batch(world_size)[2 * rank : 2 * rank + 2]
    for reduce_unused in (False, True):
        grads = []
        for fully_shard in (ref.fully_shard, torch_fully_shard):
            torch.manual_seed(0)
            model = Net()
            fully_shard(model, mesh=mesh)
            model.set_reduce_scatter_unused_params(reduce_unused)
            model(x).pow(2).mean().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        for name, theirs in grads[1].items():
            mine = grads[0][name]
            assert (mine is None) == (theirs is None), f"rank {rank} {name}: {mine} vs {theirs}"
            if theirs is not None:
                assert torch.allclose(mine.to_local(), theirs.to_local(), atol=1e-7), name
        assert (grads[0]["unused.weight"] is None) is not reduce_unused, grads[0]["unused.weight"]


def _body(rank, world_size):
    _clip_body(rank, world_size)
    _summon_reentry_body(rank, world_size)
    _unused_body(rank, world_size)


def test_runtime_apis_match_torch():
    run_on_ranks(_body, 2, timeout=300)
