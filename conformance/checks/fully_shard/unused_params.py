"""Area "training": parameters that took no part in a forward get no gradient (P19).

[Note: unused parameters]
A parameter is *unused* in a step when the unit that holds it ran forward but the forward never
read it (a gate skipped by a flag, a branch not taken). In the single-process oracle such a
parameter's ``.grad`` stays ``None`` after backward (after ``zero_grad()``, which sets it to
``None``), and every ``torch.optim`` optimizer then skips it: weight decay, momentum left from an
earlier step and Adam's moments do not move it. FSDP2 must give the same answer: ``.grad`` is
``None`` on every rank, not a zero DTensor, so that an optimizer over the sharded parameters takes
the oracle's step. The model below makes two parameters unused after a first step in which
everything is used, with optimizers for which a zero gradient would move them (SGD with momentum
0.9 and weight decay 0.1, AdamW with weight decay 0.1).

The oracle is the one of ``_shared/oracle.py`` (rank r feeds its ``B`` samples, the oracle the
global batch); the checks compare, each step, the losses, which parameters have a gradient, the
sharded gradients (the oracle's chunk) and, after each optimizer step, every parameter's full
value.
FSDP1's rule differs (a flat gradient covers used and unused parameters alike); its check lives
in ``conformance/checks/fsdp1/unused_params.py`` and uses the same model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.adapters.base import NotSupported
from conformance.checks._shared.oracle import (
    FP32,
    B,
    assert_close,
    make_batch,
    per_sample_loss,
    shard_dim,
)
from conformance.checks._shared.rows import chunk_of
from conformance.registry import check

# step -> whether the optional parameters (``side.gate``, ``skip``) take part; step 0 uses them,
# so momentum and Adam moments exist when they become unused
SCHEDULE = (True, False, False)


class Gated(nn.Module):
    """Linear(7, 7), then multiplied by the gate (7,) when ``use_optional`` is set."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 7)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 7))
        self.use_optional = True

    def forward(self, h):
        h = self.lin(h)
        return h * self.gate if self.use_optional else h


class Branchy(nn.Module):
    """Linear(5, 7) -> tanh -> Gated -> tanh -> Linear(7, 3), plus ``skip`` Linear(5, 3) added
    to the output when ``use_optional`` is set. Unused when the flags are off: ``side.gate``,
    ``skip.weight``, ``skip.bias``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.side = Gated()
        self.out = nn.Linear(7, 3)
        self.skip = nn.Linear(5, 3)
        self.use_optional = True

    def forward(self, x):
        y = self.out(torch.tanh(self.side(torch.tanh(self.inp(x)))))
        return y + self.skip(x) if self.use_optional else y


OPTIONAL = ("side.gate", "skip.weight", "skip.bias")
PLANS = {"root": None, "nested": [("side", {}), ("", {})]}  # nested: the gate's unit runs


def set_optional(model: nn.Module, used: bool) -> None:
    """Switch the optional parameters on or off in every module of ``model`` (wrappers included)."""
    for module in model.modules():
        if "use_optional" in vars(module):
            module.use_optional = used


def zero_fill_unused(oracle) -> None:
    """The rule for a model told to reduce unused parameters (FSDP1 always; FSDP2 after
    ``set_reduce_scatter_unused_params(True)``) applied to the oracle: an unused parameter of a unit
    that ran has a zero gradient."""
    for p in oracle.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def make_optimizer(name: str, params):
    """Optimizers that move a parameter whose gradient is zero (not ``None``)."""
    if name == "sgd-wd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def build(ctx, plan: str, **options):
    """(sharded model, oracle) from the same seed."""
    ctx.seed(0)
    model = Branchy().to(ctx.device)
    oracle = copy.deepcopy(model)
    return ctx.impl.shard(model, ctx, plan=PLANS[plan], **options), oracle


def step_losses(ctx, model, oracle, step: int):
    """One forward/backward of both models on step ``step``'s batch (flags per :data:`SCHEDULE`);
    asserts rank r's loss equals the oracle's on rank r's samples."""
    used = SCHEDULE[step]
    set_optional(model, used)
    set_optional(oracle, used)
    x, y = make_batch("mlp", ctx.world_size, step, ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    loss = per_sample_loss("mlp", model(x[mine]), y[mine]).mean()
    loss.backward()
    oloss = per_sample_loss("mlp", oracle(x), y)
    oloss.mean().backward()
    assert_close(ctx, f"step {step} loss", loss, oloss[mine].mean(), FP32["loss"])
    for name in OPTIONAL:  # the oracle itself must show the case (else the check proves nothing)
        assert (oracle.get_parameter(name).grad is None) is not used, (
            f"{ctx.where()} the oracle at step {step}: {name} used={used} but its .grad says otherwise"
        )


CASES = {
    "root-sgd-wd": {"plan": "root", "optim": "sgd-wd"},
    "nested-sgd-wd": {"plan": "nested", "optim": "sgd-wd"},
    "nested-adamw": {"plan": "nested", "optim": "adamw"},
}


@check(area="training", requires={base.TRAINING, base.DTENSOR_PARAMS}, cases=CASES)
def unused_param_grad_is_none(ctx, plan, optim):
    """P19: a parameter of a unit that ran but that the forward did not use comes out of backward
    with ``.grad`` None on every rank (not a zero tensor); the used parameters' sharded gradients
    are the oracle's chunks, and after each SGD-with-momentum-and-weight-decay or AdamW step every
    parameter equals the oracle's, so an unused parameter does not move."""
    run_unused(ctx, plan, optim, reduce_unused=False)


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API},
    cases={"nested-sgd-wd": {"plan": "nested", "optim": "sgd-wd"}},
)
def unused_param_reduced_when_asked(ctx, plan, optim):
    """P19: after ``set_reduce_scatter_unused_params(True)`` an unused parameter's ``.grad`` is a
    zero DTensor (its chunk of zeros) on every rank instead of None, and training equals the oracle
    whose unused gradients are zeros (weight decay and momentum move the parameter)."""
    run_unused(ctx, plan, optim, reduce_unused=True)


