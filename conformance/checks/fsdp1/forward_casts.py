"""Area "mixed_precision", flat-parameter half: which FSDP1 units cast their forward inputs (R21).

[Note: the two cast knobs of MixedPrecision]
With ``MixedPrecision(param_dtype=bf16)`` the parameters compute in bf16, and the inputs are cast
by the units themselves: the root casts its floating-point forward inputs to ``param_dtype`` when
``cast_root_forward_inputs=True`` (the default); every unit, the root included, casts its own
inputs when ``cast_forward_inputs=True`` (default False). So the root sees bf16 iff either knob is
on, and a nested unit, handed an fp32 tensor by its parent, sees bf16 iff ``cast_forward_inputs``.
Integer inputs are never cast. The observation is a forward pre-hook on each wrapped module (it
sees what the unit passes on); the oracle is the rule itself, the module's values are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from conformance.adapters import base
from conformance.registry import check

BF16 = torch.bfloat16


class Recorder(nn.Module):
    """A Linear that records the dtype of the input it receives and computes in its own dtype."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.seen: list[torch.dtype] = []

    def forward(self, x, index=None):
        self.seen.append(x.dtype)
        if index is not None:
            assert index.dtype == torch.int64, f"integer input cast to {index.dtype}"
        return self.lin(x.to(self.lin.weight.dtype))


class Root(Recorder):
    """The root records its own input, then hands its nested unit an fp32 tensor."""

    def __init__(self):
        super().__init__(4, 4)
        self.inner = Recorder(4, 3)

    def forward(self, x, index=None):
        h = super().forward(x, index)
        return self.inner(h.float(), index)


CASES = {
    f"root_{root}-every_{every}": {"root": root, "every": every}
    for root in (True, False)
    for every in (False, True)
}


@check(
    area="mixed_precision",
    requires={base.FLAT_PARAM, base.MIXED_PRECISION, base.AUTO_WRAP},
    cases=CASES,
    world_sizes=(1, 2),
)
def fsdp1_forward_input_casts(ctx, root, every):
    """R21: under ``MixedPrecision(param_dtype=bf16, cast_root_forward_inputs=root,
    cast_forward_inputs=every)`` the root unit receives its fp32 input as bf16 iff ``root`` or
    ``every``, the nested unit receives the fp32 tensor its parent hands it as bf16 iff
    ``every``, and an int64 index reaches both uncast."""
    mp = dict(param_dtype=BF16, cast_root_forward_inputs=root, cast_forward_inputs=every)
    ctx.seed(0)
    module = Root().to(ctx.device)
    model = ctx.impl.shard(module, ctx, plan=[("inner", {}), ("", {})], mixed_precision=mp)
    x = torch.randn(2, 4, device=ctx.device)
    model(x, torch.arange(2, device=ctx.device))
    expected = {"root": BF16 if (root or every) else torch.float32}
    expected["inner"] = BF16 if every else torch.float32
    for name, rec in (("root", module), ("inner", module.inner)):
        assert rec.seen == [expected[name]], (
            f"{ctx.where()} cast_root_forward_inputs={root}, cast_forward_inputs={every}: the "
            f"{name} unit received {rec.seen}, expected [{expected[name]}]"
        )
