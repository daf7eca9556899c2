"""Area "fsdp1_runtime": FSDP1 construction and root-forward edges (R52-R56, R60, R111).

[Note: what the root's forward and the constructor promise at their edges]
* A model built on the meta device and wrapped without ``param_init_fn`` is materialised by its
  own ``reset_parameters()``: every module of a unit's part of the tree that holds tensors of its
  own gets storage on ``device_id``'s device and one call, a module without own tensors none
  (R52). The oracle is the same model built eagerly and given the same values by that method.
* A unit whose parameters are all frozen has no gradient to reduce, yet it reshards during
  backward as soon as the gradient of its inputs is known, before the backward reaches an earlier
  layer (R53).
* ``FSDP_USE_FULL_PREC_IN_EVAL=1`` makes a mixed-precision model compute in full precision in
  ``eval()`` mode, buffers included, and back in the low precision after ``train()`` (R54).
* ``FSDP_USE_FAKE_ALL_GATHER=1`` or ``FSDP_USE_FAKE_REDUCE=1`` alone skips that collective
  (values undefined) but a forward and backward still complete with the usual shapes (R60).
* ``forward_prefetch=True``, keyword tensor arguments and an evaluation forward under
  ``torch.no_grad()`` between training steps change no value; a nested unit (FSDP1 or
  ``fully_shard``) called with tensors inside a namedtuple, a list of a tuple, an OrderedDict and a
  dataclass gets each in its own container type and trains as the unsharded model (R55).
* The constructor refuses a scalar parameter and an FSDP unit among ``ignored_modules``, and warns
  when the module itself is ignored (R56).
* A unit that has trained as a non-root may be wrapped again under a new root, which then trains
  as the unsharded model (R111).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import os
import warnings
from typing import NamedTuple

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet, full_params, small_values
from conformance.registry import check

B = 2


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


class _FrozenMiddle(nn.Module):
    """pre Linear(4, 4) -> inner Linear(4, 6) (frozen, its own unit) -> tanh -> head Linear(6, 3)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)
        self.inner.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(self.pre(x))))


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.TRAINING},
    cases={"flat": {"orig": False}, "orig_params": {"orig": True}},
    world_sizes=(2,),
)
def frozen_unit_reshards_in_backward(ctx, orig):
    """R53: ``_FrozenMiddle`` with the frozen ``inner`` its own FULL_SHARD unit, an input that
    requires grad: when the input's gradient is computed (a hook on it, after the backward passed
    ``inner``), ``inner``'s flat parameter holds only this rank's ``ceil(30/ws)`` elements; the
    input's gradient and one SGD step equal the unsharded model's (``inner`` unchanged)."""
    ctx.seed(0)
    oracle = _FrozenMiddle().to(ctx.device)
    model = ctx.impl.shard(
        copy.deepcopy(oracle), ctx, plan=[("inner", {}), ("", {})], use_orig_params=orig
    )
    units = ctx.impl.FSDP.fsdp_modules(model)
    inner = next(u for u in units if u is not model)
    seen: list[int] = []
    g = torch.Generator().manual_seed(8)
    x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    y = torch.randn(ctx.world_size * B, 3, generator=g).to(ctx.device)
    mine = x[ctx.rank * B : (ctx.rank + 1) * B].clone().requires_grad_(True)
    mine.register_hook(lambda grad: seen.append(inner._flat_param.numel()))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    # each rank's mean over its samples: FSDP averages the ranks' gradients
    loss = ((model(mine) - y[ctx.rank * B : (ctx.rank + 1) * B]) ** 2).sum() / B
    loss.backward()
    expected = math.ceil(30 / ctx.world_size)
    assert seen == [expected], (
        f"{ctx.where()} when the input's gradient was computed the frozen unit's flat parameter "
        f"held {seen} elements, expected its {expected}-element shard (resharded in backward)"
    )
    ox = x.clone().requires_grad_(True)
    ((oracle(ox) - y) ** 2).sum().div(ctx.world_size * B).backward()
    own = ox.grad[ctx.rank * B : (ctx.rank + 1) * B] * ctx.world_size
    assert_close(ctx, "input gradient", mine.grad, own, FP32["grad"])
    opt.step()
    torch.optim.SGD([p for p in oracle.parameters() if p.requires_grad], lr=0.1).step()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after one step", got[name], ref, FP32["param"])


