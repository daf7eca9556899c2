"""Area "training": the FSDPModule setters that tune communication or timing (P31-P37).

[Note: knobs that must not change the values]
Most of ``FSDPModule``'s ``set_*`` methods tune *how* the collectives run (which process group,
how many reduce-scatter buffers in flight, which allocator, whether to wait at the end of a
backward, whether to all-gather again in backward): on a correct implementation none of them
changes a value, so a run with the knob set trains exactly as the unsharded oracle
(``_shared/oracle.run_parity``: sharded gradients are the oracle's chunks, parameters after SGD
steps the oracle's). Where upstream validates the argument, the check asserts its error too.
``set_force_sum_reduction_for_comms`` changes the arithmetic (a SUM collective and a separate
division) but not the result: still the average, or ``sum / f`` after
``set_gradient_divide_factor(f)``.

The non-recursive setters act on the unit they are called on only, so the checks call them on
every unit of the nested MLP (``inp``, ``out``, root).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conformance.adapters import base
from conformance.checks._shared.collectives import NAMESPACES
from conformance.checks._shared.oracle import (
    FP32,
    MLP,
    PLANS,
    B,
    assert_close,
    assert_sharded_grad,
    assert_summed_then_divided,
    make_batch,
    make_optimizer,
    own_grads,
    per_sample_loss,
    run_parity,
    shard_dim,
    step_and_compare,
)
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.prefetch import GatherSpy
from conformance.checks.fully_shard.states import assert_backward_gathers
from conformance.registry import check

REQUIRES = {base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API}


def fsdp_units(ctx, model):
    """Every FSDP unit of ``model`` (root included)."""
    return [m for m in model.modules() if isinstance(m, ctx.impl.ns.FSDPModule)]


def _on_every_unit(ctx, method, *args, **kwargs):
    def apply(model):
        for unit in fsdp_units(ctx, model):
            getattr(unit, method)(*args, **kwargs)

    return apply


# case -> (setter called on every unit, its arguments)
KNOB_CASES = {
    "force-sum-reduction": ("set_force_sum_reduction_for_comms", (True,)),
    "max-input-buffers-2": ("set_reduce_scatter_max_input_buffers", (2,)),
    "pg-allocator": ("set_allocate_memory_from_process_group_for_comm", (True,)),
}


@check(
    area="training",
    requires=REQUIRES,
    cases={name: {"name": name} for name in KNOB_CASES},
)
def comm_knob_training(ctx, name):
    """P31: with the knob set on every unit (``set_force_sum_reduction_for_comms(True)``,
    ``set_reduce_scatter_max_input_buffers(2)``, ``set_allocate_memory_from_process_group_for_comm
    (True)``) two SGD steps of the nested MLP give the oracle's sharded gradients and
    parameters: the knob tunes the collectives, never the values (force-sum: a SUM collective and
    a separate division by the data-parallel size, still the average: from world size 2 every
    reduce-scatter's reduce op is SUM, never AVG or a pre-scaled sum)."""
    method, args = KNOB_CASES[name]
    with GroupSpy() as spy:
        run_parity(ctx, plan="nested", steps=2, after_shard=_on_every_unit(ctx, method, *args))
    if name == "force-sum-reduction" and ctx.world_size > 1:  # AVG gives the same values at 2, 4
        assert spy.reduce_ops == {"sum"}, (
            f"{ctx.where()} force-sum: the reduce-scatters reduce with {sorted(spy.reduce_ops)}, "
            "expected a SUM only (the division by the data-parallel size done apart)"
        )


class GroupSpy(TorchDispatchMode):
    """The process group of every all-gather and reduce-scatter op at the dispatcher (its
    ``group_name``): ``c10d`` ops take the ProcessGroup third, functional ones its name last."""

    def __init__(self):
        super().__init__()
        self.groups: dict[str, set[str]] = {"allgather": set(), "reducescatter": set()}
        self.reduce_ops: set[str] = set()  # each reduce-scatter's reduce op, lower case

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
        kind = next((k for k in self.groups if k in name.replace("_", "")), None)
        if kind is not None and name.split(".")[0] in NAMESPACES:
            group = args[2] if name.startswith("c10d.") else args[-1]
            if not isinstance(group, str):  # a boxed ScriptObject at the dispatcher
                group = dist.ProcessGroup.unbox(group).group_name
            self.groups[kind].add(group)
            for value, arg in zip(args, func._schema.arguments):
                if kind == "reducescatter" and arg.name == "reduce_op":  # a str, or a boxed op
                    op = value if isinstance(value, str) else dist.ReduceOp.RedOpType(value.op())
                    self.reduce_ops.add(getattr(op, "name", op).lower())
        return result


@check(area="training", requires=REQUIRES)
def separate_reduce_scatter_group(ctx):
    """P32: after ``set_separate_reduce_scatter_group()`` (enable=True by default; recursive,
    from the root) every
    reduce-scatter runs on a process group of its own (never the all-gathers' group) over the
    same ranks; two SGD steps give the oracle's gradients and parameters.
    ``set_separate_reduce_scatter_group(False)`` afterwards returns the reduce-scatters to the
    all-gathers' group, and training still equals the oracle."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for enable, steps in ((True, 2), (False, 1)):

        def setter(model, enable=enable):
            model.set_separate_reduce_scatter_group()  # enable=True by default
            if not enable:
                model.set_separate_reduce_scatter_group(False)

        with GroupSpy() as spy:
            run_parity(ctx, plan="nested", steps=steps, after_shard=setter)
        gathers, scatters = spy.groups["allgather"], spy.groups["reducescatter"]
        if ctx.world_size == 1:
            continue  # nothing is communicated
        what = "set_separate_reduce_scatter_group(" + ("True)" if enable else "True), then (False)")
        assert scatters, f"{ctx.where()} {what}: no reduce-scatter seen"
        if enable:
            assert not scatters & gathers, (
                f"{ctx.where()} {what}: reduce-scatters on {sorted(scatters)}, which all-gathers "
                f"({sorted(gathers)}) use too; expected a group of their own"
            )
            for group in scatters:
                ranks = dist.get_process_group_ranks(_resolve_process_group(group))
                assert sorted(ranks) == list(range(ctx.world_size)), (
                    f"{ctx.where()} {what}: the reduce-scatter group {group} spans ranks "
                    f"{ranks}, expected the shard ranks {list(range(ctx.world_size))}"
                )
        else:
            assert scatters <= gathers, (
                f"{ctx.where()} {what}: reduce-scatters on {sorted(scatters - gathers)}, not "
                f"the all-gathers' group {sorted(gathers)}"
            )


@check(
    area="training",
    requires=REQUIRES,
    cases={"f-1": {"factor": 1.0}, "f-ws-half": {"factor": None}, "f-3": {"factor": 3.0}},
    min_world_size=2,
)
def force_sum_with_divide_factor(ctx, factor):
    """P31, P6: ``set_force_sum_reduction_for_comms(True)`` plus ``set_gradient_divide_factor(f)``
    on every unit: the sharded gradient is the sum of the ranks' gradients divided by f, i.e. the
    oracle's mean gradient times ``ws / f`` (f = 1: the plain sum; f = ws / 2: twice the mean).

    Force-sum means the division comes after the sum. With a factor that is not a power of two
    (f = 3) dividing each rank's gradient before summing differs from it in the last bit of some
    elements, so at world size 2 (where a sum of two addends has one order) the gradient must
    equal ``(g0 + g1) / 3`` bit for bit, ``g_r`` being rank r's gradient of its own samples on
    the unsharded model."""
    f = factor if factor is not None else ctx.world_size / 2
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS["nested"])
    for unit in fsdp_units(ctx, model):
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(f)
    x, y = make_batch("mlp", ctx.world_size, 0, ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
    exact = ctx.world_size == 2 and f == 3.0
    if exact:  # each rank's own gradient, summed in the one order two addends have, then / f
        own = own_grads("mlp", oracle, x, y, ctx.world_size, "mean")
    per_sample_loss("mlp", oracle(x), y).mean().backward()
    scale = ctx.world_size / f
    for name, param in model.named_parameters():
        dim = shard_dim(param)
        if exact:
            assert_summed_then_divided(ctx, name, param, own, f)
            continue
        expected = scale * chunk_of(oracle.get_parameter(name).grad, dim, ctx.world_size, ctx.rank)
        assert_close(
            ctx,
            f"{name} sharded gradient with force-sum and divide factor {f} (expected the "
            f"oracle's mean-gradient chunk times ws/f = {scale})",
            param.grad.to_local(),
            expected,
            FP32["grad"],
        )


@check(
    area="training",
    requires=REQUIRES,
    cases={
        "bool": {"value": True, "error": TypeError, "text": "max_input_buffers must be an int"},
        "float": {"value": 2.0, "error": TypeError, "text": "max_input_buffers must be an int"},
        "zero": {
            "value": 0,
            "error": ValueError,
            "text": "max_input_buffers must be a positive int, got 0",
        },
    },
    world_sizes=(1, 2),
)
def max_input_buffers_rejects(ctx, value, error, text):
    """P31: ``set_reduce_scatter_max_input_buffers`` takes an int >= 1: a bool (True is not 1)
    or a float raises TypeError "max_input_buffers must be an int, got <type>", 0 raises
    ValueError "max_input_buffers must be a positive int, got 0"; 1 is accepted."""
    ctx.seed(0)
    model = ctx.impl.shard(MLP().to(ctx.device), ctx, plan=PLANS["nested"])
    model.set_reduce_scatter_max_input_buffers(1)  # the smallest valid value (the default)
    try:
        model.set_reduce_scatter_max_input_buffers(value)
    except error as exc:
        assert text in str(exc), (
            f"{ctx.where()} set_reduce_scatter_max_input_buffers({value!r}): "
            f"{error.__name__} {exc!r} does not say {text!r}"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} set_reduce_scatter_max_input_buffers({value!r}) raised nothing; "
            f"expected {error.__name__} {text!r}"
        )


@check(area="training", requires=REQUIRES)
def is_last_backward_micro_batches(ctx):
    """P33: three micro-batches with synced backwards, ``set_is_last_backward(False)`` before
    the first two and ``True`` before the last: the sharded gradients accumulate into ``.grad``
    and after the last are the oracle's chunks of the gradient summed over the three global
    batches; an SGD step gives the oracle's parameters, and the next (plain) step again."""
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS["nested"])
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step, micros in enumerate((3, 1)):
        for micro in range(micros):
            model.set_is_last_backward(micro == micros - 1)
            x, y = make_batch("mlp", ctx.world_size, 10 * step + micro, ctx.device)
            per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
            per_sample_loss("mlp", oracle(x), y).mean().backward()
        for name, param in model.named_parameters():
            assert_sharded_grad(
                ctx,
                f"step {step}: {name} sharded gradient after {micros} micro-batch(es) (expected "
                "the oracle's chunk of the summed gradient)",
                param,
                oracle.get_parameter(name).grad,
            )
        step_and_compare(ctx, model, oracle, opts, step)


