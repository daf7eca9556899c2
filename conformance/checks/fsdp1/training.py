"""Area "training", flat-parameter half: FSDP1 trains like the same model trained in one process.

[Note: the flat oracle]
The oracle is the one of ``_shared/oracle.py`` (see its Note): every rank builds the same model,
keeps an unwrapped copy and feeds it the whole global batch, while rank r feeds samples
``r*B .. (r+1)*B`` to the wrapped model. For a flat parameter the rules become:
* rank r's loss == the oracle's loss on rank r's samples;
* a unit's flat gradient (``flat_param.grad``) is rank r's padded chunk of the oracle's gradients
  of the unit's parameters, flattened in the unit's order and concatenated: elements
  ``[r*c, (r+1)*c)`` with ``c = ceil(N/ws)``, zero past the unpadded numel N (a rank past the end
  holds only zeros);
* after the optimizer steps, every original parameter (reassembled from the ranks' flat shards,
  never through the state-dict code) equals the oracle's.
With ``use_orig_params=True`` the optimizer steps the original parameters' 1-D sharded views; the
same rules hold, with each view's gradient compared with the oracle's elements at the view's offset
(the flat layout then holds alignment padding between parameters). Tolerances are
``training.FP32``.
``no_sync``: inside ``model.no_sync()`` the backward accumulates without communication (no
reduce-scatter is issued); the next synced backward reduces the accumulated gradient, so the flat
gradient after it is the chunk of the oracle's gradient summed over all micro-batches.
Mixed precision (FSDP1 ``MixedPrecision``): forward sees parameters and inputs in ``param_dtype or
orig`` and returns it; the reduce-scatter runs in ``reduce_dtype or param_dtype or orig``; the flat
parameter and its gradient stay in ``orig``; buffers are cast to ``buffer_dtype`` at lazy init.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.collectives import observe_reduce_scatter
from conformance.checks._shared.mp_models import CASES as MP_CASES
from conformance.checks._shared.mp_models import batch as _batch
from conformance.checks._shared.mp_models import build as build_mp
from conformance.checks._shared.oracle import (
    FP32,
    MODELS,
    PLANS,
    B,
    assert_close,
    make_batch,
    make_optimizer,
    per_sample_loss,
)
from conformance.checks._shared.rows import flat_range
from conformance.checks._shared.sd_models import full_params
from conformance.registry import check

FLAT_TRAINING = {base.TRAINING, base.FLAT_PARAM}
BF16, FP16, FP32_DTYPE = torch.bfloat16, torch.float16, torch.float32


def flat_grads(ctx, model) -> list[tuple[list[str], torch.Tensor | None]]:
    grads_of = getattr(ctx.impl, "flat_grads", None)
    if grads_of is None:
        raise base.NotSupported("flat_grads (the flat parameters' gradients)")
    return grads_of(model)


def expected_flat_chunk(ctx, fqns, oracle) -> torch.Tensor:
    """Rank's padded chunk of the oracle's gradients of ``fqns``, flattened and concatenated."""
    flat = torch.cat([oracle.get_parameter(f).grad.detach().reshape(-1).cpu() for f in fqns])
    start, end, chunk = flat_range(flat.numel(), ctx.world_size, ctx.rank)
    out = torch.zeros(chunk, dtype=flat.dtype)
    out[: end - start] = flat[start:end]
    return out


def assert_flat_grads(ctx, model, oracle, what: str, tol=FP32["grad"]) -> None:
    units = flat_grads(ctx, model)
    assert units, f"{ctx.where()} {what}: the implementation reports no flat parameter"
    for fqns, grad in units:
        assert grad is not None, f"{ctx.where()} {what}: flat parameter of {fqns} has no gradient"
        assert_close(
            ctx,
            f"{what}: flat gradient of {fqns} (vs the oracle's padded chunk)",
            grad.reshape(-1),
            expected_flat_chunk(ctx, fqns, oracle),
            tol,
        )


def assert_orig_param_grads(ctx, model, oracle, what: str, tol=FP32["grad"]) -> None:
    """use_orig_params=True: each original parameter's gradient is the oracle's gradient flattened,
    elements ``offset .. offset+n`` of the rank's view (the flat layout may hold alignment padding
    between parameters, so the flat gradient is not compared)."""
    views = ctx.impl.local_shards(model)
    grads = {ctx.impl.clean_fqn(n): p.grad for n, p in model.named_parameters()}
    for name, ref in oracle.named_parameters():
        view, grad = views[name], grads.get(name)
        n = view.local.numel()
        expected = ref.grad.detach().reshape(-1)[view.offset : view.offset + n]
        if n == 0:  # R1: its range does not meet this rank's shard: .grad None
            assert grad is None or ref.numel() == 0, (
                f"{ctx.where()} {what}: {name} holds no elements here but has a gradient of "
                f"{grad.numel()} elements, expected None"
            )
            continue
        assert grad is not None, f"{ctx.where()} {what}: {name} has no gradient"
        assert_close(
            ctx,
            f"{what}: gradient of {name} (vs elements {view.offset}:{view.offset + n} "
            "of the oracle's)",
            grad.reshape(-1),
            expected,
            tol,
        )


def run_flat_parity(
    ctx, model_name="mlp", plan="root", optim="sgd", steps=3, options=None, accumulate=1, tols=FP32
):
    """Train the wrapped model and the oracle side by side and compare (see the module Note).
    ``accumulate``: micro-batches per optimizer step, all but the last inside ``no_sync()``;
    ``tols``: tolerances of the loss, gradient and parameter comparisons."""
    ctx.seed(0)
    model = MODELS[model_name]().to(ctx.device)
    oracle = copy.deepcopy(model)
    model = ctx.impl.shard(model, ctx, plan=PLANS[plan], **(options or {}))
    opt = make_optimizer(optim, model.parameters())
    oopt = make_optimizer(optim, oracle.parameters())
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = make_batch(model_name, ctx.world_size, step * accumulate + micro, ctx.device)
            sync = micro == accumulate - 1
            with (
                contextlib.nullcontext() if sync else model.no_sync(),
                observe_reduce_scatter() as reductions,
                warnings.catch_warnings(record=True) as caught,
            ):
                warnings.simplefilter("always", FutureWarning)
                warnings.simplefilter("always", DeprecationWarning)
                loss = per_sample_loss(model_name, model(x[mine]), y[mine]).mean()
                loss.backward()
            deprecated = [
                str(w.message)
                for w in caught
                if issubclass(w.category, (FutureWarning, DeprecationWarning))
                and "torch.distributed" in str(w.message)
            ]
            assert not deprecated, (
                f"{ctx.where()} step {step}: forward/backward called deprecated torch.distributed "
                f"API(s): {deprecated[:3]} (P6: no deprecation warning in a training iteration)"
            )
            assert sync or not reductions, (
                f"{ctx.where()} step {step}: the backward inside no_sync() reduce-scattered "
                f"{len(reductions)} gradient(s), expected none (accumulate locally)"
            )
            oloss_all = per_sample_loss(model_name, oracle(x), y)
            oloss_all.mean().backward()
            assert_close(
                ctx,
                f"step {step} micro-batch {micro} loss",
                loss,
                oloss_all[mine].mean(),
                tols["loss"],
            )
        if (options or {}).get("use_orig_params"):
            assert_orig_param_grads(ctx, model, oracle, f"step {step}")
        else:
            assert_flat_grads(ctx, model, oracle, f"step {step}", tols["grad"])
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
    assert_params_equal_oracle(ctx, model, oracle, f"after {steps} steps", tols["param"])
    return model


def assert_params_equal_oracle(ctx, model, oracle, what: str, tol=FP32["param"]) -> None:
    """Every original parameter of the flat-parameter ``model`` (from its layout view) equals the
    oracle's."""
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert name in got, f"{ctx.where()} {name} missing from the flat layout ({sorted(got)})"
        assert_close(ctx, f"{name} {what}", got[name], ref, tol)