class _BufBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 3))

    def forward(self, x):
        return self.lin(x) + self.shift


class _EmptyRoot(nn.Module):
    """A root without tensors of its own over one unit ``body`` (Linear(4, 3) + a buffer)."""

    def __init__(self):
        super().__init__()
        self.body = _BufBody()

    def forward(self, x):
        return self.body(x)


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_FULL_PREC_IN_EVAL},
    world_sizes=(1, 2),
)
def full_precision_in_eval(ctx):
    """R54: with ``FSDP_USE_FULL_PREC_IN_EVAL=1`` set at construction and
    ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)`` on ``body`` and on
    the tensor-less root: in ``train()`` mode the forward is bf16 (output and buffer bf16); after
    ``eval()`` it runs in fp32 (buffer fp32, output fp32 equal to the unsharded fp32 model's within
    fp32 tolerance); after ``train()`` again it is bf16 with a bf16 buffer."""
    ctx.seed(0)
    oracle = _EmptyRoot().to(ctx.device)
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    old = os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL")
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        model = ctx.impl.shard(
            copy.deepcopy(oracle), ctx, plan=[("body", {}), ("", {})], mixed_precision=mp
        )
    finally:
        if old is None:
            del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
        else:
            os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = old
    body = next(m for m in model.modules() if isinstance(m, _BufBody))
    seen: list[torch.dtype] = []
    body.register_forward_pre_hook(lambda m, args: seen.append(m.shift.dtype))
    x = torch.randn(B, 4, generator=torch.Generator().manual_seed(6)).to(ctx.device)
    for mode, dtype in (
        ("train", torch.bfloat16),
        ("eval", torch.float32),
        ("train", torch.bfloat16),
    ):
        getattr(model, mode)()
        seen.clear()
        with torch.no_grad():
            out = model(x)
        where = f"forward in {mode}() mode"
        assert seen == [dtype], f"{ctx.where()} {where}: buffer dtype {seen}, expected {dtype}"
        assert out.dtype == dtype, f"{ctx.where()} {where}: output {out.dtype}, expected {dtype}"
        if dtype == torch.float32:
            assert_close(ctx, where, out, oracle(x), FP32["loss"])


FAKE_CASES = {
    "all-gather": {"var": "FSDP_USE_FAKE_ALL_GATHER"},
    "reduce": {"var": "FSDP_USE_FAKE_REDUCE"},
}


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.TRAINING, base.FSDP1_FAKE_COLLECTIVES},
    cases=FAKE_CASES,
    min_world_size=2,
)
def fake_collectives_knob(ctx, var):
    """R60: with one of ``FSDP_USE_FAKE_ALL_GATHER=1`` / ``FSDP_USE_FAKE_REDUCE=1`` (the other
    unset) in the environment while ``InnerHeadNet`` is wrapped (``inner`` its own unit, both
    sharded), a forward and a backward complete: the output has the unsharded model's shape and
    every flat parameter a gradient of its shard's shape (the values are undefined by design).
    The environment is restored right after construction, where the units read it."""
    names = [case["var"] for case in FAKE_CASES.values()]
    saved = {name: os.environ.pop(name, None) for name in names}
    os.environ[var] = "1"
    try:
        ctx.seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = ctx.impl.shard(
                InnerHeadNet().to(ctx.device), ctx, plan=[("inner", {}), ("", {})]
            )
    finally:
        for name, old in saved.items():
            os.environ.pop(name, None)
            if old is not None:
                os.environ[name] = old
    x = torch.randn(B, 4, generator=torch.Generator().manual_seed(8)).to(ctx.device)
    out = model(x)
    assert tuple(out.shape) == (B, 3), f"{ctx.where()} {var}=1: output shape {tuple(out.shape)}"
    out.sum().backward()
    for fqns, grad in ctx.impl.flat_grads(model):
        shard = dict((tuple(f), t) for f, t in ctx.impl.flat_shards(model))[tuple(fqns)]
        assert grad is not None and grad.shape == shard.shape, (
            f"{ctx.where()} {var}=1: flat gradient of {fqns} is "
            f"{None if grad is None else tuple(grad.shape)}, expected {tuple(shard.shape)}"
        )