class EmbedNet(nn.Module):
    """Embedding(10, 4) -> Linear(4, 3): the embedding's weight gradient needs only the indices
    and the output gradient, never the weight's values."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)))


@check(area="training", requires=REQUIRES | {base.AUTO_WRAP})
def unshard_in_backward_off(ctx):
    """P34: ``model.emb.set_unshard_in_backward(False)`` on an embedding unit (resharded after
    forward): its backward does not all-gather the weight again (no all-gather at all in backward:
    the root keeps its parameters after forward), yet the weight's sharded gradient
    is the oracle's chunk (rows of the embedding table summed over the global batch's lookups),
    as are the head's, and two SGD steps give the oracle's parameters."""
    ctx.seed(0)
    oracle = EmbedNet().to(ctx.device)
    plan = [("emb", {"reshard_after_forward": True}), ("", {})]
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=plan)
    model.emb.set_unshard_in_backward(False)
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        g = torch.Generator().manual_seed(50 + step)
        idx = torch.randint(0, 10, (ctx.world_size * B, 3), generator=g).to(ctx.device)
        target = torch.randn(ctx.world_size * B, 3, 3, generator=g).to(ctx.device)
        loss = ((model(idx[mine]) - target[mine]) ** 2).mean()
        with GatherSpy() as spy:
            loss.backward()
        if ctx.world_size > 1:  # one rank gathers nothing
            assert not spy.sizes, (
                f"{ctx.where()} step {step}: backward all-gathered {spy.sizes} elements; "
                "expected none (emb has unshard_in_backward=False, the root kept its "
                "parameters after forward)"
            )
        ((oracle(idx) - target) ** 2).reshape(ctx.world_size, -1).mean(1).mean().backward()
        for name, param in model.named_parameters():
            assert_sharded_grad(
                ctx,
                f"step {step}: {name} sharded gradient with emb.set_unshard_in_backward(False)",
                param,
                oracle.get_parameter(name).grad,
            )
        step_and_compare(ctx, model, oracle, opts, step)


@check(area="training", requires=REQUIRES)
def explicit_offload_policy(ctx):
    """P35: ``offload_policy=OffloadPolicy()`` passed explicitly (the no-offload base policy):
    the sharded parameters and their gradients stay on the compute device and two SGD steps
    equal the oracle's."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = copy.deepcopy(oracle)
    for fqn in ("inp", "out", ""):
        ns.fully_shard(model.get_submodule(fqn), mesh=ctx.mesh, offload_policy=ns.OffloadPolicy())
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = make_batch("mlp", ctx.world_size, step, ctx.device)
        per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
        per_sample_loss("mlp", oracle(x), y).mean().backward()
        for name, param in model.named_parameters():
            for what, t in (("parameter", param), ("gradient", param.grad)):
                assert t.device.type == torch.device(ctx.device).type, (
                    f"{ctx.where()} {name}: sharded {what} on {t.device} with OffloadPolicy(), "
                    f"expected the compute device {ctx.device} (no offload)"
                )
            expected = chunk_of(
                oracle.get_parameter(name).grad, shard_dim(param), ctx.world_size, ctx.rank
            )
            assert_close(
                ctx, f"step {step}: {name} sharded gradient", param.grad.to_local(), expected,
                FP32["grad"],
            )  # fmt: skip
        step_and_compare(ctx, model, oracle, opts, step)


