"""Area "wrap", the modules kept out of mixed precision (batch norm by default): what the helper
FSDP1's auto-wrap calls does to them (``_override_module_mixed_precision``, W19), and what their
own units compute in under a bf16 policy (W11), also after an ignored module (W27).

Expected dtypes and kwargs come from the rules; the values of a cast forward come from the same
module run in fp32 before any hook was attached.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks.wrap import _models as zoo
from conformance.checks.wrap._cases import never_wrap
from conformance.checks.wrap._helpers import Box, device_id, wrap_api
from conformance.registry import check

BF16 = torch.bfloat16
NORM_CLASSES = {nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm}


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def override_module_mixed_precision(ctx):
    """W19: ``_override_module_mixed_precision(root, (_BatchNorm,))`` returns the exact classes of
    the matching modules ({BatchNorm1d, BatchNorm2d, BatchNorm3d, SyncBatchNorm} on BatchNormNet)
    and gives each of them the wrap override mixed_precision=None: ``wrap()`` inside
    ``enable_wrap(mixed_precision=...)`` and ``_recursive_wrap`` (FSDP1's callable-policy path)
    build their units with mixed_precision=None, over the context's and the call's value, while a
    non-matching module keeps the context's; a matching module's forward casts a bf16 input to
    fp32 and its output back to bf16 (the fp32 module's output, rounded to bf16)."""
    override = wrap_api(ctx, "_override_module_mixed_precision")
    W = ctx.impl.ns.wrap
    ctx.seed(0)
    model = zoo.BatchNormNet().eval()  # eval: running statistics, so two forwards agree
    oracle = copy.deepcopy(model)
    found = override(model, (nn.modules.batchnorm._BatchNorm,))
    assert set(found) == NORM_CLASSES, (
        f"{ctx.where()} W19 returned {found}, expected the exact classes {NORM_CLASSES}"
    )

    with W.enable_wrap(wrapper_cls=Box, mixed_precision="low", tag="t"):
        units = {
            "bn1": W.wrap(model.bn1),
            "bn2 (call override)": W.wrap(model.bn2, mixed_precision="call"),
            "lin": W.wrap(model.lin),
            "lin (call override)": W.wrap(model.lin, mixed_precision="call"),
        }
    want = {
        "bn1": {"mixed_precision": None, "tag": "t"},
        "bn2 (call override)": {"mixed_precision": None, "tag": "t"},
        "lin": {"mixed_precision": "low", "tag": "t"},
        "lin (call override)": {"mixed_precision": "call", "tag": "t"},
    }
    for name, unit in units.items():
        assert isinstance(unit, Box) and unit.kwargs == want[name], (
            f"{ctx.where()} W19 wrap({name}) built {getattr(unit, 'kwargs', unit)}, expected "
            f"Box with {want[name]}"
        )

    def wrap_all(module, recurse, nonwrapped_numel):
        return True

    recursive_wrap = wrap_api(ctx, "_recursive_wrap")
    recursive_wrap(model, wrap_all, Box, set(), set(), True, mixed_precision="low")
    got = {n: dict(m.kwargs) for n, m in model.named_children() if isinstance(m, Box)}
    want = {n: {"mixed_precision": None} for n in ("bn1", "bn2", "bn3", "sync_bn")}
    want["lin"] = {"mixed_precision": "low"}
    assert got == want, f"{ctx.where()} W19 _recursive_wrap built {got}, expected {want}"

    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(1))
    out = model.bn1.module(x.to(BF16))
    expected = oracle.bn1(x.to(BF16).float()).to(BF16)
    assert out.dtype == BF16 and torch.equal(out, expected), (
        f"{ctx.where()} W19 bn1 on a bf16 input returned {out.dtype} {out.tolist()}, expected "
        f"the fp32 module's output cast to bf16 {expected.tolist()}"
    )


class _GradDtypes(nn.Module):
    """``lin1`` Linear(4, 8), ``bn`` BatchNorm1d(8), ``lin2`` Linear(8, 4); each records the
    dtype of its weight as its forward sees it and of the gradient that weight gets."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.lin2 = nn.Linear(8, 4)
        self.seen: dict[str, list[tuple[str, torch.dtype]]] = {}
        for name in ("lin1", "bn", "lin2"):
            getattr(self, name).register_forward_pre_hook(self._recorder(name))

    def _recorder(self, name: str):
        def hook(module, args):
            w = module.weight
            log = self.seen.setdefault(name, [])
            log.append(("forward", w.dtype))
            if w.requires_grad:
                w.register_hook(lambda g: log.append(("grad", g.dtype)))

        return hook

    def forward(self, x):
        return self.lin2(torch.relu(self.bn(self.lin1(x))))


class _SpareBeforeNorm(_GradDtypes):
    """``_GradDtypes`` with an unused ``spare`` Linear(2, 2) registered between ``lin1`` and
    ``bn``, so ``modules()`` meets it before the batch norm."""

    def __init__(self):
        super().__init__()
        bn, lin2 = self.bn, self.lin2
        del self.bn, self.lin2
        self.spare = nn.Linear(2, 2)
        self.bn, self.lin2 = bn, lin2


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP1_API, base.MIXED_PRECISION, base.FLAT_PARAM},
    cases={
        "module-policy": {"never": False},
        "never-policy": {"never": True},
        "ignored-before-norm": {"never": False, "ignored": True},
    },
)
def fsdp1_batch_norm_unit_full_precision(ctx, never, ignored=False):
    """W11/W27: with MixedPrecision(param_dtype=bfloat16) and an auto_wrap_policy (one wrapping
    each Linear, or one that never wraps): the batch norm's own unit runs in full precision: its
    weight is fp32 in forward and the gradient it gets is fp32, while the Linear weights compute and get
    gradients in bf16; after backward every unit's sharded flat parameter and its gradient are
    fp32, the batch norm's unit included. W27 (case ignored-before-norm): the same when an
    ignored module (``ignored_modules=[spare]``, an unused Linear registered between ``lin1``
    and ``bn``) comes before the batch norm in ``modules()`` order: the modules after an ignored
    one still get the batch-norm override."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = _SpareBeforeNorm() if ignored else _GradDtypes()
    extra = {"ignored_modules": [model.spare]} if ignored else {}
    policy = never_wrap if never else ns.wrap.ModuleWrapPolicy({nn.Linear})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = ns.FullyShardedDataParallel(
            model,
            auto_wrap_policy=policy,
            mixed_precision=ns.MixedPrecision(param_dtype=BF16),
            device_id=device_id(ctx),
            **extra,
        )
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(ctx.rank), device="cpu")
    wrapped(x.to(ctx.device)).float().sum().backward()
    low = [("forward", BF16), ("grad", BF16)]
    full = [("forward", torch.float32), ("grad", torch.float32)]
    want = {"lin1": low, "bn": full, "lin2": low}
    assert model.seen == want, (
        f"{ctx.where()} W11 (forward weight, gradient) dtypes {model.seen}, expected {want} (the "
        "batch norm's unit without mixed precision)"
    )
    shards = ctx.impl.flat_shards(wrapped)
    grads = dict((tuple(f), g) for f, g in ctx.impl.flat_grads(wrapped))
    assert any(any(f.endswith("bn.weight") for f in fqns) for fqns, _ in shards), (
        f"{ctx.where()} W11: no flat parameter holds bn.weight ({[f for f, _ in shards]})"
    )
    for fqns, shard in shards:
        grad = grads.get(tuple(fqns))
        dtypes = (shard.dtype, None if grad is None else grad.dtype)
        assert dtypes == (torch.float32, torch.float32), (
            f"{ctx.where()} W11 the flat parameter of {fqns} and its gradient are {dtypes}, "
            "expected (float32, float32)"
        )
