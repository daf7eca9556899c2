"""Areas "states" and "mixed_precision": grouped ``fully_shard([a, b])`` edges (P63, P65, P76,
P78).

[Note: completing every incomplete group]
P22's root completes a group whose forward skipped one of its modules. The root looks at every
unit of its tree for that, not only the last one registered: a unit that ran in full (here
``tail``, registered after the group ``fully_shard([a, b])`` and run after ``a``) has nothing left
to complete and must not stop the root from completing the group. So with ``b`` skipped the group
is SHARDED right after the root's forward (``reshard_after_forward=True``, the default), and the
gradients and steps equal the unsharded model's. The oracle is as in ``grouped.py``.

[Note: a failed standalone call claims the iteration]
The first unit whose pre-forward runs in an iteration takes the root's part for it (its
post-forward completes the groups that did not run in full, P22/P63). A unit called on its own
(a chunked loss calling a unit directly) takes that part too; if its forward raises, its
post-forward never gives the part back, and the next root forward would leave the completion to
that unit's post-forward (``inp``, run before the group: too early to complete it).
``reset_iter_state()`` on the root (P37) must clear the claim with the rest: the next root
forward then completes a group ``fully_shard([a, b])`` whose ``b`` it skipped, so the group is
SHARDED right after that forward, and training equals the unsharded model's (the oracle of
``grouped.py``) (P76). A group whose forward runs outside the root's forward, on one of its
modules only, trains as the unsharded model too (P78).

[Note: a user's forward hook on a grouped module]
FSDP2 registers its post-forward hook after the hooks a module already has (``prepend=False``),
for a grouped ``fully_shard([a, b])`` as for a single module: a forward hook the user registered
on ``b`` before sharding runs first, so it sees ``b``'s output in the compute dtype
(``param_dtype``) and ``b``'s parameters still unsharded (plain tensors, not DTensors), and FSDP
casts the value the hook returns to ``output_dtype``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import B, assert_close, backward_and_compare
from conformance.checks.fully_shard.grouped import _assert_group_sharded, _batch
from conformance.registry import check


class TrunkTail(nn.Module):
    """Root Linear(5, 7) -> tanh -> ``a`` Linear(7, 7) -> tanh -> ``tail`` Linear(7, 7); ``b``
    Linear(7, 3) (registered between ``a`` and ``tail``) never runs."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.a = nn.Linear(7, 7)
        self.b = nn.Linear(7, 3)
        self.tail = nn.Linear(7, 7)

    def forward(self, x):
        return self.tail(torch.tanh(self.a(torch.tanh(self.inp(x)))))


@check(
    area="states",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING},
    world_sizes=(2,),
)
def group_partial_forward_later_unit(ctx):
    """P63: ``fully_shard([a, b])``, then ``fully_shard(tail)`` (registered after the group) and
    the root; the forward runs ``a`` and ``tail``, never ``b``: right after the root's forward the
    group is SHARDED, in both of 2 iterations; losses, sharded gradients (``b``'s None) and the
    values after each SGD step equal the unsharded model's."""

    ctx.seed(0)
    model = TrunkTail().to(ctx.device)
    oracle = copy.deepcopy(model)
    ctx.impl.ns.fully_shard([model.a, model.b], mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model.tail, mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = _batch(ctx, step, 7)
        out = model(x[mine])
        _assert_group_sharded(ctx, model, f"after the root's forward of step {step}")
        oout = oracle(x)
        backward_and_compare(ctx, model, oracle, (out, oout, y, mine), (opt, oopt), step)


@check(
    area="mixed_precision",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.MIXED_PRECISION},
    world_sizes=(2,),
)
def group_user_forward_hook(ctx):
    """P65: ``Sequential(Linear(4, 4), Linear(4, 4))`` with a forward hook on the second (returning
    ``2 * out``) registered before ``fully_shard([s[0], s[1]], mp_policy=MixedPrecisionPolicy(
    param_dtype=bfloat16, output_dtype=float32))`` and the root: the hook runs once, sees a bf16
    output and an unsharded (non-DTensor) weight, and the model's output is fp32 and equals the
    unsharded model's (computed in bf16, doubled by the same hook)."""
    from torch.distributed.tensor import DTensor

    ctx.seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(ctx.device)
    oracle = copy.deepcopy(model).to(torch.bfloat16)
    seen = []

    def hook(module, args, out):
        seen.append((out.dtype, isinstance(module.weight, DTensor)))
        return out * 2

    model[1].register_forward_hook(hook)
    oracle[1].register_forward_hook(lambda m, a, out: out * 2)
    policy = ctx.impl.ns.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, output_dtype=torch.float32
    )
    ctx.impl.ns.fully_shard([model[0], model[1]], mesh=ctx.mesh, mp_policy=policy)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(7)).to(ctx.device)
    out = model(x)
    assert seen == [(torch.bfloat16, False)], (
        f"{ctx.where()} the user's hook saw (output dtype, weight is a DTensor) {seen}; expected "
        "one call seeing a bf16 output and the unsharded weight (it runs before FSDP's hook)"
    )
    assert out.dtype == torch.float32, f"{ctx.where()} output dtype {out.dtype}, expected fp32"
    want = oracle(x.to(torch.bfloat16)).float()
    assert_close(ctx, "output after the user's hook", out, want, {"rtol": 1e-2, "atol": 1e-2})


