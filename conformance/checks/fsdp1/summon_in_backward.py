"""Area "fsdp1_runtime": an FSDP1 unit is busy in a backward that reaches it (R113).

[Note: busy in backward]
A unit takes part in a backward from the first gradient that reaches it until that backward ends,
and ``summon_full_params`` refuses it meanwhile, as inside its forward (R12). For a unit whose
parameters need a gradient that is the gradient of one of its outputs. A unit whose parameters
need none (frozen) may get no output gradient at all, yet its backward still runs: it computes
the gradient of its inputs, so it is busy once those are computed. The model here makes that
visible: ``y = g(x); z = f(y)``, and the loss reads ``z`` only through ``z.detach()`` when ``f``
is frozen, so ``f`` 's output gets no gradient and ``y`` 's gradient is the only sign of its
backward. A hook on the input ``x`` 's gradient runs after ``y`` 's, inside the same backward:
``summon_full_params(f)`` there raises AssertionError "Cannot manually unshard parameters during
forward/backward". The backward itself completes with the unsharded model's gradients, and once
it has ended the unit is idle again: ``summon_full_params(f)`` works.

Every rank feeds the same batch, so the averaged gradients are the single-process model's.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import full_params
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_RUNTIME, base.TRAINING}
CASES = {
    f"{kind}-{'orig' if orig else 'flat'}": {"frozen": kind == "frozen", "orig": orig}
    for kind in ("frozen", "trainable")
    for orig in (True, False)
}
REFUSAL = "during forward/backward"


class GatedPair(nn.Module):
    """``y = g(x); z = f(y)``; with ``frozen`` the loss reads ``z`` only detached (``f`` gets no
    output gradient), else it reads ``y`` and ``z``."""

    def __init__(self, frozen: bool):
        super().__init__()
        self.g = nn.Linear(4, 4)
        self.f = nn.Linear(4, 4)
        self.frozen = frozen
        if frozen:
            self.f.requires_grad_(False)

    def forward(self, x):
        y = self.g(x)
        z = self.f(y)
        if self.frozen:
            return y.square().sum() + 0 * z.detach().sum()
        return y.square().sum() + z.square().sum()


def _unit(ctx, model, name: str) -> nn.Module:
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    units = [
        m for n, m in model.named_modules() if isinstance(m, fsdp) and ctx.impl.clean_fqn(n) == name
    ]
    assert len(units) == 1, (
        f"{ctx.where()} expected one FSDP unit named {name!r}, found {len(units)}"
    )
    return units[0]


@check(area="fsdp1_runtime", requires=REQUIRES, cases=CASES, world_sizes=(1, 2))
def summon_refused_in_backward(ctx, frozen, orig):
    """R113: units ``f`` and the root over ``y = g(x); z = f(y)`` (``f`` frozen with the loss
    reading ``z`` detached, or trainable with the loss reading ``z``): ``summon_full_params(f)``
    from a hook on the input ``x`` 's gradient (after ``y`` 's, inside the backward) raises
    AssertionError "Cannot manually unshard parameters during forward/backward"; the backward
    gives ``x`` and the parameters the unsharded model's gradients (an SGD step then gives its
    parameters), and after it ``summon_full_params(f)`` works."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = GatedPair(frozen).to(ctx.device)
    model = ctx.impl.shard(
        copy.deepcopy(oracle), ctx, plan=[("f", {}), ("", {})], use_orig_params=orig
    )
    unit = _unit(ctx, model, "f")
    gen = torch.Generator().manual_seed(3)
    data = torch.randn(4, 4, generator=gen).to(ctx.device)
    x, ox = data.clone().requires_grad_(), data.clone().requires_grad_()
    seen: list[BaseException | None] = []

    def hook(grad: torch.Tensor) -> None:
        try:
            with fsdp.summon_full_params(unit):
                pass
        except Exception as exc:  # noqa: BLE001 - recorded and judged below
            seen.append(exc)
        else:
            seen.append(None)

    x.register_hook(hook)
    model(x).backward()
    oracle(ox).backward()
    assert len(seen) == 1, f"{ctx.where()} the hook on x's gradient ran {len(seen)} times"
    exc = seen[0]
    assert isinstance(exc, AssertionError) and REFUSAL in str(exc), (
        f"{ctx.where()} summon_full_params(f) inside the backward ({'frozen' if frozen else 'trainable'}"
        f" f, after y's gradient) gave {type(exc).__name__ if exc else 'no error'}: {exc}; expected "
        "AssertionError 'Cannot manually unshard parameters during forward/backward'"
    )
    assert_close(ctx, "x's gradient", x.grad, ox.grad, FP32["grad"])
    try:
        with fsdp.summon_full_params(unit):
            pass
    except Exception as err:  # noqa: BLE001 - reported with the reason
        raise AssertionError(
            f"{ctx.where()} summon_full_params(f) after the backward ended raised "
            f"{type(err).__name__}: {err}; the unit must be idle again"
        ) from err
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    oopt = torch.optim.SGD([p for p in oracle.parameters() if p.requires_grad], lr=0.1)
    opt.step()
    oopt.step()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after an SGD step", got[name], ref, FP32["param"])
