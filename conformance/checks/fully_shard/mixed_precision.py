"""Area "mixed_precision": the dtype rules of ``MixedPrecisionPolicy`` (P5), and an fp16 reduce whose
pre-divide must not underflow (P64; its overflow twin is ``reduce_overflow.py``).

[Note: the dtype rules]
Clamping: ``param_dtype`` is dropped (None) when it equals the parameter's original dtype or the
parameter is not floating point; ``reduce_dtype`` is dropped when it equals ``param_dtype``.
Then, per floating-point parameter with original dtype ``orig``:
* compute dtype (what forward sees) = ``param_dtype or orig``; floating-point forward inputs are cast
  to it (``cast_forward_inputs=True``); the output is cast to ``output_dtype`` when given;
* the reduce-scatter runs in ``reduce_dtype or compute dtype`` (input and output of the collective);
* sharded parameters and their sharded gradients stay in ``orig``.
Non-floating parameters keep their dtype everywhere.
The reduce-scatter is observed for the duration of one backward by the shared collective spy
(``_shared/collectives.py``), which sees every path a correct FSDP may take (``torch.distributed``,
functional collectives, DTensor ``redistribute``); a world of one rank has nothing to
reduce-scatter, so those checks start at world size 2. The model, the policies and what each one
implies (:data:`CASES`) are in ``_shared/mp_models.py``; :func:`build` shards each layer as its own
unit, so the checks that call it require ``auto-wrap``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.collectives import observe_reduce_scatter
from conformance.checks._shared.mp_models import CASES, Net, Probe, build
from conformance.checks._shared.mp_models import batch as _batch
from conformance.registry import check

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.DTENSOR_PARAMS, base.AUTO_WRAP},
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
    requires={base.MIXED_PRECISION, base.DTENSOR_PARAMS, base.AUTO_WRAP},
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
        f"{ctx.where()} {name}: no reduce-scatter observed during backward (on any path: "
        f"torch.distributed, functional collectives or DTensor redistribute)"
    )
    bad = [c for c in calls if c.dtypes != (spec["reduce"], spec["reduce"])]
    assert not bad, (
        f"{ctx.where()} {name}: reduce-scatters {bad} (op, input, output dtype), expected "
        f"input and output in {spec['reduce']}"
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


@check(area="mixed_precision", requires={base.MIXED_PRECISION, base.DTENSOR_PARAMS, base.AUTO_WRAP})
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


@check(
    area="mixed_precision",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.MIXED_PRECISION},
    world_sizes=(2,),
)
def fp16_reduce_no_underflow(ctx):
    """P64: the fp16 pre-divide is no larger than needed: a ``fully_shard`` Linear(4, 4,
    bias=False) with ``reduce_dtype=torch.float16``, each rank fed ``full((2, 4), 2^-24)`` (its
    gradient 2^-23 per element, the fp16 subnormal next to the smallest): the sharded gradient is
    exactly the unsharded model's mean gradient on the global batch, 2^-23 (at world size 2 a
    pre-divide of 2 keeps 2^-24, representable; one of 4 would round 2^-25 to 0)."""
    ctx.seed(0)
    model = nn.Linear(4, 4, bias=False).to(ctx.device)
    oracle = copy.deepcopy(model)
    policy = ctx.impl.ns.MixedPrecisionPolicy(reduce_dtype=FP16)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    x = torch.full((2, 4), 2.0**-24, device=ctx.device)
    model(x).sum().backward()
    (oracle(x.repeat(ctx.world_size, 1)).sum() / ctx.world_size).backward()
    expected = oracle.weight.grad.cpu()
    assert torch.equal(expected, torch.full((4, 4), 2.0**-23)), "oracle: not 2^-23"
    grad = model.weight.grad.full_tensor().float().cpu()
    assert torch.equal(grad, expected), (
        f"{ctx.where()} the fp16-reduced gradient is {grad.flatten()[:4].tolist()}, expected "
        f"exactly 2^-23 ({2.0**-23:.6g}) everywhere: the pre-divide underflowed fp16"
    )
