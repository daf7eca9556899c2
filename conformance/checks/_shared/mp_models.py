"""The mixed-precision model both parts' dtype checks build (``fully_shard/mixed_precision.py`` and
``fsdp1/training.py``): two :class:`Probe` layers that record the dtypes forward sees, the policies
of :data:`CASES` with the compute and reduce dtypes each one implies (see the Note in
``fully_shard/mixed_precision.py``), and :func:`build`, which shards each layer as its own unit
(a plan: the checks that call it require ``auto-wrap``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conformance.checks._shared.models import distinct_values

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


def batch(ctx):
    return (distinct_values((2, 4), 9) / 100.0).to(ctx.device)