class _KwNet(nn.Module):
    """InnerHeadNet with a keyword tensor added to the output."""

    def __init__(self):
        super().__init__()
        self.net = InnerHeadNet()

    def forward(self, x, *, offset=None):
        out = self.net(x)
        return out if offset is None else out + offset


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.TRAINING},
    world_sizes=(1, 2),
)
def forward_prefetch_kwargs_no_grad(ctx):
    """R55: ``forward_prefetch=True`` on every unit (``net.inner`` its own unit), the forward
    given a keyword tensor ``offset``; two SGD steps on the global batch with an evaluation
    forward under ``torch.no_grad()`` between them: the evaluation output and the parameters after
    each step equal the unsharded model's."""
    ctx.seed(0)
    oracle = _KwNet().to(ctx.device)
    pf = {"forward_prefetch": True}
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("net.inner", pf), ("", pf)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        g = torch.Generator().manual_seed(40 + step)
        x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
        off = torch.randn(ctx.world_size * B, 3, generator=g).to(ctx.device)
        ((model(x[mine], offset=off[mine]) ** 2).sum() / B).backward()
        opt.step()
        opt.zero_grad()
        ((oracle(x, offset=off) ** 2).sum() / (ctx.world_size * B)).backward()
        oopt.step()
        oopt.zero_grad()
        got = full_params(ctx, model)
        for name, ref in oracle.named_parameters():
            assert_close(ctx, f"{name} after step {step}", got[name], ref, FP32["param"])
        if step == 0:
            with torch.no_grad():
                assert_close(
                    ctx,
                    "no_grad forward between steps",
                    model(x[mine], offset=off[mine]),
                    oracle(x[mine], offset=off[mine]),
                    FP32["loss"],
                )


