"""Area "mixed_precision": an fp16 gradient reduction whose sum would overflow (P64).

[Note: dividing before the fp16 reduce-scatter]
With ``MixedPrecisionPolicy(reduce_dtype=torch.float16)`` the gradients are averaged over the
ranks in fp16, whose largest finite value is 65504. Summing first and dividing after would
overflow wherever the mean fits but the sum does not, so FSDP2 splits the division by the world
size into a power-of-2 factor applied before the reduce-scatter and the rest after it (at world
size 2: halve, then sum). Rank gradients of 40000 at world size 2 (sum 80000, mean 40000) must
therefore reduce to the finite mean, as the unsharded model on the global batch has it. The
pre-division is exact in binary floating point, so ordinary magnitudes cannot tell.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import assert_close
from conformance.registry import check

SCALE = 50.0
VALUE = 400.0  # with 2 samples per rank: d(loss)/d(weight) = 2 * 400 * 50 = 40000 per element


@check(
    area="mixed_precision",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.MIXED_PRECISION},
    world_sizes=(2,),
)
def fp16_reduce_no_overflow(ctx):
    """P64: a ``fully_shard`` Linear(4, 4, bias=False) with ``reduce_dtype=torch.float16``, every
    rank's gradient 40000 per element (fits fp16; the sum over 2 ranks, 80000, does not): the
    sharded gradient is finite and equals the unsharded model's on the global batch (40000)."""
    ctx.seed(0)
    model = nn.Linear(4, 4, bias=False).to(ctx.device)
    oracle = copy.deepcopy(model)
    policy = ctx.impl.ns.MixedPrecisionPolicy(reduce_dtype=torch.float16)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    x = torch.full((2, 4), VALUE, device=ctx.device)
    (model(x).sum() * SCALE).backward()
    (oracle(x.repeat(ctx.world_size, 1)).sum() * SCALE / ctx.world_size).backward()
    grad = model.weight.grad.full_tensor().float()
    assert torch.isfinite(grad).all(), (
        f"{ctx.where()} the fp16-reduced gradient is not finite ({grad.flatten()[:4].tolist()}): "
        "the sum over ranks overflowed fp16 although the mean (40000) fits"
    )
    assert_close(
        ctx, "fp16-reduced weight.grad", grad, oracle.weight.grad, {"rtol": 1e-3, "atol": 0.0}
    )