FLAT_PARITY_CASES = {
    f"{model}-{plan}-{optim}": {"model_name": model, "plan": plan, "optim": optim}
    for model in ("mlp", "tiny")
    for plan in PLANS
    for optim in ("sgd", "adam")
}


@check(area="training", requires=FLAT_TRAINING, cases=FLAT_PARITY_CASES)
def flat_train_parity(ctx, model_name, plan, optim):
    """FSDP1: losses, each unit's flat gradient (the oracle's padded mean-gradient chunk, zero
    padding) and the parameters after 3 steps equal the single-process oracle's (P6)."""
    run_flat_parity(ctx, model_name, plan, optim)


@check(
    area="training",
    requires=FLAT_TRAINING | {base.FSDP1_API},
    cases={
        "mlp-nested-sgd": {"plan": "nested", "optim": "sgd"},
        "tiny-root-adam": {"plan": "root", "optim": "adam", "model_name": "tiny"},
    },
)
def flat_no_sync_accumulation(ctx, plan, optim, model_name="mlp"):
    """FSDP1 ``no_sync()``: two micro-batches per step, the first inside ``model.no_sync()`` (its
    backward issues no reduce-scatter); the flat gradient after the synced one is the oracle's chunk of the gradient summed over both, and
    training matches the oracle (P6)."""
    run_flat_parity(ctx, model_name, plan, optim, steps=2, accumulate=2)


