"""Area "fsdp1_runtime": FSDP1 constructor knobs that must not change values, and the root's
``check_is_root`` / ``apply`` (R23-R26).

[Note: knobs that schedule, not compute]
``backward_prefetch`` (BACKWARD_PRE, BACKWARD_POST or None) decides when the next unit's
all-gather is issued during backward, and ``limit_all_gathers`` whether the CPU thread may run
ahead of the all-gathers in flight. Neither may change a value: losses, the parameters after SGD
steps (reassembled from the flat shards, ``_shared/sd_models.full_params``) equal the unsharded
model's trained on the global batch (``_shared/oracle.py``'s rule; fp32 tolerances).
"""

from __future__ import annotations

import copy

import torch

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet, full_params
from conformance.registry import check

B = 2
REQUIRES = {base.TRAINING, base.FLAT_PARAM, base.FSDP1_API}


def _batch(ctx, step):
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randn(ctx.world_size * B, 4, generator=g)
    return x.to(ctx.device), torch.randn(ctx.world_size * B, 3, generator=g).to(ctx.device)


def _build(ctx, kwargs):
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", kwargs), ("", kwargs)])
    return model, oracle


def _train(ctx, kwargs, what):
    model, oracle = _build(ctx, kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = _batch(ctx, step)
        loss = ((model(x[mine]) - y[mine]) ** 2).mean()
        loss.backward()
        oloss = ((oracle(x) - y) ** 2).mean(dim=1)
        oloss.mean().backward()
        assert_close(ctx, f"{what} step {step} loss", loss, oloss[mine].mean(), FP32["loss"])
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
        got = full_params(ctx, model)
        for name, ref in oracle.named_parameters():
            assert_close(ctx, f"{what} {name} after step {step}", got[name], ref, FP32["param"])


@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={
        "pre": {"prefetch": "BACKWARD_PRE"},
        "post": {"prefetch": "BACKWARD_POST"},
        "none": {"prefetch": None},
    },
    world_sizes=(1, 2),
)
def backward_prefetch_values(ctx, prefetch):
    """R23: ``backward_prefetch=BackwardPrefetch.BACKWARD_PRE`` / ``BACKWARD_POST`` / None passed
    to every unit (nested ``inner`` and the root): two SGD steps give the unsharded model's
    losses and parameters (prefetching changes only when an all-gather is issued)."""
    ns = ctx.impl.ns
    value = None if prefetch is None else getattr(ns.BackwardPrefetch, prefetch)
    assert value is None or value.name == prefetch, (
        f"{ctx.where()} BackwardPrefetch.{prefetch} is named {value.name!r}"
    )
    _train(ctx, {"backward_prefetch": value}, f"backward_prefetch={prefetch}")


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def limit_all_gathers_off(ctx):
    """R24: ``limit_all_gathers=False`` on every unit: two SGD steps give the unsharded model's
    losses and parameters."""
    _train(ctx, {"limit_all_gathers": False}, "limit_all_gathers=False")


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def check_is_root(ctx):
    """R25: ``check_is_root()`` is True on the outermost unit and False on a nested one, before
    and after the first forward."""
    ns = ctx.impl.ns
    model, _ = _build(ctx, {})
    units = ns.FullyShardedDataParallel.fsdp_modules(model)
    assert len(units) == 2 and units[0] is model, (
        f"{ctx.where()} expected the root and `inner` as FSDP units, got {len(units)}"
    )
    for when in ("before the first forward", "after the first forward"):
        got = [u.check_is_root() for u in units]
        assert got == [True, False], (
            f"{ctx.where()} {when}: check_is_root() of (root, inner) gave {got}, "
            "expected [True, False]"
        )
        if when.startswith("before"):
            x, _ = _batch(ctx, 0)
            model(x[:B])


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def apply_full_params(ctx):
    """R26: ``root.apply(fn)`` calls ``fn`` on every module with the full, unsharded parameters
    (each Linear's weight has its global shape on every rank), and an in-place write inside
    persists into the shards: after ``fill_(rank-independent values)`` the reassembled
    parameters and the forward equal an unsharded model given the same values."""
    model, oracle = _build(ctx, {})
    seen: dict[str, tuple[int, ...]] = {}

    def fn(m):
        if isinstance(m, torch.nn.Linear):
            seen[f"{m.out_features}x{m.in_features}"] = tuple(m.weight.shape)
            with torch.no_grad():
                m.weight.fill_(0.01 * m.out_features)
                m.bias.fill_(-0.02 * m.in_features)

    ret = model.apply(fn)
    assert ret is model, f"{ctx.where()} apply returned {type(ret).__name__}, not the module"
    want = {"6x4": (6, 4), "3x6": (3, 6)}
    assert seen == want, f"{ctx.where()} fn saw the weights' shapes {seen}, expected {want}"
    oracle.apply(fn)
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after apply(fill_)", got[name], ref, FP32["param"])
    x, _ = _batch(ctx, 0)
    assert_close(ctx, "forward after apply", model(x[:B]), oracle(x[:B]), FP32["loss"])


def recording_comm_hook(calls: list):
    """A comm hook that records its state in ``calls`` and sums the gradient over the group: an
    all-reduce for an unsharded unit, a reduce-scatter into ``output`` for a sharded one."""
    import torch.distributed as dist

    def hook(state, grad, output=None):
        calls.append(state)
        if output is None:
            dist.all_reduce(grad)
        else:
            dist.reduce_scatter_tensor(output, grad)

    return hook


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def comm_hook_sum(ctx):
    """R27: ``root.register_comm_hook(state, hook)`` replaces every unit's gradient reduction: a
    hook that sums over ranks without dividing (``hook(state, grad, output)`` reduce-scatters
    into ``output`` when the unit shards; ``hook(state, grad)`` all-reduces in place when it does
    not) is called once per unit with a flat parameter per backward, with ``state`` as given, and
    one SGD step then moves every parameter by ``ws`` times the oracle's averaged gradient. A
    second ``register_comm_hook`` on that root raises AssertionError "A communication hook is
    already registered"."""

    model, oracle = _build(ctx, {})
    token = object()
    calls: list[object] = []

    hook = recording_comm_hook(calls)

    model.register_comm_hook(token, hook)
    units = ctx.impl.ns.FullyShardedDataParallel.fsdp_modules(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    x, y = _batch(ctx, 0)
    ((model(x[mine]) - y[mine]) ** 2).mean().backward()
    ((oracle(x) - y) ** 2).mean().backward()
    assert len(calls) == len(units) and all(s is token for s in calls), (
        f"{ctx.where()} the hook ran {len(calls)} time(s) in one backward (state given each "
        f"time: {all(s is token for s in calls)}), expected once per unit ({len(units)})"
    )
    for p in oracle.parameters():
        p.grad.mul_(ctx.world_size)  # a sum over ranks of the per-rank mean losses' gradients
    opt.step()
    oopt.step()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(
            ctx, f"{name} after a step with the summing hook", got[name], ref, FP32["param"]
        )
    expect_error(
        ctx,
        "register_comm_hook a second time",
        AssertionError,
        "A communication hook is already registered",
        lambda: model.register_comm_hook(token, hook),
    )
