"""Area "training": a sharded model trains like the same model trained in one process (P6, P11).

Every check here runs the single-process oracle of ``_shared/oracle.py`` (see its Note for the
rules and tolerances) next to the sharded model: plain and nested plans, ``reshard_after_forward``,
zero-numel parameters, HSDP, gradient accumulation, bf16, CPU offload and the gradient divide
factor.
"""

from __future__ import annotations

import copy

import torch

from conformance.adapters import base
from conformance.checks._shared.oracle import (
    MLP,
    PLANS,
    B,
    assert_close,
    local_chunk,
    make_batch,
    named_unique,
    per_sample_loss,
    run_parity,
    shard_dim,
)
from conformance.registry import Skip, check

PARITY_CASES = {
    f"{model}-{plan}-{optim}": {"model_name": model, "plan": plan, "optim": optim}
    for model in ("mlp", "tiny")
    for plan in PLANS
    for optim in ("sgd", "adam")
}
PARITY_CASES |= {
    f"tied-root-{optim}": {"model_name": "tied", "plan": "root", "optim": optim}
    for optim in ("sgd", "adam")
}


@check(area="training", requires={base.TRAINING, base.DTENSOR_PARAMS}, cases=PARITY_CASES)
def train_parity(ctx, model_name, plan, optim):
    """Losses, sharded gradients (the oracle's mean-gradient chunk) and parameters after a few steps
    equal those of the same model trained in one process on the same global batch."""
    run_parity(ctx, model_name, plan, optim)


RAF_PARITY = {
    "false-nested-sgd": {"raf": False, "model_name": "mlp", "plan": "nested", "optim": "sgd"},
    "false-root-adam": {"raf": False, "model_name": "tiny", "plan": "root", "optim": "adam"},
}
RAF_INT_PARITY = {  # k = ws/2: backward re-all-gathers from SHARDED_POST_FORWARD over k ranks
    "int-half-nested-sgd": {"raf": "half", "model_name": "mlp", "plan": "nested", "optim": "sgd"},
    "int-half-nested-adam": {
        "raf": "half",
        "model_name": "tiny",
        "plan": "nested",
        "optim": "adam",
    },
}


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.RESHARD_AFTER_FORWARD},
    cases=RAF_PARITY,
)
@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.RESHARD_AFTER_FORWARD},
    cases=RAF_INT_PARITY,
    world_sizes=(4,),
)
def train_parity_reshard_after_forward(ctx, raf, model_name, plan, optim):
    """With ``reshard_after_forward`` False (parameters stay unsharded until backward) or an int
    ``k = ws/2`` (backward re-all-gathers from the SHARDED_POST_FORWARD shards over groups of k),
    losses, sharded gradients and parameters after 3 steps equal the single-process oracle's (P2, P7,
    P6); uneven and sub-world-size dims included."""
    raf = ctx.world_size // 2 if raf == "half" else raf
    run_parity(ctx, model_name, plan, optim, options={"reshard_after_forward": raf})


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS},
    cases={
        "root-sgd": {"plan": "root", "optim": "sgd"},
        "nested-adam": {"plan": "nested", "optim": "adam"},
    },
)
def train_parity_zero_numel_param(ctx, plan, optim):
    """A zero-numel (0,) parameter in a unit does not stop training: its sharded gradient is an
    empty tensor of its shape, and losses, the other gradients and parameters equal the oracle's
    (P1, P6). ``root``: next to the Linear layers in one unit; ``nested``: alone in the root unit.
    (Found by the fuzz area: torch 2.13 fails the reduce-scatter copy-in, "_chunk_cat expects
    non-empty tensor", at every world size.)"""
    run_parity(ctx, "empty", plan, optim)


def _shard_dim1_where_even(ws):
    from torch.distributed.tensor import Shard

    return lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % ws == 0 else Shard(0)


@check(
    area="training",
    requires={
        base.TRAINING,
        base.DTENSOR_PARAMS,
        base.RESHARD_AFTER_FORWARD,
        base.SHARD_PLACEMENT_FN,
    },
    cases={"int-half-4x4": {"model_name": "wide4"}, "int-half-1x4": {"model_name": "wide1"}},
    world_sizes=(4,),
)
def train_parity_raf_int_shard_dim1(ctx, model_name):
    """With an int ``reshard_after_forward`` (k = ws/2) on every unit and ``shard_placement_fn``
    giving Shard(1) to ``out.weight`` ((4, 4) or (1, 4)), the post-forward shards and backward's
    re-all-gather over k ranks keep the values: losses, sharded gradients (the oracle's dim-1
    chunks) and parameters after 3 SGD steps equal the oracle's (P2, P13). (Found by the fuzz
    area: torch 2.13 raises IndexError in foreach_all_gather_copy_out for (4, 4), and a storage
    error in to_sharded_post_forward for (1, 4).)"""
    ws = ctx.world_size
    run_parity(
        ctx,
        model_name,
        "nested",
        "sgd",
        options={
            "reshard_after_forward": ws // 2,
            "shard_placement_fn": _shard_dim1_where_even(ws),
        },
    )