class Injected(Exception):
    """The error a check injects into a forward (caught by the check)."""


@check(
    area="states",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING},
    world_sizes=(1, 2),
)
def reset_after_failed_standalone_call(ctx):
    """P76: ``TrunkTail`` (P63: ``fully_shard(inp)``, the group ``fully_shard([a, b])`` whose ``b``
    never runs, ``fully_shard(tail)`` and the root); one SGD step; then ``model.inp(x)`` called on
    its own raises inside ``inp``'s forward (caught); ``model.reset_iter_state()``; in the next step the group is SHARDED right
    after the root's forward, and losses, sharded gradients and the values after the SGD step
    equal the unsharded model's."""
    ctx.seed(0)
    model = TrunkTail().to(ctx.device)
    oracle = copy.deepcopy(model)
    ctx.impl.ns.fully_shard(model.inp, mesh=ctx.mesh)  # runs first in the root's forward
    ctx.impl.ns.fully_shard([model.a, model.b], mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model.tail, mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = _batch(ctx, step, 7)
        if step == 1:

            def fail_once(*args, **kwargs):  # inp's body: FSDP's pre-forward ran for it
                del model.inp.forward  # the class's forward again from now on
                raise Injected("injected in inp's forward")

            model.inp.forward = fail_once
            try:
                model.inp(torch.zeros(B, 5, device=ctx.device))
            except Injected:
                pass
            else:
                raise AssertionError(f"{ctx.where()} setup: the injected error did not propagate")
            model.reset_iter_state()
        out = model(x[mine])
        _assert_group_sharded(ctx, model, f"after the root's forward of step {step}")
        backward_and_compare(ctx, model, oracle, (out, oracle(x), y, mine), (opt, oopt), step)


class TrunkHeads(nn.Module):
    """Trunk ``inp`` Linear(5, 7) -> tanh; heads ``a`` and ``b`` (Linear(7, 3) each) sharded as
    one group and called outside the root's forward (a chunked loss calling one head)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.a = nn.Linear(7, 3)
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        return torch.tanh(self.inp(x))


@check(
    area="states",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING},
    world_sizes=(1, 2),
)
def partial_group_backward(ctx):
    """P78: ``fully_shard([m.a, m.b])`` and the root over ``TrunkHeads``; each step computes
    ``m.a(m(x))`` (the group's forward runs ``a`` only, outside the root's forward): over two SGD
    steps the loss, the sharded gradients (chunks of the unsharded model's; ``b``'s None) and the
    values after each step equal the unsharded model's, and after each backward every parameter
    is SHARDED (a DTensor)."""
    from torch.distributed.tensor import DTensor

    ctx.seed(0)
    model = TrunkHeads().to(ctx.device)
    oracle = copy.deepcopy(model)
    ctx.impl.ns.fully_shard([model.a, model.b], mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = _batch(ctx, step, 3)
        out, oout = model.a(model(x[mine])), oracle.a(oracle(x))
        backward_and_compare(ctx, model, oracle, (out, oout, y, mine), (opt, oopt), step)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), (
                f"{ctx.where()} step {step}: {name} is registered as {type(param).__name__} after "
                "the step; the group should be SHARDED after its backward"
            )
