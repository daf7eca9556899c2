"""Area "fsdp1_runtime": the edges of FSDP1's ``ShardedGradScaler`` (R50, R51, R101).

[Note: what a scaler promises beyond one finite step]
``scale`` takes a tensor or any nesting of lists and tuples of tensors and gives the same nesting
with every tensor multiplied by the scale S in its own dtype (another iterable gives an iterable of
the scaled items; anything else is refused with ValueError); a disabled scaler gives its argument
back untouched. The per-iteration protocol is ``unscale_`` at most once per optimizer, before
``step``; ``update()`` needs a record from ``unscale_``/``step`` since the last update, combines the
records of every optimizer (one non-finite value anywhere backs S off), counts finite iterations
towards ``growth_interval`` and takes an explicit ``new_scale`` (a float, or a one-element tensor
without grad on the scaler's device) instead. The oracle is the rule itself (S computed by hand,
the unsharded model stepped with the unscaled gradient or not stepped). A ``new_scale`` tensor
off the scaler's device is refused as ``init_errors.py``'s [Note: refusals are contracts] says
(R101).
"""

from __future__ import annotations

import copy
import importlib

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES as FSDP1_REQUIRES
from conformance.checks._shared.fsdp1_setup import _batch, _kwargs
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet, full_params
from conformance.registry import check

B = 2
S = 2.0**3
REQUIRES = {base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_GRAD_SCALER}


