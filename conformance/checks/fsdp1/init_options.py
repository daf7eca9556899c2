"""Area "fsdp1_runtime": FSDP1's deferred initialisation through ``param_init_fn`` (R29).

[Note: materialising a meta-device model]
A model built under ``torch.device("meta")`` has parameters without storage. Given
``param_init_fn``, each FSDP unit whose parameters are still on the meta device calls it once
for every module of its own part of the tree (breadth first from the wrapped module; a nested
unit, already built and materialised, and ignored modules are left out) before flattening. The
oracle is the same model built on the CPU and given the same deterministic values by the same
function (``_shared/sd_models.small_values``, from each parameter's shape and name only).
"""

from __future__ import annotations

import torch

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet, full_params, small_values
from conformance.registry import check

B = 2


def _init_values(module: torch.nn.Module, device) -> None:
    """Materialise ``module``'s own tensors on ``device`` with values fixed by shape and name."""
    module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(module.named_parameters(recurse=False))):
            p.copy_(small_values(p.shape, salt=len(name), index=i))


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_API}, world_sizes=(1, 2))
def param_init_fn_meta(ctx):
    """R29: ``InnerHeadNet`` built on the meta device, wrapped with ``inner`` its own unit and
    ``param_init_fn=fn`` (fn materialises one module's own tensors): fn is called on every
    module once (``inner`` by its unit, the root and ``head`` by the root's), no parameter stays
    on the meta device, and the reassembled parameters and the forward equal the same model
    built on the CPU and given the same values."""
    calls: list[str] = []

    def fn(m):
        calls.append(type(m).__name__)
        _init_values(m, ctx.device)

    with torch.device("meta"):
        meta = InnerHeadNet()
    oracle = InnerHeadNet().to(ctx.device)
    for m in oracle.modules():
        _init_values(m, ctx.device)
    model = ctx.impl.shard(meta, ctx, plan=[("inner", {}), ("", {"param_init_fn": fn})])
    assert sorted(calls) == ["InnerHeadNet", "Linear", "Linear"], (
        f"{ctx.where()} param_init_fn was called on {sorted(calls)}, expected once on each of "
        "InnerHeadNet (the root), inner and head"
    )
    metas = [n for n, p in model.named_parameters() if p.is_meta]
    assert not metas, f"{ctx.where()} parameters still on the meta device: {metas}"
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after param_init_fn", got[name], ref, FP32["param"])
    x = torch.randn(B, 4, generator=torch.Generator().manual_seed(3)).to(ctx.device)
    assert_close(ctx, "forward after param_init_fn", model(x), oracle(x), FP32["loss"])