HSDP_PARITY = {  # mesh shape (replicate, shard) per world size
    4: {
        "2x2-nested-sgd": {"shape": (2, 2), "plan": "nested", "optim": "sgd"},
        "2x2-root-adam": {"shape": (2, 2), "plan": "root", "optim": "adam"},
    },
    2: {
        "1x2-nested-sgd": {"shape": (1, 2), "plan": "nested", "optim": "sgd"},
        "2x1-nested-adam": {"shape": (2, 1), "plan": "nested", "optim": "adam"},
    },
}


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.HSDP},
    cases=HSDP_PARITY[4],
    world_sizes=(4,),
)
@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.HSDP},
    cases=HSDP_PARITY[2],
    world_sizes=(2,),
)
def train_parity_hsdp(ctx, shape, plan, optim):
    """On a (replicate, shard) mesh, each rank's sharded gradient is chunk ``rank % shard`` of the
    oracle's gradient averaged over *all* ranks' batches, and losses and parameters after 3 steps
    equal the oracle's (P16, P6)."""
    mesh = ctx.make_mesh(shape, ("replicate", "shard"))
    run_parity(
        ctx, "mlp", plan, optim, options={"mesh": mesh}, shards=(shape[1], ctx.rank % shape[1])
    )


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API},
    cases={
        "mlp-nested-sgd": {"plan": "nested", "optim": "sgd"},
        "mlp-root-adam": {"plan": "root", "optim": "adam"},
    },
)
def grad_accumulation_no_sync(ctx, plan, optim):
    """Two micro-batches per step, the first with ``set_requires_gradient_sync(False)``: the sharded
    gradient after the synced micro-batch is the oracle's chunk of the gradient summed over both
    micro-batches' global batches, and training matches the oracle."""
    run_parity(ctx, "mlp", plan, optim, steps=2, accumulate=2)


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.MIXED_PRECISION},
    cases={"bf16-fp32-reduce": {"reduce": torch.float32}, "bf16-bf16-reduce": {"reduce": None}},
)
def train_parity_bf16(ctx, reduce):
    """With bf16 compute (``param_dtype=bf16``), losses track the fp32 oracle within rtol 2e-2 and
    every step's parameter update is within 5% (norm) of the oracle's; the sharded parameters stay
    fp32."""
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": reduce}
    model = run_parity(
        ctx, "mlp", "nested", "sgd", steps=2, options={"mixed_precision": mp}, mp_tolerance=True
    )
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32, (
            f"{ctx.where()} {name}: sharded param dtype {param.dtype}"
        )


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.CPU_OFFLOAD},
    cases={
        "root-sgd": {"plan": "root", "optim": "sgd"},
        "nested-adam": {"plan": "nested", "optim": "adam"},
    },
)
def train_parity_cpu_offload(ctx, plan, optim):
    """With CPU offload (``CPUOffloadPolicy``) training matches the oracle as without offload: the
    offload path's copies to and from the compute device keep every value (P11, P6)."""
    run_parity(ctx, "mlp", plan, optim, steps=2, options={"cpu_offload": True})


@check(area="training", requires={base.TRAINING, base.DTENSOR_PARAMS, base.CPU_OFFLOAD})
def cpu_offload_placement(ctx):
    """With CPU offload on an accelerator, the sharded parameters and their sharded gradients live on
    the CPU after a step while forward computes on the device (P11). Skipped on a CPU compute device,
    where offloaded and resident tensors are the same tensors."""
    if ctx.device.type == "cpu":
        raise Skip("needs an accelerator: on CPU, offloaded and resident memory are the same")
    model = run_parity(ctx, "mlp", "nested", "sgd", steps=1, options={"cpu_offload": True})
    x, y = make_batch("mlp", ctx.world_size, 99, ctx.device)
    out = model(x[:B])
    assert out.device.type == ctx.device.type, (
        f"{ctx.where()} forward output on {out.device}, expected the compute device {ctx.device}"
    )
    per_sample_loss("mlp", out, y[:B]).mean().backward()
    for name, param in model.named_parameters():
        assert param.to_local().device.type == "cpu", (
            f"{ctx.where()} {name}: offloaded shard on {param.to_local().device}, expected cpu"
        )
        assert param.grad is not None and param.grad.to_local().device.type == "cpu", (
            f"{ctx.where()} {name}: offloaded grad on "
            f"{None if param.grad is None else param.grad.to_local().device}, expected cpu"
        )


