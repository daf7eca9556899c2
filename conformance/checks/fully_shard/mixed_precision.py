"""Area "mixed_precision": the dtype rules of ``MixedPrecisionPolicy`` (P5).

[Note: the dtype rules]
Clamping: ``param_dtype`` is dropped (None) when it equals the parameter's original dtype or the
parameter is not floating point; ``reduce_dtype`` is dropped when it equals ``param_dtype``.
Then, per floating-point parameter with original dtype ``orig``:
* compute dtype (what forward sees) = ``param_dtype or orig``; floating-point forward inputs are cast
  to it (``cast_forward_inputs=True``); the output is cast to ``output_dtype`` when given;
* the reduce-scatter runs in ``reduce_dtype or compute dtype`` (input and output of the collective);
* sharded parameters and their sharded gradients stay in ``orig``.
Non-floating parameters keep their dtype everywhere.
The reduce-scatter is observed by wrapping ``torch.distributed.reduce_scatter_single`` (and the
older ``reduce_scatter_tensor`` / ``_reduce_scatter_base``) for the duration of one backward; a world
of one rank has nothing to reduce-scatter, so those checks start at world size 2.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import distinct_values
from conformance.registry import check

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class Probe(nn.Module):
    """A Linear that records the dtypes of its input and parameters inside forward."""

    def __init__(self, fan_in, fan_out, salt, dtype=FP32):
        super().__init__()
        self.weight = nn.Parameter((distinct_values((fan_out, fan_in), salt) / 100.0).to(dtype))
        self.bias = nn.Parameter((distinct_values((fan_out,), salt + 1) / 100.0).to(dtype))
        self.seen: list[dict] = []

    def forward(self, x):
        self.seen.append({"input": x.dtype, "weight": self.weight.dtype, "bias": self.bias.dtype})
        return F.linear(x, self.weight, self.bias)


class Net(nn.Module):
    """Two Probe layers (dims 6 and 3: uneven at ws 4) and an int64 parameter that forward reads."""

    def __init__(self, dtype=FP32, with_int=False):
        super().__init__()
        self.l1 = Probe(4, 6, 0, dtype)
        self.l2 = Probe(6, 3, 2, dtype)
        if with_int:
            self.index = nn.Parameter(torch.arange(5), requires_grad=False)
        self.seen_index: list[torch.dtype] = []

    def forward(self, x):
        if hasattr(self, "index"):
            self.seen_index.append(self.index.dtype)
        return self.l2(torch.tanh(self.l1(x)))


@contextlib.contextmanager
def observe_reduce_scatter():
    """Record (input dtype, output dtype) of every reduce-scatter issued inside the block."""
    calls: list[tuple[torch.dtype, torch.dtype]] = []
    originals = {}

    def wrap(name, fn):
        def spy(*args, **kwargs):
            out = kwargs.get("output", args[0] if args else None)
            inp = kwargs.get("input", args[1] if len(args) > 1 else None)
            if isinstance(inp, (list, tuple)):  # list-input variants
                inp = inp[0]
            calls.append((getattr(inp, "dtype", None), getattr(out, "dtype", None)))
            return fn(*args, **kwargs)

        return spy

    for name in (
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "reduce_scatter",
    ):
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)
            setattr(dist, name, wrap(name, originals[name]))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def build(ctx, mp, dtype=FP32, with_int=False):
    ctx.seed(0)
    model = Net(dtype, with_int).to(ctx.device)
    plan = [("l1", {}), ("l2", {}), ("", {})]
    return ctx.impl.shard(model, ctx, plan=plan, mixed_precision=mp)


# (policy, original dtype) -> expected compute dtype and reduce-scatter dtype
CASES = {
    "bf16-fp32": {
        "mp": {"param_dtype": BF16, "reduce_dtype": FP32},
        "orig": FP32,
        "compute": BF16,
        "reduce": FP32,
    },
    "bf16-none": {"mp": {"param_dtype": BF16}, "orig": FP32, "compute": BF16, "reduce": BF16},
    "bf16-bf16": {
        "mp": {"param_dtype": BF16, "reduce_dtype": BF16},
        "orig": FP32,
        "compute": BF16,
        "reduce": BF16,
    },
    "fp16-none": {"mp": {"param_dtype": FP16}, "orig": FP32, "compute": FP16, "reduce": FP16},
    "fp32-bf16": {
        "mp": {"param_dtype": FP32, "reduce_dtype": BF16},
        "orig": FP32,
        "compute": FP32,
        "reduce": BF16,
    },
    "none-bf16": {"mp": {"reduce_dtype": BF16}, "orig": FP32, "compute": FP32, "reduce": BF16},
    "fp32-fp32": {
        "mp": {"param_dtype": FP32, "reduce_dtype": FP32},
        "orig": FP32,
        "compute": FP32,
        "reduce": FP32,
    },
    # bf16 parameters: param_dtype=bf16 clamps to None, a fp32 reduce stays
    "orig-bf16-bf16-fp32": {
        "mp": {"param_dtype": BF16, "reduce_dtype": FP32},
        "orig": BF16,
        "compute": BF16,
        "reduce": FP32,
    },
    # bf16 parameters upcast for compute
    "orig-bf16-fp32-none": {
        "mp": {"param_dtype": FP32},
        "orig": BF16,
        "compute": FP32,
        "reduce": FP32,
    },
}


def _batch(ctx):
    return (distinct_values((2, 4), 9) / 100.0).to(ctx.device)


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.DTENSOR_PARAMS},
    cases={k: {"name": k} for k in CASES},
)
def compute_and_storage_dtypes(ctx, name):
    """Forward sees inputs and parameters in ``param_dtype or orig``; the output comes out in it; the
    sharded parameters and their sharded gradients stay in the original dtype."""
    spec = CASES[name]
    model = build(ctx, spec["mp"], spec["orig"])
    out = model(_batch(ctx).to(spec["orig"]))
    for layer in ("l1", "l2"):
        seen = model.get_submodule(layer).seen[-1]
        for what in ("input", "weight", "bias"):
            assert seen[what] == spec["compute"], (
                f"{ctx.where()} {name}: {layer} saw its {what} in {seen[what]} during forward, "
                f"expected {spec['compute']} (param_dtype or the original)"
            )
    assert out.dtype == spec["compute"], (
        f"{ctx.where()} {name}: output dtype {out.dtype}, expected {spec['compute']}"
    )
    out.float().sum().backward()
    for fqn, param in model.named_parameters():
        assert param.dtype == spec["orig"], (
            f"{ctx.where()} {name}: sharded {fqn} dtype {param.dtype}, expected {spec['orig']}"
        )
        assert param.grad is not None and param.grad.dtype == spec["orig"], (
            f"{ctx.where()} {name}: sharded grad of {fqn} dtype "
            f"{None if param.grad is None else param.grad.dtype}, expected {spec['orig']}"
        )


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.DTENSOR_PARAMS},
    cases={k: {"name": k} for k in CASES},
    min_world_size=2,
)
def reduce_scatter_dtype(ctx, name):
    """Gradients are reduce-scattered in ``reduce_dtype`` (after clamping), else the compute dtype:
    every reduce-scatter of the backward has input and output in that dtype."""
    spec = CASES[name]
    model = build(ctx, spec["mp"], spec["orig"])
    out = model(_batch(ctx).to(spec["orig"]))
    with observe_reduce_scatter() as calls:
        out.float().sum().backward()
    assert calls, (
        f"{ctx.where()} {name}: no reduce-scatter observed through "
        f"torch.distributed.reduce_scatter_single/_tensor during backward"
    )
    bad = [c for c in calls if c != (spec["reduce"], spec["reduce"])]
    assert not bad, (
        f"{ctx.where()} {name}: reduce-scatter (input, output) dtypes {calls}, expected "
        f"all {spec['reduce']}"
    )


@check(area="mixed_precision", requires={base.MIXED_PRECISION, base.DTENSOR_PARAMS, base.FSDP2_API})
def output_dtype_and_input_cast(ctx):
    """``output_dtype=fp32`` casts the bf16 forward output back to fp32; with
    ``cast_forward_inputs=False`` the root's fp32 input reaches it uncast (each child still casts)."""
    ns = ctx.impl.ns
    model = _net_with_bf16_children(ctx)
    ns.fully_shard(
        model,
        mesh=ctx.mesh,
        mp_policy=ns.MixedPrecisionPolicy(
            param_dtype=BF16, output_dtype=FP32, cast_forward_inputs=False
        ),
    )
    out = model(_batch(ctx))
    assert out.dtype == FP32, (
        f"{ctx.where()} output dtype {out.dtype}, expected float32 (output_dtype)"
    )
    assert model.l1.seen[-1]["input"] == BF16, (
        f"{ctx.where()} l1 (cast_forward_inputs=True) saw its input in {model.l1.seen[-1]['input']}"
    )
    out.sum().backward()