class _ScalarGain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.gain = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.gain


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_API}, world_sizes=(1,))
def constructor_refusals(ctx):
    """R56: a module holding a 0-dim parameter ``gain`` is refused with ValueError naming
    ``gain`` as scalar; an FSDP unit among ``ignored_modules`` is refused with ValueError "should
    not include FSDP modules"; ignoring the wrapped module itself warns (UserWarning "top-level
    module"), the forward then equal to the unwrapped module's."""
    fsdp = ctx.impl.FSDP
    dev = {"device_id": ctx.device}
    expect_error(
        ctx,
        "a scalar parameter",
        ValueError,
        r"(?i)scalar.*gain|gain.*scalar",
        lambda: fsdp(_ScalarGain().to(ctx.device), **dev),
    )
    ctx.seed(0)
    inner = fsdp(nn.Linear(4, 4).to(ctx.device), **dev)
    outer = nn.Sequential(inner, nn.Linear(4, 2)).to(ctx.device)
    expect_error(
        ctx,
        "ignored_modules=[an FSDP unit]",
        ValueError,
        "should not include FSDP modules",
        lambda: fsdp(outer, ignored_modules=[inner], **dev),
    )
    plain = nn.Linear(4, 3).to(ctx.device)
    ref = copy.deepcopy(plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fsdp(plain, ignored_modules=[plain], **dev)
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any("top-level module" in t for t in texts), (
        f"{ctx.where()} ignoring the wrapped module itself gave the warnings {texts}, expected one "
        "naming the top-level module"
    )
    x = torch.randn(B, 4, generator=torch.Generator().manual_seed(2)).to(ctx.device)
    assert_close(ctx, "forward with everything ignored", model(x), ref(x), FP32["loss"])


# ------------------------------------------------------------------ structured unit arguments
class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class _Box:
    t: torch.Tensor
    tag: str


class _StructBlock(nn.Module):
    """Reads every tensor of its structured arguments; records the container types it got."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple] = []

    def forward(self, pair, items, *, extra, box):
        self.seen.append((type(pair), type(items), type(items[1]), type(extra), type(box), box.tag))
        h = self.lin(pair.a * 2.0 + pair.b) + items[0] * 3.0 + items[1][0]
        return torch.tanh(h) * extra["s"] + box.t * 0.5 + extra["k"]


class _StructNet(nn.Module):
    """pre Linear(4, 8) split in two halves feeding ``block`` (its own unit) through a namedtuple,
    a list holding a tuple, an OrderedDict and a dataclass, each field its own tensor."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 8)
        self.block = _StructBlock()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        u, v = self.pre(x).chunk(2, dim=-1)
        extra = collections.OrderedDict(s=torch.sigmoid(v), k=1)
        out = self.block(_Pair(u, v), [v * u, (u - v,)], extra=extra, box=_Box(u + v, "box"))
        return self.head(out)


@check(area="training", requires={base.TRAINING}, world_sizes=(1, 2))
def structured_unit_arguments(ctx):
    """R55: a nested unit (FSDP1 unit or fully_shard module) called with tensors that require
    grad inside a namedtuple, a list holding a tuple, an ``OrderedDict`` keyword argument (with a
    non-tensor entry) and a dataclass keyword argument (with a string field): the wrapped forward
    gets each argument in its own container type with every field in its place, and two SGD
    steps on the global batch (each rank its own samples) equal the unsharded model's."""
    ctx.seed(0)
    oracle = _StructNet().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("block", {}), ("", {})])
    block = next(m for m in model.modules() if isinstance(m, _StructBlock))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    want = (_Pair, list, tuple, collections.OrderedDict, _Box, "box")
    for step in range(2):
        g = torch.Generator().manual_seed(60 + step)
        x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
        block.seen.clear()
        (model(x[mine]) ** 2).sum().div(B).backward()
        assert block.seen == [want], (
            f"{ctx.where()} step {step}: the unit's forward got {block.seen}, expected {want}"
        )
        opt.step()
        opt.zero_grad()
        (oracle(x) ** 2).sum().div(ctx.world_size * B).backward()
        oopt.step()
        oopt.zero_grad()
        got = full_params(ctx, model)
        for name, ref in oracle.named_parameters():
            assert_close(ctx, f"{name} after step {step}", got[name], ref, FP32["param"])


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_HYBRID_SHARD, base.TRAINING},
    world_sizes=(2,),
)
def hybrid_shard_default_groups(ctx):
    """R56: ``sharding_strategy=HYBRID_SHARD`` on every unit of ``InnerHeadNet`` (``inner`` its
    own unit) with neither ``process_group`` nor ``device_mesh``: a node is ``D`` consecutive
    ranks, ``D`` the device count of the compute device type (1 on the CPU), and each unit shards
    over its node and replicates across nodes, so every rank holds ``ceil(N/D)`` elements of each
    flat parameter (inner 30, root 21) and two SGD steps on the global batch equal the unsharded
    model's."""
    from conformance.registry import Skip

    per_node = getattr(torch, ctx.device.type).device_count()
    if per_node < 1 or ctx.world_size % per_node:
        raise Skip(f"{ctx.world_size} ranks do not fill whole nodes of {per_node} devices")
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    hybrid = {"sharding_strategy": ctx.impl.ns.ShardingStrategy.HYBRID_SHARD}
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", hybrid), ("", hybrid)])
    units = ctx.impl.FSDP.fsdp_modules(model)
    sizes = sorted(u._flat_param.numel() for u in units)
    want = sorted(math.ceil(n / per_node) for n in (30, 21))
    assert sizes == want, (
        f"{ctx.where()} flat parameters of {sizes} elements, expected {want} (sharded over "
        f"nodes of {per_node} ranks)"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        g = torch.Generator().manual_seed(80 + step)
        x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
        (model(x[mine]) ** 2).sum().div(B).backward()
        opt.step()
        opt.zero_grad()
        (oracle(x) ** 2).sum().div(ctx.world_size * B).backward()
        oopt.step()
        oopt.zero_grad()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after two steps", got[name], ref, FP32["param"])


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_RUNTIME}, world_sizes=(1, 2))
def root_calls_refused_inside_summon(ctx):
    """R56: inside ``summon_full_params`` on the root (``InnerHeadNet``, ``inner`` its own unit,
    after one forward and backward), ``root.clip_grad_norm_(0.01)`` and entering
    ``root.no_sync()`` are refused with ValueError "expected to be in states"; nothing is
    clipped: after exit the full gradients equal the unsharded model's."""
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", {}), ("", {})])
    x = torch.randn(ctx.world_size * B, 4, generator=torch.Generator().manual_seed(9))
    x = x.to(ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    (model(x[mine]) ** 2).sum().div(B).backward()
    (oracle(x) ** 2).sum().div(ctx.world_size * B).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    def enter_no_sync():
        with model.no_sync():
            pass

    with ctx.impl.FSDP.summon_full_params(model):
        for what, call in (
            ("clip_grad_norm_", lambda: model.clip_grad_norm_(0.01)),
            ("no_sync()", enter_no_sync),
        ):
            expect_error(
                ctx,
                f"{what} inside summon_full_params",
                ValueError,
                "expected to be in states",
                call,
            )
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), f"{ctx.where()} {name}: gradient changed"
    total = model.clip_grad_norm_(1e6)  # accepted again after exit; nothing clipped
    ref = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1e6)
    assert_close(ctx, "clip_grad_norm_ after exit", total, ref, FP32["grad"])