def run_unused(ctx, plan, optim, reduce_unused: bool):
    """Train per :data:`SCHEDULE` next to the oracle and compare (see the module Note); with
    ``reduce_unused`` the model is told to reduce unused parameters and the oracle's unused
    gradients become zeros."""
    from torch.distributed.tensor import DTensor

    model, oracle = build(ctx, plan)
    if reduce_unused:
        if not hasattr(model, "set_reduce_scatter_unused_params"):  # a torch before the API
            raise NotSupported("FSDPModule.set_reduce_scatter_unused_params")
        model.set_reduce_scatter_unused_params(True)
    opt = make_optimizer(optim, model.parameters())
    oopt = make_optimizer(optim, oracle.parameters())
    for step in range(len(SCHEDULE)):
        step_losses(ctx, model, oracle, step)
        if reduce_unused:
            zero_fill_unused(oracle)
        for name, param in model.named_parameters():
            name = ctx.impl.clean_fqn(name)
            ref = oracle.get_parameter(name).grad
            grad = param.grad
            if ref is None:
                assert grad is None, (
                    f"{ctx.where()} step {step}: {name} took no part in the forward, so its "
                    f".grad must be None (as in the oracle), got a {type(grad).__name__} of "
                    f"shape {tuple(grad.shape)} with max |value| "
                    f"{grad.detach().abs().max().item() if grad.numel() else 0.0:.3g}"
                )
                continue
            assert isinstance(grad, DTensor), (
                f"{ctx.where()} step {step}: {name} was used but its .grad is "
                f"{type(grad).__name__}, expected a DTensor"
            )
            assert_close(
                ctx,
                f"step {step} {name} sharded grad (vs the oracle's chunk)",
                grad.to_local(),
                chunk_of(ref, shard_dim(param), ctx.world_size, ctx.rank),
                FP32["grad"],
            )
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
        for name, param in model.named_parameters():
            name = ctx.impl.clean_fqn(name)
            assert_close(
                ctx,
                f"{name} after step {step} ({optim}; used={SCHEDULE[step]})",
                param.detach().full_tensor(),
                oracle.get_parameter(name),
                FP32["param"],
            )