def _scaler(ctx, **kwargs):
    mod = importlib.import_module(f"{ctx.impl.ns.__name__}.sharded_grad_scaler")
    return mod.ShardedGradScaler(device=ctx.device.type, init_scale=S, **kwargs)


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def grad_scaler_scale_nested(ctx):
    """R50: a fresh scaler's first ``scale`` call on ``(a, [b16, (c,)])`` (a fp32, b16 fp16) gives
    a tuple holding a list holding a tuple, each tensor times S in its own dtype; a generator of
    tensors gives an iterable of the scaled tensors; a list holding a float is refused with
    ValueError; ``enabled=False`` gives back the very object passed."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(3, generator=g).to(ctx.device)
    b = torch.randn(2, generator=g).to(ctx.device, torch.float16)
    c = torch.randn(2, 2, generator=g).to(ctx.device)
    scaler = _scaler(ctx)
    got = scaler.scale((a, [b, (c,)]))
    shape = (type(got), type(got[1]) if len(got) == 2 else None)
    assert shape == (tuple, list) and type(got[1][1]) is tuple and len(got[1][1]) == 1, (
        f"{ctx.where()} scale((a, [b, (c,)])) gave {got!r}: expected the same nesting"
    )
    for what, out, ref in (("a", got[0], a), ("b (fp16)", got[1][0], b), ("c", got[1][1][0], c)):
        assert out.dtype == ref.dtype, (
            f"{ctx.where()} scaled {what} is {out.dtype}, not {ref.dtype}"
        )
        assert_close(ctx, f"scaled {what}", out.float(), ref.float() * S, FP32["param"])
    lazy = list(scaler.scale(t for t in (a, c)))
    assert len(lazy) == 2, f"{ctx.where()} scale(generator of 2) gave {len(lazy)} items"
    assert_close(ctx, "scaled generator item 0", lazy[0], a * S, FP32["param"])
    assert_close(ctx, "scaled generator item 1", lazy[1], c * S, FP32["param"])
    expect_error(
        ctx, "scale([a, 1.5])", ValueError, "Tensor or an iterable", lambda: scaler.scale([a, 1.5])
    )
    off = _scaler(ctx, enabled=False)
    items = [a, (c,)]
    assert off.scale(items) is items and off.scale(a) is a, (
        f"{ctx.where()} a disabled scaler's scale() did not give back its argument"
    )


def _loss(ctx, model, step):
    g = torch.Generator().manual_seed(970 + step)
    x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    y = torch.randn(ctx.world_size * B, 3, generator=g).to(ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    return ((model(x[mine]) - y[mine]) ** 2).mean(), ((x, y))


def _scale_is(ctx, scaler, expected, when):
    got = float(scaler.get_scale())
    assert got == expected, f"{ctx.where()} {when}: scale {got}, expected {expected}"


@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, world_sizes=(1, 2))
def grad_scaler_protocol(ctx):
    """R51: over an FSDP1 ``InnerHeadNet`` (``inner`` its own unit) with one SGD optimizer per
    unit plus an optimizer over a parameter that never gets a gradient, ``growth_interval=2``:
    ``unscale_`` twice, or after ``step``, raises RuntimeError; ``update()`` with no record since
    the last update raises AssertionError "No inf checks"; an iteration that unscales and steps only
    the gradient-less optimizer counts as finite; an inf in the *second* optimizer's gradients (on
    the last rank) backs S off although the first optimizer's are finite (its step is taken, the
    second's skipped); S doubles on the second finite iteration in a row only; ``update(4.0)`` and
    ``update(tensor(32.))`` set S (a later in-place change of that tensor does not), a 2-element
    or a grad-requiring tensor is refused with AssertionError. Parameters equal the unsharded model
    stepped by the same rule."""
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", {}), ("", {})])
    inner = [p for n, p in model.named_parameters() if ".inner." in n]
    root = [p for n, p in model.named_parameters() if ".inner." not in n]
    idle = torch.nn.Parameter(torch.ones(2, device=ctx.device))
    opt_in, opt_root = torch.optim.SGD(inner + [idle], lr=0.1), torch.optim.SGD(root, lr=0.1)
    opt_idle = torch.optim.SGD([idle], lr=0.1)
    o_in = torch.optim.SGD(oracle.inner.parameters(), lr=0.1)
    o_root = torch.optim.SGD(oracle.head.parameters(), lr=0.1)
    scaler = _scaler(ctx, growth_interval=2)
    scale = S

    def iteration(step, poison_root=False):
        loss, (x, y) = _loss(ctx, model, step)
        scaler.scale(loss).backward()
        if poison_root and ctx.rank == ctx.world_size - 1:
            grads = [p.grad for p in root if p.grad is not None and p.grad.numel()]
            grads[0].view(-1)[0] = float("inf")
        scaler.unscale_(opt_in)
        if step == 0:
            expect_error(
                ctx,
                "unscale_ twice",
                RuntimeError,
                "already been called",
                lambda: scaler.unscale_(opt_in),
            )
        scaler.step(opt_in)
        scaler.step(opt_root)
        if step == 0:
            expect_error(
                ctx,
                "unscale_ after step",
                RuntimeError,
                r"after step\(\)",
                lambda: scaler.unscale_(opt_root),
            )
        scaler.update()
        for opt in (opt_in, opt_root):
            opt.zero_grad()
        ((oracle(x) - y) ** 2).mean().backward()
        o_in.step()
        if not poison_root:
            o_root.step()
        o_in.zero_grad()
        o_root.zero_grad()

    iteration(0)  # finite: 1 of 2
    _scale_is(ctx, scaler, scale, "after one finite iteration (growth_interval 2)")
    expect_error(ctx, "update() again", AssertionError, "No inf checks", scaler.update)
    iteration(1, poison_root=True)
    scale *= 0.5
    _scale_is(ctx, scaler, scale, "after an inf in the second optimizer's gradients")
    iteration(2)  # finite: 1 of 2 again (the backoff reset the count)
    _scale_is(ctx, scaler, scale, "after one finite iteration following a backoff")
    scaler.scale(torch.ones((), device=ctx.device))
    scaler.unscale_(opt_idle)  # nothing to unscale: still a finite record
    scaler.step(opt_idle)
    scaler.update()
    scale *= 2.0
    _scale_is(ctx, scaler, scale, "after a second finite iteration (the gradient-less optimizer)")
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after the iterations", got[name], ref, FP32["param"])
    assert torch.equal(idle.detach(), torch.ones(2, device=ctx.device)), (
        f"{ctx.where()} the parameter without gradient moved: {idle.detach()}"
    )
    scaler.update(4.0)
    _scale_is(ctx, scaler, 4.0, "after update(4.0)")
    new = torch.tensor(32.0, device=ctx.device)
    scaler.update(new)
    new.fill_(1.0)
    _scale_is(ctx, scaler, 32.0, "after update(tensor(32.)) and a later in-place change of it")
    for what, bad in (
        ("a 2-element tensor", torch.full((2,), 8.0, device=ctx.device)),
        ("a tensor requiring grad", torch.tensor(8.0, device=ctx.device, requires_grad=True)),
    ):
        expect_error(
            ctx,
            f"update({what})",
            AssertionError,
            "new_scale should be",
            lambda b=bad: scaler.update(b),
        )
    _scale_is(ctx, scaler, 32.0, "after the refused updates")


# ------------------------------------------------------------------------------ R101
@check(
    area="fsdp1_runtime",
    requires=FSDP1_REQUIRES | {base.FSDP1_GRAD_SCALER},
    world_sizes=(1,),
)
def grad_scaler_new_scale_device_refused(ctx):
    """R101: ``ShardedGradScaler(device=<the compute device's type>, init_scale=4.0)`` after
    ``scale(loss).backward()`` and ``step``: ``update(new_scale=<a 1-element tensor on the meta
    device>)`` raises AssertionError "new_scale should be a float or a 1-element ..."; the scale
    stays 4.0."""
    mod = importlib.import_module(f"{ctx.impl.ns.__name__}.sharded_grad_scaler")
    scaler = mod.ShardedGradScaler(device=ctx.device.type, init_scale=4.0)
    ctx.seed(0)
    model = ctx.impl.ns.FullyShardedDataParallel(nn.Linear(4, 4).to(ctx.device), **_kwargs(ctx))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(_batch(ctx, 101)).sum()).backward()
    scaler.step(opt)
    expect_error(
        ctx,
        "update(new_scale=<meta tensor>)",
        AssertionError,
        r"new_scale should be a float or a 1-element",
        lambda: scaler.update(new_scale=torch.tensor([2.0], device="meta")),
    )
    assert scaler.get_scale() == 4.0, (
        f"{ctx.where()} after the refused update the scale is {scaler.get_scale()}, expected 4.0"
    )
