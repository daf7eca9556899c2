"""Area "training": gradient accumulation on an HSDP (replicate, shard) mesh (P26, P20, P16).

[Note: the two accumulation knobs of HSDP]
On a 2-D mesh named ("replicate", "shard") a synced backward reduce-scatters each gradient over
the rank's shard group (its row of the mesh) and then all-reduces the result over its replicate
group (its column), so the sharded gradient is the oracle's gradient averaged over every rank's
samples (P16). Two knobs switch parts of that off for accumulation:

* ``set_requires_all_reduce(False)``: the reduce-scatter still runs, the all-reduce does not. The
  reduce-scattered piece is kept *inside* FSDP (it is only a partial sum: it covers this shard
  group's samples), so the backward writes no sharded ``.grad``; the next backward with the
  all-reduce back on adds the kept pieces to its own before the all-reduce, so that gradient owes
  every micro-batch since the last all-reduce: the oracle's chunk of the gradient summed over
  those micro-batches' global batches.
* ``set_requires_gradient_sync(False)``: nothing is reduced at all (P20); each rank sums its own
  unsharded gradients and the first synced backward reduce-scatters and all-reduces the sum.

The oracle is ``_shared/oracle.py``'s unsharded model fed each micro-batch's global batch (losses
are means over ``ws * B`` samples, backwards summed into ``.grad``). A rank's expected shard is
chunk ``rank % shard`` of the oracle's gradient over the shard dim (``(2, 2)`` at world size 4,
``(2, 1)`` at world size 2: pure replication, where only the all-reduce averages).
"""

from __future__ import annotations

import copy

from conformance.adapters import base
from conformance.checks._shared.oracle import (
    FP32,
    MLP,
    PLANS,
    B,
    assert_close,
    make_batch,
    make_optimizer,
    per_sample_loss,
    shard_dim,
)
from conformance.checks._shared.rows import chunk_of
from conformance.registry import check

SHAPES = {2: (2, 1), 4: (2, 2)}  # (replicate, shard) per world size
REQUIRES = {base.TRAINING, base.DTENSOR_PARAMS, base.HSDP, base.FSDP2_API}


def _setup(ctx, plan):
    shape = SHAPES[ctx.world_size]
    mesh = ctx.make_mesh(shape, ("replicate", "shard"))
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS[plan], mesh=mesh)
    return model, oracle, shape[1]


