"""Area "fsdp1_runtime": FSDP1's deferred initialisation: through ``param_init_fn`` (R29) and,
without it, by each module's own ``reset_parameters()`` (R52).

[Note: materialising a meta-device model]
A model built under ``torch.device("meta")`` has parameters without storage. Given
``param_init_fn``, each FSDP unit whose parameters are still on the meta device calls it once
for every module of its own part of the tree (breadth first from the wrapped module; a nested
unit, already built and materialised, and ignored modules are left out) before flattening. The
oracle is the same model built on the CPU and given the same deterministic values by the same
function (``_shared/sd_models.small_values``, from each parameter's shape and name only).

[Note: materialising without param_init_fn]
A model built on the meta device and wrapped without ``param_init_fn`` is materialised by its
own ``reset_parameters()``: every module of a unit's part of the tree that holds tensors of its
own gets storage on ``device_id``'s device and one call, a module without own tensors none
(R52). The oracle is the same model built eagerly and given the same values by that method.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
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


class _ResetLinear(nn.Linear):
    """A Linear whose ``reset_parameters`` gives values fixed by shape (and counts its calls)."""

    calls: list[str] = []

    def reset_parameters(self) -> None:
        type(self).calls.append(f"{self.in_features}x{self.out_features}")
        with torch.no_grad():
            self.weight.copy_(small_values(self.weight.shape, salt=self.in_features))
            if self.bias is not None:
                self.bias.copy_(small_values(self.bias.shape, salt=self.out_features, index=1))


class _MetaBody(nn.Module):
    """inner _ResetLinear(4, 6) -> tanh -> head _ResetLinear(6, 3); holds no tensor of its own,
    so its ``reset_parameters`` must never be called."""

    def __init__(self):
        super().__init__()
        self.inner = _ResetLinear(4, 6)
        self.head = _ResetLinear(6, 3)

    def reset_parameters(self) -> None:
        _ResetLinear.calls.append("body")

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x)))


class _MetaNet(nn.Module):
    """``body`` times the root's own parameter ``gain`` (3,), which its ``reset_parameters``
    sets; the root thus holds a tensor of its own above the nested unit ``body.inner``."""

    def __init__(self):
        super().__init__()
        self.body = _MetaBody()
        self.gain = nn.Parameter(torch.empty(3))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _ResetLinear.calls.append("root")
        with torch.no_grad():
            self.gain.copy_(small_values((3,), salt=7))

    def forward(self, x):
        return self.body(x) * self.gain


class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.weight


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_API}, world_sizes=(1, 2))
def meta_reset_parameters(ctx):
    """R52: ``_MetaNet`` built on the meta device, ``body.inner`` its own unit, no
    ``param_init_fn``, ``device_id`` the compute device: ``reset_parameters()`` runs once on
    ``body.inner``, ``body.head`` and the root (not on ``body``, which holds no tensor of its own;
    the root's storage does not touch the nested unit's), nothing stays on the meta device, and the
    parameters and the forward equal the model built eagerly on the CPU. A meta module holding a
    parameter but lacking ``reset_parameters`` is refused with AttributeError naming it."""
    _ResetLinear.calls = []
    oracle = _MetaNet().to(ctx.device)
    with torch.device("meta"):
        meta = _MetaNet()
    _ResetLinear.calls = []
    opts = {"device_id": ctx.device}
    model = ctx.impl.shard(meta, ctx, plan=[("body.inner", opts), ("", opts)])
    calls = sorted(_ResetLinear.calls)
    assert calls == ["4x6", "6x3", "root"], (
        f"{ctx.where()} reset_parameters() ran on {calls}, expected once on inner (4x6), head "
        "(6x3) and the root, never on the tensor-less body"
    )
    metas = [n for n, p in model.named_parameters() if p.is_meta]
    assert not metas, f"{ctx.where()} parameters still on the meta device: {metas}"
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after reset_parameters", got[name], ref, FP32["param"])
    x = torch.randn(B, 4, generator=torch.Generator().manual_seed(4)).to(ctx.device)
    assert_close(ctx, "forward after reset_parameters", model(x), oracle(x), FP32["loss"])
    with torch.device("meta"):
        bare = _NoReset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect_error(
            ctx,
            "a meta module without reset_parameters",
            AttributeError,
            "reset_parameters",
            lambda: ctx.impl.shard(bare, ctx, plan=[("", opts)]),
        )


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_API}, world_sizes=(1, 2))
def partly_meta_module(ctx):
    """R52: ``_MetaBody`` with ``inner`` built eagerly on the CPU and ``head`` on the meta device,
    wrapped as one unit with ``device_id`` the compute device (parameters on the CPU and on the
    meta device are one device plus deferred storage, not a multi-device module): the
    constructor accepts it, nothing stays on the meta device, and the parameters, the forward and
    one SGD step on the same batch on every rank equal the model built eagerly."""
    oracle = _MetaBody().to(ctx.device)
    mixed = _MetaBody()
    with torch.device("meta"):
        mixed.head = _ResetLinear(6, 3)
    model = ctx.impl.shard(mixed, ctx, plan=[("", {"device_id": ctx.device})])
    metas = [n for n, p in model.named_parameters() if p.is_meta]
    assert not metas, f"{ctx.where()} parameters still on the meta device: {metas}"
    x = torch.randn(B, 4, generator=torch.Generator().manual_seed(6)).to(ctx.device)
    assert_close(ctx, "forward of the partly meta module", model(x), oracle(x), FP32["loss"])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.5)
    for m, o in ((model, opt), (oracle, oopt)):
        m(x).square().sum().backward()  # the same batch on every rank: the average is its grad
        o.step()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after one step", got[name], ref, FP32["param"])
