"""Area "training", flat-parameter half: FSDP1's sharding strategies other than FULL_SHARD (R19,
R20) and sharding over a given ``process_group`` (R22); area "fsdp1_runtime": HYBRID_SHARD's
default groups when neither ``process_group`` nor ``device_mesh`` is given (R56).

[Note: what each strategy keeps between forward and backward]
A unit's flat parameter of N elements is split over the ranks of its *shard group*: all ranks
for FULL_SHARD and SHARD_GRAD_OP, one rank (nothing split) for NO_SHARD, a row of the 2-D
("replicate", "shard") mesh for HYBRID_SHARD and _HYBRID_SHARD_ZERO2. Outside forward and
backward every rank holds its padded chunk of the unit's parameters flattened in order (R10):
``ceil(N/S)`` elements for a shard group of S ranks, chunk ``rank % S`` (S = 1: the whole flat
parameter, on every rank). Between a unit's forward and its backward:
* FULL_SHARD and HYBRID_SHARD free the gathered parameters after forward and all-gather them
  again (over the shard group) for backward: one all-gather of the padded ``S * ceil(N/S)``
  elements in forward and one in backward;
* SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2 keep the forward's gathered parameters for backward:
  one all-gather in forward, none in backward;
* NO_SHARD never gathers anything.
The gradient is then reduce-scattered over the shard group (FULL_SHARD, SHARD_GRAD_OP; the
hybrid ones then all-reduce the ``ceil(N/S)``-element shard over the replicate group) or, for
NO_SHARD, all-reduced whole (N elements); either way the result is the unsharded model's gradient
averaged over every rank's samples, so training equals the oracle's (``_shared/oracle.py``).

The collectives are observed at the dispatcher (every ``c10d`` / functional collective op,
whatever Python entry point issued it), attributed to the nested unit ``inner`` by size: the
root unit's flat parameter has another size, and what the root does around backward is left
open (upstream keeps the root's parameters gathered after forward under FULL_SHARD).
"""

from __future__ import annotations

import copy
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet, full_params
from conformance.registry import check

B = 2
INNER_NUMEL = 4 * 6 + 6  # inner = Linear(4, 6)


Net = InnerHeadNet  # inner its own unit, head the root's (PLAN)


class _Collectives(TorchDispatchMode):
    """Records (kind, largest tensor numel) of every collective op issued inside it."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
        if name.split(".")[0] in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            op = name.split(".", 1)[1]
            kind = (
                "reduce_scatter"
                if "reduce_scatter" in op
                else "all_gather"
                if "gather" in op
                else "all_reduce"
                if "allreduce" in op or "all_reduce" in op
                else None
            )
            if kind:
                self.calls.append((kind, max(_numel(a) for a in (*args[:2], result))))
        return result


def _numel(value) -> int:
    """Elements of a tensor, or of all tensors of a (nested) list: ``allgather_`` takes the
    output as a list of per-rank chunks."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


def _counts(calls, sizes: set[int]) -> dict[str, int]:
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for kind, numel in calls:
        if numel in sizes:
            out[kind] += 1
    return out