@check(area="states", requires=REQUIRES)
def unshard_handle_wait(ctx):
    """P36: ``unit.unshard(async_op=True)`` returns an ``UnshardHandle``; after ``wait()`` the
    unit's parameters are registered UNSHARDED (plain Parameters with the original full values);
    the public base class's own ``wait()`` (a handle with nothing pending) returns None."""
    from torch.distributed.tensor import DTensor

    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS["nested"])
    handle = model.out.unshard(async_op=True)
    assert isinstance(handle, ns.UnshardHandle), (
        f"{ctx.where()} unshard(async_op=True) returned {type(handle).__name__}, expected an "
        "UnshardHandle"
    )
    assert handle.wait() is None, f"{ctx.where()} UnshardHandle.wait() returned a value"
    for name in ("weight", "bias"):
        param = getattr(model.out, name)
        assert isinstance(param, nn.Parameter) and not isinstance(param, DTensor), (
            f"{ctx.where()} out.{name} after wait(): registered {type(param).__name__}, "
            "expected the unsharded plain Parameter"
        )
        assert_close(
            ctx, f"out.{name} after wait()", param, getattr(oracle.out, name), FP32["param"]
        )
    for name, param in model.inp.named_parameters():
        assert isinstance(param, DTensor), (
            f"{ctx.where()} inp.{name}: {type(param).__name__} after out's unshard; unshard is "
            "not recursive, expected the sharded DTensor"
        )
    assert ns.UnshardHandle().wait() is None, (
        f"{ctx.where()} UnshardHandle().wait() (nothing pending) returned a value"
    )


