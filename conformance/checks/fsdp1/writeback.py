"""Area "fsdp1_runtime": what the user changes on the original parameters or on the flat parameter
between forwards, and how FSDP1 writes it back: silently (R64), past a deregistered parameter
(R80), refused at the wrong size (R65).

[Note: writing back what the user changed]
* With ``use_orig_params=True`` an original parameter whose ``.data`` the user replaced (same
  shape) is written back silently at the default debug level: no warning, and the next forward
  computes with the new values (R64).
* With ``use_orig_params=False`` the exposed flat parameter's ``.data`` replaced by a tensor one
  element short is refused at the next forward with AssertionError naming the expected and the
  actual size (R65).
* ``summon_full_params`` first writes back what the user changed, as a forward does (R64): an
  original parameter whose ``.data`` was replaced (same shape) shows its new values inside it.
  One deregistered from its module (``del inner[0].weight``, as checkpointing wrappers do for a
  while) is skipped, and the writeback goes on with the parameters after it (R80).
* An original parameter *variable* replaced outside forward (``lin.weight = nn.Parameter(...)``
  of the sharded shape) is adopted, not only copied: the next forward computes with its values,
  and the user's new Parameter stays registered on the module, backed by the unit's storage, and
  receives the gradient, so an optimizer built over it trains the model (R119).
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _kwargs, _x
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks.fsdp1.summon_full_params import TwoUnits, visible
from conformance.registry import check


# ------------------------------------------------------------------------------ R64
@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, world_sizes=(1, 2))
def writeback_silent_by_default(ctx):
    """R64: ``use_orig_params=True`` at the default debug level (``TORCH_DISTRIBUTED_DEBUG``
    OFF): ``head.weight.data`` replaced outside forward by a tensor of its (sharded) shape holding
    0.5 is written back without any warning (none says "writeback"), and the next forward equals
    the unsharded model whose ``head.weight`` is all 0.5."""
    old_level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)
    try:
        ctx.seed(0)
        oracle = TwoUnits().to(ctx.device)
        model = ctx.impl.shard(
            copy.deepcopy(oracle), ctx, plan=[("inner", {}), ("", {})], use_orig_params=True
        )
        p = visible(ctx, model)["head.weight"]
        with torch.no_grad():
            p.data = torch.full_like(p, 0.5)
            oracle.head.weight.fill_(0.5)
        x = _x(ctx, 5, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                out = model(x)
    finally:
        dist.set_debug_level(old_level)
    said = [str(w.message)[:120] for w in caught if "writeback" in str(w.message).lower()]
    assert not said, f"{ctx.where()} a writeback at debug level OFF warned: {said}"
    with torch.no_grad():
        assert_close(ctx, "forward after head.weight.data = 0.5s", out, oracle(x), FP32["loss"])


# ------------------------------------------------------------------------------ R65
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def flat_param_data_wrong_size(ctx):
    """R65: ``use_orig_params=False`` at world size 1 over ``Linear(4, 4)``: the exposed flat
    parameter (20 elements) whose ``.data`` is replaced by 19 zeros is refused at the next forward
    with AssertionError naming the expected size 20 and the actual 19."""
    ctx.seed(0)
    model = ctx.impl.shard(nn.Linear(4, 4).to(ctx.device), ctx)
    (flat,) = list(model.parameters())
    n = 4 * 4 + 4
    assert flat.numel() == n, f"{ctx.where()} test setup: flat parameter of {flat.numel()}"
    with torch.no_grad():
        flat.data = torch.zeros(n - 1, device=flat.device, dtype=flat.dtype)
    expect_error(
        ctx,
        f"forward after the flat parameter's .data got {n - 1} elements",
        AssertionError,
        rf"\b{n}\b.*\b{n - 1}\b",
        lambda: model(_x(ctx, 4, 9)),
    )


# ------------------------------------------------------------------------------ R80
@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_RUNTIME}, world_sizes=(1, 2))
def writeback_past_deregistered_param(ctx):
    """R80: ``use_orig_params=True``, one unit over ``Sequential(Linear(4, 2), Linear(2, 8))``
    (sized so that at world size 2, in upstream's layout, rank 0's shard holds ``0.weight`` and the
    start of ``1.weight``):
    ``del inner[0].weight`` (deregistered), then ``inner[1].weight.data`` and
    ``inner[1].bias.data`` replaced by tensors of their (sharded) shapes holding 2.0 and -1.0;
    inside ``summon_full_params`` every rank sees ``1.weight`` all 2.0 and ``1.bias`` all -1.0,
    and ``0.bias`` unchanged."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 8)).to(ctx.device)
    model = ns.FullyShardedDataParallel(copy.deepcopy(oracle), use_orig_params=True, **_kwargs(ctx))
    inner = model.module
    del inner[0].weight
    with torch.no_grad():
        inner[1].weight.data = torch.full_like(inner[1].weight, 2.0)
        inner[1].bias.data = torch.full_like(inner[1].bias, -1.0)
        oracle[1].weight.fill_(2.0)
        oracle[1].bias.fill_(-1.0)
    with ns.FullyShardedDataParallel.summon_full_params(model):
        for name in ("1.weight", "1.bias", "0.bias"):
            want = oracle.get_parameter(name)
            got = getattr(inner[int(name[0])], name[2:])
            assert tuple(got.shape) == tuple(want.shape), (
                f"{ctx.where()} summon_full_params: {name} of shape {tuple(got.shape)}, "
                f"expected {tuple(want.shape)}"
            )
            assert_close(
                ctx,
                f"{name} in summon_full_params after del 0.weight and a .data replacement",
                got.detach(),
                want.detach(),
                FP32["param"],
            )


# ------------------------------------------------------------------------------ R119
@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, world_sizes=(1, 2))
def replaced_orig_param_variable(ctx):
    """R119: ``use_orig_params=True``, one unit over ``Linear(4, 4)``: outside forward each rank
    replaces the variable ``lin.weight`` by a new ``nn.Parameter`` of its (sharded) shape holding
    0.5; the next forward (the same batch on every rank) equals the unsharded Linear whose weight is
    all 0.5, ``lin.weight`` is still that new Parameter after it, and one SGD step (lr 0.1) of an
    optimizer built over ``model.parameters()`` after the replacement gives, reassembled in
    ``summon_full_params``, the unsharded model's weight and bias after the same step."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = nn.Linear(4, 4).to(ctx.device)
    model = ns.FullyShardedDataParallel(copy.deepcopy(oracle), use_orig_params=True, **_kwargs(ctx))
    lin = model.module
    new = nn.Parameter(torch.full_like(lin.weight.detach(), 0.5))
    lin.weight = new
    with torch.no_grad():
        oracle.weight.fill_(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    x = _x(ctx, 4, 11)
    out = model(x)
    want = oracle(x)
    assert_close(
        ctx,
        "forward after lin.weight = new Parameter(0.5s)",
        out.detach(),
        want.detach(),
        FP32["loss"],
    )
    assert lin.weight is new, (
        f"{ctx.where()} after the forward lin.weight is no longer the Parameter the user set "
        "(the replaced variable must stay registered)"
    )
    out.sum().backward()
    want.sum().backward()
    opt.step()
    oopt.step()
    with ns.FullyShardedDataParallel.summon_full_params(model):
        for name in ("weight", "bias"):
            assert_close(
                ctx,
                f"{name} after one step over the replaced weight",
                getattr(lin, name).detach(),
                getattr(oracle, name).detach(),
                FP32["param"],
            )