@check(
    area="training",
    requires=FLAT_TRAINING,
    cases={
        "mlp-nested-adam": {"plan": "nested", "optim": "adam"},
        "tiny-root-sgd": {"plan": "root", "optim": "sgd", "model_name": "tiny"},
    },
)
def flat_train_parity_orig_params(ctx, plan, optim, model_name="mlp"):
    """FSDP1 ``use_orig_params=True``: the optimizer steps the original parameters' sharded views
    under their original names; losses, each view's gradient (the oracle's elements at the view's
    offset) and the parameters match the oracle (S17)."""
    model = run_flat_parity(
        ctx, model_name, plan, optim, steps=2, options={"use_orig_params": True}
    )
    names = {ctx.impl.clean_fqn(n) for n, _ in model.named_parameters()}
    expected = {n for n, _ in MODELS[model_name]().named_parameters()}
    assert names == expected, (
        f"{ctx.where()} use_orig_params: named_parameters {sorted(names)}, expected the original "
        f"names {sorted(expected)}"
    )


# bf16 compute against the fp32 oracle: bf16 keeps ~3 significant digits; a missing or doubled
# average, or a gradient reduced from the wrong values, is off by far more
BF16_TOLS = {
    "loss": dict(rtol=2e-2, atol=1e-3),
    "grad": dict(rtol=3e-2, atol=3e-3),
    "param": dict(rtol=2e-2, atol=2e-3),
}


@check(
    area="training",
    requires=FLAT_TRAINING | {base.MIXED_PRECISION},
    cases={"bf16-fp32-reduce": {"reduce": torch.float32}, "bf16-bf16-reduce": {"reduce": None}},
)
def flat_train_parity_bf16(ctx, reduce):
    """FSDP1 ``MixedPrecision(param_dtype=bf16)``: losses, flat gradients and parameters after 2
    SGD steps track the fp32 oracle within bf16 tolerances (loss rtol 2e-2, gradient 3e-2,
    parameters 2e-2), with the reduction in fp32 or bf16 (P5, P6)."""
    mp = {"param_dtype": BF16, "reduce_dtype": reduce}
    run_flat_parity(
        ctx, "mlp", "nested", "sgd", steps=2, options={"mixed_precision": mp}, tols=BF16_TOLS
    )


# ------------------------------------------------------------------------------ mixed precision
def _reduce_dtype(spec) -> torch.dtype:
    mp = spec["mp"]
    return mp.get("reduce_dtype") or mp.get("param_dtype") or spec["orig"]