class Raising(Exception):
    pass


class FailInBackward(torch.autograd.Function):
    """Identity whose backward raises: a backward that fails inside a unit, after FSDP's
    pre-backward unsharded it."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Raising("injected in backward")


@check(
    area="states",
    requires=REQUIRES,
    cases={"forward": {"phase": "forward"}, "backward": {"phase": "backward"}},
)
def reset_iter_state_after_failure(ctx, phase):
    """P37: a forward that raises inside ``out``'s forward (``inp`` ran; ``out`` was unsharded
    for it), or a backward that raises inside ``out`` (after its pre-backward unsharded it),
    caught by the caller, then ``model.reset_iter_state()`` on the root: every unit is SHARDED
    again (DTensor parameters) and, after every parameter is halved in place (model and oracle
    alike: no all-gather begun before the reset may be used), the next iterations train as the
    oracle (sharded gradients its chunks, parameters after two SGD steps its values), each
    backward all-gathering out, then inp, once each (ws >= 2; the failed iteration's forward
    order is forgotten). On a non-root unit after lazy init,
    ``reset_iter_state()`` raises RuntimeError "reset_iter_state must be called on the root
    FSDP module". An all-gather still pending at the reset (``inp.unshard(async_op=True)``, never
    waited) is discarded: the halved parameters are what the next forward gathers."""
    from torch.distributed.tensor import DTensor

    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=PLANS["nested"])
    inner = model.out.forward

    def fail_once(*args, **kwargs):  # out's forward body: FSDP's pre-forward unsharded out
        del model.out.forward  # the class's forward again from now on
        if phase == "forward":
            raise Raising("injected in forward")
        return FailInBackward.apply(inner(*args, **kwargs))

    model.out.forward = fail_once
    x, y = make_batch("mlp", ctx.world_size, 0, ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    try:
        per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
    except Raising:
        pass
    else:
        raise AssertionError(f"{ctx.where()} setup: the injected error did not propagate")
    assert model.out.forward == inner, f"{ctx.where()} setup: out.forward not restored"
    for p in model.parameters():
        p.grad = None  # the failed iteration's gradients are lost
    model.inp.unshard(async_op=True)  # an all-gather still pending at the reset (never waited)
    model.reset_iter_state()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), (
            f"{ctx.where()} {name}: registered {type(param).__name__} after reset_iter_state(), "
            "expected the sharded DTensor"
        )
    try:
        model.out.reset_iter_state()
    except RuntimeError as exc:
        assert "root" in str(exc), (
            f"{ctx.where()} out.reset_iter_state(): RuntimeError {exc!r} does not name the root"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} out.reset_iter_state() on a non-root unit raised nothing; expected "
            "RuntimeError 'reset_iter_state must be called on the root FSDP module'"
        )
    with torch.no_grad():  # new values: an all-gather begun before the reset is stale now
        for module in (model, oracle):
            for param in module.parameters():
                param.mul_(0.5)
    opts = [make_optimizer("sgd", model.parameters()), make_optimizer("sgd", oracle.parameters())]
    for step in range(2):
        x, y = make_batch("mlp", ctx.world_size, step, ctx.device)
        loss = per_sample_loss("mlp", model(x[mine]), y[mine]).mean()
        with GatherSpy() as spy:
            loss.backward()
        assert_backward_gathers(ctx, oracle, spy.sizes, f"step {step} after reset_iter_state()")
        per_sample_loss("mlp", oracle(x), y).mean().backward()
        for name, param in model.named_parameters():
            assert_sharded_grad(
                ctx,
                f"step {step} after reset_iter_state(): {name} sharded gradient",
                param,
                oracle.get_parameter(name).grad,
            )
        step_and_compare(ctx, model, oracle, opts, step)
