"""Area "fsdp1_runtime": what an FSDP1 unit looks like during and after its forward (R12-R15).

[Note: the forward rules]
* R12: while a unit's forward runs (from the first module it wraps to its last), the unit is
  busy: ``summon_full_params`` on it raises AssertionError "Cannot manually unshard parameters
  during forward/backward" before any change, and the forward, when the caller catches the error,
  completes with the unsharded model's output. Conversely, with ``use_orig_params=False`` on a
  unit that shards, a forward inside ``summon_full_params`` raises (torch 2.13: an
  AssertionError from its unshard; with ``use_orig_params=True`` or NO_SHARD it runs).
* R13: a forward without autograd (``torch.no_grad()``, e.g. evaluation) reshards on return: with
  ``use_orig_params=True`` every name of ``named_parameters()`` is there again, the very
  Parameter object it was before the forward, with its sharded shape.
* R14: outside every forward, reading a managed parameter through the unit
  (``unit.weight``) gives exactly the object the wrapped module holds (``unit.module.weight``):
  nothing is gathered.
* R15: a module inside a unit that recomputes its forward in backward (activation checkpointing,
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``) reads the unsharded parameters
  again there: the gradients equal the unsharded model's.
The model is ``summon_full_params.TwoUnits`` (``inner`` is its own unit, the root owns ``head``);
R15 wraps ``inner`` 's Linear in a checkpointing module. Every rank feeds the same batch, so the
averaged gradients are the single-process model's.
"""

from __future__ import annotations

import copy

import torch
import torch.utils.checkpoint
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks.fsdp1.clip_grad_norm import full_grads
from conformance.checks.fsdp1.summon_full_params import ORIG, PLAN, build, visible
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_RUNTIME}


def batch(ctx) -> torch.Tensor:
    """The same (4, 5) input on every rank."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(4, 5, generator=gen).to(ctx.device)


def inner_unit(ctx, model) -> nn.Module:
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    units = [m for n, m in model.named_modules() if n and isinstance(m, fsdp)]
    assert len(units) == 1, f"{ctx.where()} expected one nested FSDP unit, found {len(units)}"
    return units[0]


@check(area="fsdp1_runtime", requires=REQUIRES, cases=ORIG)
def summon_refused_in_forward(ctx, orig):
    """R12: ``summon_full_params(root)`` called from inside the root's forward (a pre-hook of the
    root's own ``head``) raises AssertionError "... during forward/backward"; the forward then
    completes with the unsharded model's output. Conversely, with ``use_orig_params=False`` at
    world size >= 2, a forward of the root inside ``summon_full_params(root)`` is refused
    (raises)."""
    model, oracle, fsdp = build(ctx, orig)
    seen: list[BaseException | None] = []

    def pre_hook(module, args):
        try:
            with fsdp.summon_full_params(model, writeback=False):
                pass
        except Exception as exc:  # noqa: BLE001 - recorded and judged below
            seen.append(exc)
        else:
            seen.append(None)

    x = batch(ctx)
    handle = root_head(ctx, model).register_forward_pre_hook(pre_hook)
    try:
        out = model(x)
    finally:
        handle.remove()
    assert len(seen) == 1, f"{ctx.where()} the head's pre-hook ran {len(seen)} times, expected 1"
    exc = seen[0]
    assert isinstance(exc, AssertionError) and "during forward/backward" in str(exc), (
        f"{ctx.where()} summon_full_params inside the root's forward gave "
        f"{type(exc).__name__ if exc else 'no error'}: {exc}; expected AssertionError "
        "'Cannot manually unshard parameters during forward/backward'"
    )
    assert_close(ctx, "forward output after the refused summon", out, oracle(x), FP32["loss"])
    if orig or ctx.world_size == 1:
        return  # upstream runs such a forward; only the flat, sharded case is refused
    # the converse: a forward inside summon_full_params(root) is refused (last: the refusal may
    # leave the model unusable)
    try:
        with fsdp.summon_full_params(model, writeback=False):
            model(x)
    except Exception:  # noqa: BLE001 - any refusal; upstream's is an AssertionError
        pass
    else:
        raise AssertionError(
            f"{ctx.where()} a forward inside summon_full_params(root) ran; expected it refused "
            "(an exception)"
        )


def root_head(ctx, model) -> nn.Module:
    """The root's ``head`` Linear (not a unit: the same module object inside the root)."""
    heads = [m for n, m in model.named_modules() if n.split(".")[-1] == "head"]
    assert len(heads) == 1, f"{ctx.where()} expected one 'head' module, found {len(heads)}"
    return heads[0]


@check(area="fsdp1_runtime", requires=REQUIRES)
def no_grad_forward_reshards(ctx):
    """R13: with ``use_orig_params=True``, after a forward under ``torch.no_grad()`` every
    parameter name is back in ``named_parameters()``, bound to the same Parameter object with the
    same (sharded) shape as before; the output is the unsharded model's."""
    model, oracle, _ = build(ctx, True)
    before = {n: (p, tuple(p.shape)) for n, p in visible(ctx, model).items()}
    x = batch(ctx)
    with torch.no_grad():
        out = model(x)
        want = oracle(x)
    assert_close(ctx, "no_grad forward output", out, want, FP32["loss"])
    after = visible(ctx, model)
    assert sorted(after) == sorted(before), (
        f"{ctx.where()} named_parameters() after a no_grad forward: {sorted(after)}, expected "
        f"{sorted(before)} (the unit must reshard on return)"
    )
    for name, (param, shape) in before.items():
        assert after[name] is param and tuple(after[name].shape) == shape, (
            f"{ctx.where()} {name} after a no_grad forward is a {type(after[name]).__name__} of "
            f"shape {tuple(after[name].shape)}; expected the same Parameter of shape {shape}"
        )


@check(area="fsdp1_runtime", requires=REQUIRES, cases=ORIG)
def attribute_read_outside_forward(ctx, orig):
    """R14: outside any forward, ``unit.weight`` / ``unit.bias`` of a nested unit are the very
    objects its wrapped module holds (``unit.module.weight``), before and after a training step's
    forward and backward."""
    model, oracle, _ = build(ctx, orig)
    unit = inner_unit(ctx, model)
    for when in ("before any forward", "after forward and backward"):
        for name in ("weight", "bias"):
            got, held = getattr(unit, name), getattr(unit.module, name)
            assert got is held, (
                f"{ctx.where()} {when}: unit.{name} is a {type(got).__name__} of shape "
                f"{tuple(got.shape)}, not the wrapped module's own {name} (shape "
                f"{tuple(held.shape)}); nothing may be gathered outside forward"
            )
        model(batch(ctx)).sum().backward()


class Checkpointed(nn.Module):
    """Runs ``body`` under non-reentrant activation checkpointing: backward recomputes it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 7)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)


class CheckpointedUnits(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Checkpointed()
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x)))


@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, cases=ORIG)
def checkpointed_unit_grads(ctx, orig):
    """R15: a unit whose Linear recomputes its forward in backward (non-reentrant activation
    checkpointing) gets the unsharded model's gradients (the same batch on every rank), and
    so does the root's ``head``."""
    ctx.seed(0)
    model = CheckpointedUnits().to(ctx.device)
    oracle = copy.deepcopy(model)
    model = ctx.impl.shard(model, ctx, plan=PLAN, use_orig_params=orig)
    x = batch(ctx)
    model(x).square().sum().backward()
    oracle(x).square().sum().backward()
    got = full_grads(ctx, model, oracle, orig)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} gradient (checkpointed unit)", got[name], ref.grad, FP32["grad"])
