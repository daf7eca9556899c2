"""Area "fsdp1_runtime": a unit whose parameters have different dtypes is refused (R17).

[Note: one dtype per flat parameter]
A flat parameter is one tensor, so every parameter a unit flattens must have the same dtype.
Building a unit over ``Holder`` (``lin`` = Linear(3, 4) whose bias alone was cast to fp16) raises
ValueError at once; the message names both dtypes (torch.float32 and torch.float16), and a
message that names a parameter together with a dtype ("lin.bias is torch.float16") names it with
its own dtype (upstream names only the dtypes; the reference also names the parameters).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks.fsdp1.summon_full_params import ORIG
from conformance.registry import check


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.lin.bias.data = self.lin.bias.data.half()


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM}, cases=ORIG)
def mixed_dtype_refused(ctx, orig):
    """R17: a unit over parameters of two dtypes (fp32 weight, fp16 bias) raises ValueError
    naming both dtypes; every "<parameter> is <dtype>" it states is true."""
    ctx.seed(0)
    model = Holder().to(ctx.device)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    try:
        ctx.impl.shard(model, ctx, plan=[("", {})], use_orig_params=orig)
    except ValueError as exc:
        text = str(exc)
    else:
        raise AssertionError(
            f"{ctx.where()} a unit over fp32 and fp16 parameters was built; expected ValueError"
        )
    for dtype in (torch.float32, torch.float16):
        assert str(dtype) in text, f"{ctx.where()} the ValueError {text!r} does not name {dtype}"
    for name, dtype in dtypes.items():
        for said in re.findall(rf"(?<![\w.]){re.escape(name)} is (torch\.\w+)", text):
            assert said == str(dtype), (
                f"{ctx.where()} the ValueError says {name} is {said}, but it is {dtype}: {text!r}"
            )