def _backward(ctx, model, oracle, micro):
    x, y = make_batch("mlp", ctx.world_size, micro, ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
    per_sample_loss("mlp", oracle(x), y).mean().backward()


def _assert_no_grad(ctx, model, what):
    for name, param in model.named_parameters():
        assert param.grad is None, (
            f"{ctx.where()} {name}: a sharded .grad after {what}; expected None (the partial "
            "reduction stays inside FSDP until a backward with the all-reduce on)"
        )


def _assert_owed(ctx, model, oracle, shard, what):
    """Each sharded gradient is chunk ``rank % shard`` of the oracle's summed gradient."""
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{ctx.where()} {name}: no sharded gradient {what}"
        expected = chunk_of(
            oracle.get_parameter(name).grad, shard_dim(param), shard, ctx.rank % shard
        )
        assert_close(
            ctx,
            f"{name} sharded gradient {what} (expected the oracle's chunk {ctx.rank % shard} of "
            "the gradient summed over every micro-batch since the last all-reduce)",
            param.grad.to_local(),
            expected,
            FP32["grad"],
        )


def _step_and_compare(ctx, model, oracle, opt, oopt, what):
    opt.step()
    oopt.step()
    opt.zero_grad()
    oopt.zero_grad()
    for name, param in model.named_parameters():
        assert_close(
            ctx,
            f"{name} {what}",
            param.detach().full_tensor(),
            oracle.get_parameter(name),
            FP32["param"],
        )


def _accumulate(ctx, plan, setter):
    """Two micro-batches with ``setter(False)``, a third with ``setter(True)``, a step, then one
    plain step; every observation against the oracle (see the checks' docstrings)."""
    model, oracle, shard = _setup(ctx, plan)
    opt = make_optimizer("sgd", model.parameters())
    oopt = make_optimizer("sgd", oracle.parameters())
    for micro in range(3):
        getattr(model, setter)(micro == 2)
        _backward(ctx, model, oracle, micro)
        if micro < 2:
            _assert_no_grad(ctx, model, f"{setter}(False) micro-batch {micro}")
    _assert_owed(ctx, model, oracle, shard, f"after {setter}(True) on micro-batch 2")
    _step_and_compare(ctx, model, oracle, opt, oopt, "after the accumulated step")
    _backward(ctx, model, oracle, 3)
    _assert_owed(ctx, model, oracle, shard, "of the next step (nothing left over)")
    _step_and_compare(ctx, model, oracle, opt, oopt, "after the next step")


@check(
    area="training",
    requires=REQUIRES | {base.HSDP_ALL_REDUCE},
    cases={"nested": {"plan": "nested"}, "root": {"plan": "root"}},
    world_sizes=(2, 4),
)
def hsdp_all_reduce_off(ctx, plan):
    """P26: on a (replicate, shard) mesh, two micro-batches with ``set_requires_all_reduce(False)``
    leave no sharded ``.grad``; a third backward with it on gives every rank chunk
    ``rank % shard`` of the oracle's gradient summed over the three global batches (the held-back
    reductions are owed, none dropped or counted twice), an SGD step then gives the oracle's
    parameters, and the following plain step owes only its own batch."""
    _accumulate(ctx, plan, "set_requires_all_reduce")


@check(area="training", requires=REQUIRES, world_sizes=(2, 4))
def hsdp_no_sync(ctx):
    """P20/P16: on a (replicate, shard) mesh, two micro-batches with
    ``set_requires_gradient_sync(False)`` leave no sharded ``.grad``; the synced third gives chunk
    ``rank % shard`` of the oracle's gradient summed over the three global batches (reduce-scattered
    over the shard group and all-reduced over the replicate group), and training matches it."""
    _accumulate(ctx, "nested", "set_requires_gradient_sync")


@check(area="training", requires=REQUIRES | {base.HSDP_ALL_REDUCE}, world_sizes=(4,))
def hsdp_all_reduce_per_module(ctx):
    """P26: ``model.out.set_requires_all_reduce(False, recurse=False)`` on a nested model holds
    back only ``out``'s parameters (``inp``'s unit still all-reduces: its sharded gradients after
    the backward are the oracle's chunks, ``out``'s are None); the next backward with it on gives
    ``out``'s parameters the chunk of the gradient summed over both batches, ``inp``'s the sum
    too (its two reductions accumulate in ``.grad``)."""
    model, oracle, shard = _setup(ctx, "nested")
    held = {n for n, _ in model.named_parameters() if n.startswith("out.")}
    model.out.set_requires_all_reduce(False, recurse=False)
    _backward(ctx, model, oracle, 0)
    for name, param in model.named_parameters():
        if name in held:
            assert param.grad is None, (
                f"{ctx.where()} {name}: a sharded .grad with out's all-reduce off; expected None"
            )
        else:
            assert param.grad is not None, (
                f"{ctx.where()} {name}: no sharded .grad although only the root's all-reduce "
                "was switched off on out (recurse=False)"
            )
            expected = chunk_of(
                oracle.get_parameter(name).grad, shard_dim(param), shard, ctx.rank % shard
            )
            assert_close(
                ctx, f"{name} after batch 0", param.grad.to_local(), expected, FP32["grad"]
            )
    if not held:
        raise AssertionError(f"{ctx.where()} setup: out manages no parameter")
    model.out.set_requires_all_reduce(True, recurse=False)
    _backward(ctx, model, oracle, 1)
    _assert_owed(ctx, model, oracle, shard, "after the second backward (all-reduce on)")


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.HSDP_ALL_REDUCE},
    cases={"hsdp": {"hsdp": True}, "1d": {"hsdp": False}},
    world_sizes=(2, 4),
)
def all_reduce_hook(ctx, hsdp):
    """P26: ``model.out.set_all_reduce_hook(hook)`` calls ``hook`` once per backward with
    ``out``'s reduced gradient (on a (replicate, shard) mesh after the all-reduce, on a 1-D mesh
    after the reduce-scatter; its ``ceil(d0/shard)``-row pieces of ``out.weight`` and ``out.bias``
    flattened together) before it lands in ``.grad``: a hook that doubles it in place gives
    ``out``'s parameters twice the oracle's chunks, while ``inp``'s unit (no hook) gets the
    oracle's chunks."""
    if hsdp:
        model, oracle, shard = _setup(ctx, "nested")
    else:
        ctx.seed(0)
        oracle = MLP().to(ctx.device)
        model, shard = (
            ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS["nested"]),
            ctx.world_size,
        )
    seen = []

    def hook(reduced):
        seen.append(reduced.numel())
        reduced.mul_(2)

    model.out.set_all_reduce_hook(hook)
    _backward(ctx, model, oracle, 0)
    rows = -(-oracle.out.weight.shape[0] // shard)  # ceil(3 / shard) padded rows per rank
    expected_numel = rows * oracle.out.weight.shape[1] + rows
    assert seen == [expected_numel], (
        f"{ctx.where()} the hook saw {seen} (numel per call), expected one call with out's "
        f"{expected_numel}-element reduced gradient"
    )
    for name, param in model.named_parameters():
        factor = 2.0 if name.startswith("out.") else 1.0
        expected = factor * chunk_of(
            oracle.get_parameter(name).grad, shard_dim(param), shard, ctx.rank % shard
        )
        assert_close(
            ctx,
            f"{name} sharded gradient with out's all-reduce hook doubling it (factor {factor})",
            param.grad.to_local(),
            expected,
            FP32["grad"],
        )