class _SideOutput(nn.Module):
    """head(tanh(trunk(x))) and, computed but left out of the loss, side(x)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.side = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.trunk(x))), self.side(x)


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.TRAINING},
    world_sizes=(2,),
)
def unit_outside_loss_resharded(ctx):
    """R53: ``trunk`` and ``side`` (30 elements each) their own SHARD_GRAD_OP units (which keep
    the gathered parameters from forward to backward), ``side``'s output computed but left out of
    the loss: after backward every unit's flat parameter holds only this rank's ``ceil(N/ws)``
    elements, ``side`` included, and one SGD step equals the unsharded model's (``side``
    unchanged)."""
    ctx.seed(0)
    oracle = _SideOutput().to(ctx.device)
    zero2 = {"sharding_strategy": ctx.impl.ns.ShardingStrategy.SHARD_GRAD_OP}
    model = ctx.impl.shard(
        copy.deepcopy(oracle), ctx, plan=[("trunk", zero2), ("side", zero2), ("", {})]
    )
    units = ctx.impl.FSDP.fsdp_modules(model)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    (model(x[mine])[0] ** 2).sum().div(B).backward()
    for u in units:
        if u is model:
            continue
        want = math.ceil(30 / ctx.world_size)
        got = u._flat_param.numel()
        assert got == want, (
            f"{ctx.where()} after backward a SHARD_GRAD_OP unit's flat parameter holds {got} "
            f"elements, expected its {want}-element shard"
        )
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    (oracle(x)[0] ** 2).sum().div(ctx.world_size * B).backward()
    torch.optim.SGD(oracle.parameters(), lr=0.1).step()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{name} after one step", got[name], ref, FP32["param"])


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_RUNTIME, base.TRAINING},
    world_sizes=(2,),
)
def clip_grad_norm_mixed_strategies(ctx):
    """R56: ``InnerHeadNet`` with ``inner`` a NO_SHARD unit under a FULL_SHARD root: before any
    backward ``root.clip_grad_norm_(1.0)`` returns 0 in fp32 with a UserWarning naming "no
    gradients" and leaves every gradient None; after a backward ``clip_grad_norm_(1e6)`` returns
    the unsharded gradients' 2-norm (the NO_SHARD gradient counted once, nothing clipped),
    ``clip_grad_norm_(0.05, norm_type=inf)`` their largest entry, and an SGD step on the clipped gradients equals the unsharded model's after
    ``torch.nn.utils.clip_grad_norm_(..., 0.05, inf)``."""
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    no_shard = {"sharding_strategy": ctx.impl.ns.ShardingStrategy.NO_SHARD}
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", no_shard), ("", {})])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total = model.clip_grad_norm_(1.0)
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any("no gradients" in t for t in texts), (
        f"{ctx.where()} clip_grad_norm_ without gradients warned {texts}, expected 'no gradients'"
    )
    assert total.dtype == torch.float32 and float(total) == 0.0, (
        f"{ctx.where()} clip_grad_norm_ without gradients returned {total!r}, expected 0 (fp32)"
    )
    assert all(p.grad is None for p in model.parameters()), f"{ctx.where()} a gradient appeared"
    g = torch.Generator().manual_seed(14)
    x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    (model(x[ctx.rank * B : (ctx.rank + 1) * B]) ** 2).sum().div(B).backward()
    (oracle(x) ** 2).sum().div(ctx.world_size * B).backward()
    total = model.clip_grad_norm_(1e6)  # the 2-norm, nothing clipped
    ref = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1e6)
    assert_close(ctx, "2-norm total (the NO_SHARD gradient counted once)", total, ref, FP32["grad"])
    total = model.clip_grad_norm_(0.05, norm_type=math.inf)
    ref = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.05, norm_type=math.inf)
    assert_close(ctx, "inf-norm total", total, ref, FP32["grad"])
    assert float(ref) > 0.05, f"{ctx.where()} test setup: the gradients need clipping ({ref})"
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    torch.optim.SGD(oracle.parameters(), lr=0.5).step()
    got = full_params(ctx, model)
    for name, p in oracle.named_parameters():
        assert_close(ctx, f"{name} after a clipped step", got[name], p, FP32["param"])


# ------------------------------------------------------------------------------ R111
def _rewrap_step(ctx, model, oracle, opts, salt: int, what: str) -> None:
    """One SGD step of ``model`` on rank r's samples and of ``oracle`` on the global batch; the
    losses agree."""
    g = torch.Generator().manual_seed(salt)
    x = torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    loss = model(x[mine]).square().mean()
    loss.backward()
    oloss = oracle(x).square().mean(dim=1)
    oloss.mean().backward()
    assert_close(ctx, f"{what}: loss", loss, oloss[mine].mean(), FP32["loss"])
    for opt in opts:
        opt.step()
        opt.zero_grad()


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_API, base.TRAINING})
def trained_unit_under_new_root(ctx):
    """R111: an FSDP1 unit that has trained as a non-root may be wrapped again under a new root:
    ``b = FSDP(Linear(4, 4))``, ``a = FSDP(Sequential(b, Tanh(), Linear(4, 4)))`` trained one
    SGD step, then ``c = FSDP(Sequential(b, Tanh(), Linear(4, 3)))``: one SGD step of ``c``
    gives the unsharded ``Sequential(inner, Tanh(), Linear(4, 3))`` 's loss (``inner`` the
    unsharded copy trained in ``a`` 's step) and afterwards its parameters."""
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    kw = {"device_id": torch.device("cpu")} if ctx.device.type == "cpu" else {}
    ctx.seed(0)
    inner, head_a, head_c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
    o_inner, o_head_a, o_head_c = (copy.deepcopy(m).to(ctx.device) for m in (inner, head_a, head_c))
    b = FSDP(inner.to(ctx.device), **kw)
    a = FSDP(nn.Sequential(b, nn.Tanh(), head_a.to(ctx.device)), **kw)
    oa = nn.Sequential(o_inner, nn.Tanh(), o_head_a)
    opts = (torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(oa.parameters(), lr=0.1))
    _rewrap_step(ctx, a, oa, opts, 1120, "training step of a")
    c = FSDP(nn.Sequential(b, nn.Tanh(), head_c.to(ctx.device)), **kw)
    oc = nn.Sequential(o_inner, nn.Tanh(), o_head_c)
    opts = (torch.optim.SGD(c.parameters(), lr=0.1), torch.optim.SGD(oc.parameters(), lr=0.1))
    _rewrap_step(ctx, c, oc, opts, 1121, "training step of c (b under a new root)")
    with FSDP.summon_full_params(c):
        got = {ctx.impl.clean_fqn(n): p for n, p in c.named_parameters()}
        for name, ref in oc.named_parameters():
            assert name in got, f"{ctx.where()} after c's step: {name} not visible ({sorted(got)})"
            assert_close(ctx, f"after c's step: {name}", got[name], ref, FP32["param"])