@check(area="mixed_precision", requires={base.MIXED_PRECISION, base.DTENSOR_PARAMS, base.FSDP2_API})
def root_input_not_cast(ctx):
    """A root with ``cast_forward_inputs=False`` and no child of its own sees the fp32 input uncast
    while computing with bf16 parameters."""
    ns = ctx.impl.ns
    ctx.seed(0)
    layer = Probe(4, 6, 0).to(ctx.device)
    ns.fully_shard(
        layer,
        mesh=ctx.mesh,
        mp_policy=ns.MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False),
    )
    x = _batch(ctx)
    try:
        layer(x)
    except RuntimeError:
        pass  # F.linear may reject mixed dtypes; what forward saw is recorded first
    assert layer.seen[-1]["input"] == FP32 and layer.seen[-1]["weight"] == BF16, (
        f"{ctx.where()} forward saw {layer.seen[-1]}, expected an fp32 input and bf16 parameters"
    )
    layer.reshard()


@check(area="mixed_precision", requires={base.MIXED_PRECISION, base.DTENSOR_PARAMS})
def non_float_parameter(ctx):
    """An int64 parameter keeps int64 in forward and in its sharded form under param_dtype=bf16
    (the policy applies to floating-point parameters only), with its values intact."""
    model = build(ctx, {"param_dtype": BF16}, FP32, with_int=True)
    out = model(_batch(ctx))
    assert model.seen_index[-1] == torch.int64, (
        f"{ctx.where()} the int64 parameter was {model.seen_index[-1]} during forward, expected int64"
    )
    assert model.l1.seen[-1]["weight"] == BF16, (
        f"{ctx.where()} l1.weight was {model.l1.seen[-1]['weight']}"
    )
    out.float().sum().backward()
    index = model.index
    assert index.dtype == torch.int64, f"{ctx.where()} sharded int parameter dtype {index.dtype}"
    assert torch.equal(index.full_tensor().cpu(), torch.arange(5)), (
        f"{ctx.where()} int parameter values after forward/backward: {index.full_tensor().tolist()}"
    )


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.DTENSOR_PARAMS, base.FSDP2_API},
    cases={"no-grad": {"mode": "no_grad"}, "inference-mode": {"mode": "inference_mode"}},
)
def output_dtype_without_grad(ctx, mode):
    """``output_dtype`` applies to a forward without autograd too: under ``torch.no_grad()`` or
    ``torch.inference_mode()`` a root with ``param_dtype=bf16, output_dtype=fp32`` returns an
    fp32 output without grad, equal to the output of the grad-enabled forward before it (P5)."""
    ns = ctx.impl.ns
    model = _net_with_bf16_children(ctx)
    ns.fully_shard(
        model, mesh=ctx.mesh, mp_policy=ns.MixedPrecisionPolicy(param_dtype=BF16, output_dtype=FP32)
    )
    x = _batch(ctx)
    expected = model(x)  # first: a first forward under inference_mode makes inference tensors
    with getattr(torch, mode)():
        out = model(x)
    assert out.dtype == FP32 and not out.requires_grad, (
        f"{ctx.where()} {mode}: output {out.dtype} (requires_grad={out.requires_grad}), "
        f"expected float32 without grad (output_dtype)"
    )
    assert expected.dtype == FP32 and torch.equal(out, expected.detach()), (
        f"{ctx.where()} {mode}: the output differs from the grad-enabled forward's "
        f"(max |diff| {(out - expected.detach()).abs().max().item():.3g})"
    )


def _net_with_bf16_children(ctx):
    """``Net`` (seeded) with ``l1`` and ``l2`` each a unit of ``param_dtype=bf16``; the root is
    left for the caller to shard."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = Net().to(ctx.device)
    for layer in ("l1", "l2"):
        ns.fully_shard(
            model.get_submodule(layer),
            mesh=ctx.mesh,
            mp_policy=ns.MixedPrecisionPolicy(param_dtype=BF16),
        )
    return model