FLAT_MP_CASES = {k: {"name": k} for k, v in MP_CASES.items() if v["orig"] == FP32_DTYPE}


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.FLAT_PARAM, base.AUTO_WRAP},
    cases=FLAT_MP_CASES,
)
def flat_mixed_precision_dtypes(ctx, name):
    """FSDP1 MixedPrecision: forward sees inputs and parameters in ``param_dtype or orig`` and
    returns it; every reduce-scatter runs in ``reduce_dtype or param_dtype or orig``; the flat
    parameter and its gradient stay ``orig`` (P5)."""
    spec = MP_CASES[name]
    compute, reduce = spec["compute"], _reduce_dtype(spec)
    model = build_mp(ctx, spec["mp"], spec["orig"])
    out = model(_batch(ctx))
    for layer in ("l1", "l2"):
        seen = model.get_submodule(layer).seen[-1]  # FSDP1 wrappers forward attribute reads
        for what in ("input", "weight", "bias"):
            assert seen[what] == compute, (
                f"{ctx.where()} {name}: {layer} saw its {what} in {seen[what]} during forward, "
                f"expected {compute}"
            )
    assert out.dtype == compute, (
        f"{ctx.where()} {name}: output dtype {out.dtype}, expected {compute}"
    )
    with observe_reduce_scatter() as calls:
        out.float().sum().backward()
    if ctx.world_size > 1:
        assert calls and all(c.dtypes == (reduce, reduce) for c in calls), (
            f"{ctx.where()} {name}: reduce-scatters {calls} (op, input, output dtype), expected "
            f"input and output in {reduce}"
        )
    grad_dtype = spec["orig"]
    for fqns, flat in ctx.impl.flat_shards(model):
        assert flat.dtype == spec["orig"], (
            f"{ctx.where()} {name}: flat parameter of {fqns} is {flat.dtype}"
        )
    for fqns, grad in flat_grads(ctx, model):
        assert grad is not None and grad.dtype == grad_dtype, (
            f"{ctx.where()} {name}: flat gradient of {fqns} dtype "
            f"{None if grad is None else grad.dtype}, expected {grad_dtype}"
        )


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.FLAT_PARAM, base.TRAINING},
    cases={
        "bf16-fp32": {"reduce": torch.float32},
        "bf16-none": {"reduce": None},
        "bf16-fp32-orig-params": {"reduce": torch.float32, "orig_params": True},
    },
    min_world_size=2,
)
def flat_keep_low_precision_grads(ctx, reduce, orig_params=False):
    """FSDP1 ``keep_low_precision_grads=True`` (sharded strategies): the flat gradient the
    optimizer sees is in the compute dtype (bf16) with the oracle's values (bf16 tolerance); the
    flat parameter stays fp32, and a second backward accumulates onto it (P5); the same with
    ``use_orig_params=True`` (R6)."""
    mp = {"param_dtype": BF16, "reduce_dtype": reduce, "keep_low_precision_grads": True}
    ctx.seed(0)
    model = MODELS["mlp"]().to(ctx.device)
    oracle = copy.deepcopy(model)
    extra = {"use_orig_params": True} if orig_params else {}
    model = ctx.impl.shard(model, ctx, plan=PLANS["nested"], mixed_precision=mp, **extra)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):  # no zero_grad in between: the second backward accumulates
        x, y = make_batch("mlp", ctx.world_size, step, ctx.device)
        per_sample_loss("mlp", model(x[mine]), y[mine]).mean().backward()
        per_sample_loss("mlp", oracle(x), y).mean().backward()
        for fqns, grad in flat_grads(ctx, model):
            assert grad is not None and grad.dtype == BF16, (
                f"{ctx.where()} backward {step}: flat gradient of {fqns} dtype "
                f"{None if grad is None else grad.dtype}, expected bfloat16 (keep_low_precision_grads)"
            )
        if orig_params:  # alignment padding may sit between the parameters: compare each one's
            assert_orig_param_grads(ctx, model, oracle, f"backward {step}", BF16_TOLS["grad"])
        else:
            assert_flat_grads(ctx, model, oracle, f"backward {step}", BF16_TOLS["grad"])
    for fqns, flat in ctx.impl.flat_shards(model):
        assert flat.dtype == FP32_DTYPE, f"{ctx.where()} flat parameter of {fqns} is {flat.dtype}"


class BufferNet(nn.Module):
    """Linear(4, 3) plus a persistent buffer ``shift`` added in forward; records its dtype."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("shift", torch.full((3,), 0.5))
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        self.seen.append(self.shift.dtype)
        return self.lin(x) + self.shift


@check(
    area="mixed_precision",
    requires={base.MIXED_PRECISION, base.FLAT_PARAM},
    cases={"fp16": {"buffer_dtype": FP16}, "none": {"buffer_dtype": None}},
)
def flat_buffer_dtype(ctx, buffer_dtype):
    """FSDP1 ``MixedPrecision(buffer_dtype=...)``: the root's buffers are cast once at lazy init,
    forward sees them in ``buffer_dtype`` (``None``: unchanged fp32), values intact (P5, S12)."""
    ctx.seed(0)
    model = ctx.impl.shard(
        BufferNet().to(ctx.device), ctx, mixed_precision={"buffer_dtype": buffer_dtype}
    )
    model(torch.ones(2, 4, device=ctx.device))
    want = buffer_dtype or FP32_DTYPE
    assert model.seen == [want], (
        f"{ctx.where()} forward saw the buffer in {model.seen}, expected [{want}]"
    )
    (buf,) = [b for n, b in model.named_buffers() if n.endswith("shift")]
    assert buf.dtype == want and torch.equal(buf.float().cpu(), torch.full((3,), 0.5)), (
        f"{ctx.where()} buffer after forward: {buf.dtype} {buf.tolist()}, expected {want} 0.5s"
    )