# strategy -> (shard-group size as a function of ws, all-gathers of `inner` in forward, in backward)
STRATEGIES = {
    "SHARD_GRAD_OP": (lambda ws: ws, 1, 0),
    "NO_SHARD": (lambda ws: 1, 0, 0),
    "FULL_SHARD": (lambda ws: ws, 1, 1),
    "HYBRID_SHARD": (lambda ws: 2, 1, 1),
    "_HYBRID_SHARD_ZERO2": (lambda ws: 2, 1, 0),
}
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def _build(ctx, strategy):
    ns = ctx.impl.ns
    kwargs = {"sharding_strategy": getattr(ns.ShardingStrategy, strategy)}
    if strategy in HYBRID:
        kwargs["device_mesh"] = ctx.make_mesh((ctx.world_size // 2, 2), ("replicate", "shard"))
    ctx.seed(0)
    oracle = Net().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", kwargs), ("", kwargs)])
    return model, oracle


def _batch(ctx, step):
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randn(ctx.world_size * B, 4, generator=g)
    return x.to(ctx.device), torch.randn(ctx.world_size * B, 3, generator=g).to(ctx.device)


def _assert_layout(ctx, model, oracle, shards, what):
    """Every unit's flat shard is chunk ``rank % shards`` of its parameters flattened in order."""
    units = ctx.impl.flat_shards(model)
    assert units, f"{ctx.where()} {what}: no flat parameter reported"
    for fqns, flat in units:
        full = torch.cat([oracle.get_parameter(f).detach().reshape(-1).cpu() for f in fqns])
        chunk = math.ceil(full.numel() / shards)
        start = (ctx.rank % shards) * chunk
        want = full[start : start + chunk]
        got = flat.detach().reshape(-1).cpu()
        assert got.numel() == chunk, (
            f"{ctx.where()} {what}: the flat parameter of {fqns} holds {got.numel()} elements, "
            f"expected ceil({full.numel()}/{shards}) = {chunk} (shard group of {shards})"
        )
        assert_close(
            ctx,
            f"{what}: the flat parameter of {fqns} (vs chunk {ctx.rank % shards} of {shards} of "
            "its parameters)",
            got[: want.numel()],
            want,
            FP32["param"],
        )


REQUIRES = {base.TRAINING, base.FLAT_PARAM, base.FSDP1_API}


@check(
    area="training",
    requires=REQUIRES,
    cases={s.lower().strip("_"): {"strategy": s} for s in STRATEGIES if s not in HYBRID},
    world_sizes=(2, 4),
)
def sharding_strategy_collectives(ctx, strategy):
    """R19: under ``SHARD_GRAD_OP``, ``NO_SHARD`` and ``FULL_SHARD`` the unit ``inner`` holds
    chunk ``rank % S`` of its flat parameter (``ceil(30/S)`` elements; S = ws, or 1 for NO_SHARD)
    before and after training; its forward all-gathers it once (NO_SHARD never), its backward
    once more under FULL_SHARD and never under SHARD_GRAD_OP (the forward's gathered parameters
    serve the backward); its gradient is reduce-scattered (NO_SHARD: all-reduced whole); losses
    and parameters after two SGD steps equal the unsharded model's."""
    _run(ctx, strategy)


@check(
    area="training",
    requires=REQUIRES | {base.FSDP1_HYBRID_SHARD},
    cases={s.lower().strip("_"): {"strategy": s} for s in HYBRID},
    world_sizes=(4,),
)
def hybrid_shard_collectives(ctx, strategy):
    """R20: ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2`` with a (2, 2) ("replicate", "shard")
    ``device_mesh``: ``inner`` holds chunk ``rank % 2`` of its flat parameter (15 elements); its
    forward all-gathers the 30 elements over the shard group once, its backward again under
    HYBRID_SHARD and never under _HYBRID_SHARD_ZERO2; the gradient is reduce-scattered over the
    shard group and its 15-element shard all-reduced across the replicate group; losses and
    parameters after two SGD steps equal the unsharded model's on all four ranks' samples."""
    _run(ctx, strategy)


def _run(ctx, strategy):
    """Two SGD steps under ``strategy`` against the oracle (see the module Note)."""
    shard_of, gathers_fwd, gathers_bwd = STRATEGIES[strategy]
    shards = shard_of(ctx.world_size)
    model, oracle = _build(ctx, strategy)
    _assert_layout(ctx, model, oracle, shards, "after construction")
    padded = math.ceil(INNER_NUMEL / shards) * shards
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = _batch(ctx, step)
        fwd, bwd = _Collectives(), _Collectives()
        with fwd:
            out = model(x[mine])
        loss = ((out - y[mine]) ** 2).mean()
        with bwd:
            loss.backward()
        oloss = ((oracle(x) - y) ** 2).mean(dim=1)
        oloss.mean().backward()
        assert_close(ctx, f"step {step} loss", loss, oloss[mine].mean(), FP32["loss"])
        got_fwd = _counts(fwd.calls, {padded})["all_gather"]
        got_bwd = _counts(bwd.calls, {padded})
        assert got_fwd == gathers_fwd, (
            f"{ctx.where()} {strategy} step {step}: inner's forward all-gathered its "
            f"{padded}-element flat parameter {got_fwd} time(s), expected {gathers_fwd}"
        )
        assert got_bwd["all_gather"] == gathers_bwd, (
            f"{ctx.where()} {strategy} step {step}: inner's backward all-gathered its "
            f"{padded}-element flat parameter {got_bwd['all_gather']} time(s), expected "
            f"{gathers_bwd} ({'kept from forward' if not gathers_bwd else 'freed after forward'})"
        )
        if strategy == "NO_SHARD":
            reduced = _counts(bwd.calls, {INNER_NUMEL})
            assert reduced["all_reduce"] == 1 and not reduced["reduce_scatter"], (
                f"{ctx.where()} NO_SHARD step {step}: inner's gradient went through "
                f"{reduced}, expected one all-reduce of its {INNER_NUMEL} elements"
            )
        else:
            assert got_bwd["reduce_scatter"] == 1, (
                f"{ctx.where()} {strategy} step {step}: {got_bwd['reduce_scatter']} "
                f"reduce-scatter(s) of inner's {padded}-element gradient, expected 1"
            )
            if strategy in HYBRID:
                across = _counts(bwd.calls, {padded // shards})["all_reduce"]
                assert across >= 1, (
                    f"{ctx.where()} {strategy} step {step}: no all-reduce of inner's "
                    f"{padded // shards}-element gradient shard across the replicate group"
                )
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
        got = full_params(ctx, model)
        for name, ref in oracle.named_parameters():
            assert_close(ctx, f"{strategy} {name} after step {step}", got[name], ref, FP32["param"])
    _assert_layout(ctx, model, oracle, shards, "after two steps")


@check(area="training", requires=REQUIRES, world_sizes=(4,))
def process_group_subgroups(ctx):
    """R22: ``FullyShardedDataParallel(..., process_group=pg)`` with the pairs {0, 1} and {2, 3}
    as separate groups shards each unit over its pair only: rank r holds chunk ``r % 2`` of 2
    (``ceil(N/2)`` elements), and each pair trains as its own data-parallel job: the flat shards
    after two SGD steps are the chunks of an unsharded model trained on that pair's samples only
    (the pairs' models differ from each other)."""
    import torch.distributed as dist

    # made per call, every rank creating both (the runner releases a check's groups after it)
    group = [dist.new_group([0, 1]), dist.new_group([2, 3])][ctx.rank // 2]
    ctx.seed(0)
    oracle = Net().to(ctx.device)
    kwargs = {"process_group": group}
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", kwargs), ("", kwargs)])
    _assert_layout(ctx, model, oracle, 2, "after construction")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    pair = slice((ctx.rank // 2) * 2 * B, (ctx.rank // 2 + 1) * 2 * B)  # the pair's samples
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = _batch(ctx, step)
        ((model(x[mine]) - y[mine]) ** 2).mean().backward()
        ((oracle(x[pair]) - y[pair]) ** 2).mean().backward()
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
    _assert_layout(ctx, model, oracle, 2, "after two steps (vs the pair's own oracle)")


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_HYBRID_SHARD, base.TRAINING},
    world_sizes=(2,),
)
def hybrid_shard_default_groups(ctx):
    """R56: ``sharding_strategy=HYBRID_SHARD`` on every unit of ``InnerHeadNet`` (``inner`` its
    own unit) with neither ``process_group`` nor ``device_mesh``: a node is ``D`` consecutive
    ranks, ``D`` the device count of the compute device type (1 on the CPU), and each unit shards
    over its node and replicates across nodes, so every rank holds ``ceil(N/D)`` elements of each
    flat parameter (inner 30, root 21) and two SGD steps on the global batch equal the unsharded
    model's."""
    from conformance.registry import Skip

    per_node = getattr(torch, ctx.device.type).device_count()
    if per_node < 1 or ctx.world_size % per_node:
        raise Skip(f"{ctx.world_size} ranks do not fill whole nodes of {per_node} devices")
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    hybrid = {"sharding_strategy": ctx.impl.ns.ShardingStrategy.HYBRID_SHARD}
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", hybrid), ("", hybrid)])
    units = ctx.impl.FSDP.fsdp_modules(model)
    sizes = sorted(u._flat_param.numel() for u in units)
    want = sorted(math.ceil(n / per_node) for n in (30, 21))
    assert sizes == want, (
        f"{ctx.where()} flat parameters of {sizes} elements, expected {want} (sharded over "
        f"nodes of {per_node} ranks)"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        g = torch.Generator().manual_seed(80 + step)
        x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
        (model(x[mine]) ** 2).sum().div(B).backward()
        opt.step()
        opt.zero_grad()
        (oracle(x) ** 2).sum().div(ctx.world_size * B).backward()
        oopt.step()
        oopt.zero_grad()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after two steps", got[name], ref, FP32["param"])