# reduce dtype -> (mixed-precision options, tolerance of the reduced gradient against the fp32 oracle)
DIVIDE_DTYPES = {
    "fp32": (None, dict(rtol=1e-5, atol=1e-6)),
    "bf16": ({"param_dtype": torch.bfloat16}, dict(rtol=3e-2, atol=3e-3)),
    "fp16": ({"param_dtype": torch.float16}, dict(rtol=5e-3, atol=5e-4)),
}
DIVIDE_CASES = {
    f"{dtype}-{factor}": {"dtype": dtype, "factor": factor}
    for dtype in DIVIDE_DTYPES
    for factor in ("default", "ws", "3")
}


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API},
    cases=DIVIDE_CASES,
)
def gradient_divide_factor(ctx, dtype, factor):
    """P6: the reduced gradient is the SUM of the ranks' gradients divided by the data-parallel size
    (``default``), or by ``f`` after ``set_gradient_divide_factor(f)`` (``ws``: f equals the world
    size; ``3``: f = 3.0, not a power of two, so fp32/bf16 need a pre-multiplied sum and fp16 a
    pre- and post-divide). Reduced in fp32, bf16 (``param_dtype=bf16``) and fp16
    (``param_dtype=fp16``, where the sum is pre-divided against overflow); compared with the fp32
    oracle's summed gradient divided by f, within the dtype's tolerance. A missing, doubled or
    squared divide is off by a factor of at least 2 at every world size, including 1."""
    ws = ctx.world_size
    mp, tol = DIVIDE_DTYPES[dtype]
    divisor = {"default": ws, "ws": ws, "3": 3.0}[factor]
    ctx.seed(0)
    oracle = MLP().to(ctx.device)
    model = ctx.impl.shard(
        copy.deepcopy(oracle), ctx, plan=None, **({"mixed_precision": mp} if mp else {})
    )
    if factor != "default":
        model.set_gradient_divide_factor(float(divisor))
    x, y = make_batch("mlp", ws, 0, ctx.device)
    # Sums, not means, so that the oracle's gradient is the plain sum of the ranks' gradients.
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    per_sample_loss("mlp", model(x[mine]), y[mine]).sum().backward()
    per_sample_loss("mlp", oracle(x), y).sum().backward()
    for (name, param), (_, ref) in zip(named_unique(model), named_unique(oracle)):
        assert param.grad is not None, f"{ctx.where()} {name}: no sharded gradient after backward"
        expected = local_chunk(ref.grad / divisor, shard_dim(param), ws, ctx.rank)
        assert_close(
            ctx,
            f"{dtype} gradient of {name} divided by {divisor}",
            param.grad.to_local(),
            expected,
            tol,
        )


@check(
    area="training",
    requires={base.TRAINING, base.DTENSOR_PARAMS, base.FSDP2_API, base.MIXED_PRECISION},
)
def gradient_divide_factor_zero_fp16(ctx):
    """P6 taken to its edge: with fp16 reduction (``param_dtype=fp16``) the sum is pre-divided by 1
    and post-divided by the factor, so after ``set_gradient_divide_factor(0.0)`` every element of
    every sharded gradient is the sum divided by zero: not finite (inf, or nan for a zero sum), on
    every rank. (For fp32/bf16 upstream builds ``PREMUL_SUM(1 / 0)`` and raises
    ZeroDivisionError; that degenerate case is not checked.)"""
    ctx.seed(0)
    model = ctx.impl.shard(
        MLP().to(ctx.device), ctx, plan=None, mixed_precision={"param_dtype": torch.float16}
    )
    model.set_gradient_divide_factor(0.0)
    x, y = make_batch("mlp", ctx.world_size, 0, ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    per_sample_loss("mlp", model(x[mine]), y[mine]).sum().backward()
    for name, param in named_unique(model):
        assert param.grad is not None, f"{ctx.where()} {name}: no sharded gradient after backward"
        finite = torch.isfinite(param.grad.to_local()).sum().item()
        assert finite == 0, (
            f"{ctx.where()} {name}: {finite} finite gradient element(s) after dividing by a "
            f"gradient divide factor of 0; expected inf/nan everywhere"
        )
