"""Area "fsdp1_runtime": what FSDP1's constructor says about its arguments (R30-R32) and which
arguments it refuses (R56, R67, R83, R95); a unit that ran as a root refused under a new root
(R116).

[Note: refusals are contracts]
Each refusal is pinned by its exception type and a stable part of its message (upstream's
wording), and where it is cheap the check also shows that the refused call changed nothing: the
module keeps its parameters, a later valid call still succeeds, the settings stay as they were.
The other FSDP1 refusals of this kind are in ``backward.py`` (R98), ``comm_hooks.py`` (R96),
``root_init.py`` (R97), ``grad_scaler_edges.py`` (R101) and, for the state-dict and
optimizer-state ones (R99, R100, R102, R103), ``conformance/checks/state_dict/optim_refusals.py``.

[Note: the constructor's refusals]
* The constructor refuses a scalar parameter and an FSDP unit among ``ignored_modules``, and warns
  when the module itself is ignored (R56). The scalar is refused as such wherever it sits, also
  after a frozen parameter (whose mixed ``requires_grad`` would otherwise be refused first).
* ``ignored_modules`` that FSDP1 cannot hold as a set of modules (an int, a list with an unhashable
  module) is refused with TypeError (R67).
* ``device_id`` names the compute device; when the module's parameters are not there after
  construction moved and materialised them (a meta module whose ``param_init_fn`` does nothing),
  or when the CPU is named with an index (``cpu:0``, which is not the CPU compute device ``cpu``),
  construction is refused with ValueError naming both devices (R83).

[Note: a former root under a new root]
A unit that has run a forward as the root of its own tree (wrapped alone, called alone) cannot
become a non-root: wrapped under a new root, the new root's first forward raises AssertionError
"Non-root FSDP instance's `_is_root` should not have been set yet or should have been set to
`False`" (R116). One that trained as a non-root may be wrapped again (R111, ``root_init.py``).
"""

from __future__ import annotations

import copy
import re
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import _kwargs
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet, full_params
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def world_size_one_warning(ctx):
    """R30: at world size 1 a unit built without ``sharding_strategy`` warns that it switches to
    NO_SHARD instead of ``FULL_SHARD`` (the default it was given), naming FULL_SHARD."""
    ns = ctx.impl.ns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns.FullyShardedDataParallel(InnerHeadNet().to(ctx.device), **_kwargs(ctx))
    texts = [str(w.message) for w in caught if "NO_SHARD" in str(w.message)]
    assert texts and all("FULL_SHARD" in t for t in texts), (
        f"{ctx.where()} the world-size-1 warnings {texts} should name FULL_SHARD, the strategy "
        "replaced by NO_SHARD"
    )


@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={"empty": {"ignore": False}, "one_module": {"ignore": True}},
    world_sizes=(1, 2),
)
def ignored_states_list(ctx, ignore):
    """R31: ``ignored_states=[]`` acts as no ignored state (every parameter is flattened and
    sharded); ``ignored_states=[inner]`` leaves ``inner``'s parameters unmanaged: the very
    Parameter objects with their full shape and values, outside every flat parameter; in both
    cases the forward equals the unwrapped model's."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    model = copy.deepcopy(oracle)
    inner_params = list(model.inner.parameters())
    states = [model.inner] if ignore else []
    fsdp = ns.FullyShardedDataParallel(model, ignored_states=states, **_kwargs(ctx))
    fqns = {f for fs, _ in ctx.impl.flat_shards(fsdp) for f in fs}
    want = {"head.weight", "head.bias"} | (set() if ignore else {"inner.weight", "inner.bias"})
    assert fqns == want, f"{ctx.where()} flattened {sorted(fqns)}, expected {sorted(want)}"
    if ignore:
        for p, ref in zip(inner_params, oracle.inner.parameters()):
            assert any(q is p for q in fsdp.parameters()), f"{ctx.where()} inner's param lost"
            assert_close(ctx, "ignored inner parameter", p, ref, FP32["param"])
    got = full_params(ctx, fsdp)
    for name in want:
        assert_close(ctx, name, got[name], oracle.get_parameter(name), FP32["param"])
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(5)).to(ctx.device)
    assert_close(ctx, "forward", fsdp(x), oracle(x), FP32["loss"])


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.FSDP1_HYBRID_SHARD},
    cases={"pg_not_groups": {"bad": "pg"}, "mesh_1d": {"bad": "mesh"}},
    world_sizes=(2,),
)
def hybrid_shard_bad_groups(ctx, bad):
    """R32: ``sharding_strategy=HYBRID_SHARD`` refuses with ValueError a ``process_group``
    that is not a pair of ProcessGroups (a tuple of two ints) and a ``device_mesh`` that is not
    2-D (a 1-D mesh over every rank), before any unit is built."""
    ns = ctx.impl.ns
    kwargs = {"sharding_strategy": ns.ShardingStrategy.HYBRID_SHARD, **_kwargs(ctx)}
    if bad == "pg":
        kwargs["process_group"] = (1, 2)
    else:
        kwargs["device_mesh"] = ctx.make_mesh((ctx.world_size,), ("shard",))
    model = InnerHeadNet().to(ctx.device)
    try:
        ns.FullyShardedDataParallel(model, **kwargs)
    except ValueError:
        pass
    except Exception as e:  # noqa: BLE001 - the wrong exception is the finding
        raise AssertionError(
            f"{ctx.where()} HYBRID_SHARD with a bad {bad}: {type(e).__name__}: {e}, "
            "expected ValueError"
        ) from e
    else:
        raise AssertionError(f"{ctx.where()} HYBRID_SHARD with a bad {bad} was accepted")


# ------------------------------------------------------------------------------ R67
class _Unhashable(nn.Linear):
    """A Linear that defines ``__eq__`` alone, so Python makes its instances unhashable."""

    def __eq__(self, other):
        return self is other


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def ignored_modules_not_a_module_set(ctx):
    """R67: ``ignored_modules`` that FSDP1 cannot hold as a set of modules is refused at
    construction with TypeError: an int (not iterable) with a message naming ``int``, a list
    holding an unhashable module (its class defines ``__eq__`` alone) with a message naming
    ``ignored_modules``."""
    ns = ctx.impl.ns
    for what, bad, pattern in (
        ("ignored_modules=3", 3, r"\bint\b"),
        ("ignored_modules=[an unhashable Linear]", [_Unhashable(4, 4)], r"ignored_modules"),
    ):
        expect_error(
            ctx,
            what,
            TypeError,
            pattern,
            lambda bad=bad: ns.FullyShardedDataParallel(
                nn.Linear(4, 4).to(ctx.device), ignored_modules=bad, **_kwargs(ctx)
            ),
        )


def _compute_device(ctx) -> torch.device:
    """The compute device with its index where it has one (``cuda:0``; the CPU is ``cpu``)."""
    if ctx.device.type == "cpu":
        return torch.device("cpu")
    if ctx.device.index is not None:
        return ctx.device
    return torch.device(ctx.device.type, torch.get_device_module(ctx.device.type).current_device())


# ------------------------------------------------------------------------------ R83
DEVICE_CASES = {"meta-left": {"meta": True}, "cpu-with-index": {"meta": False}}


@check(area="fsdp1_runtime", requires=REQUIRES, cases=DEVICE_CASES, world_sizes=(1,))
def device_id_inconsistent(ctx, meta):
    """R83: construction is refused with ValueError whose message says the compute device and
    ``device_id`` are inconsistent and names both: ``meta-left``, a ``Linear(3, 3)`` built on the
    meta device with ``param_init_fn=lambda m: None`` (so its parameters stay on meta) and
    ``device_id`` the compute device; ``cpu-with-index`` (CPU only), a ``Linear(3, 3)`` on the CPU
    with ``device_id=torch.device("cpu", 0)`` (the CPU compute device is ``cpu``, no index)."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    if meta:
        device_id, held = _compute_device(ctx), torch.device("meta")
        with torch.device("meta"):
            module = nn.Linear(3, 3)
        options = {"param_init_fn": lambda m: None}
    else:
        if ctx.device.type != "cpu":
            return  # the case is about the CPU named with an index
        device_id, held = torch.device("cpu", 0), torch.device("cpu")
        module, options = nn.Linear(3, 3), {}
    pattern = rf"(?is)inconsistent.*{re.escape(str(held))}\b.*{re.escape(str(device_id))}\b"
    expect_error(
        ctx,
        f"parameters on {held} with device_id={device_id}",
        ValueError,
        pattern,
        lambda: fsdp(module, device_id=device_id, **options),
    )


# ------------------------------------------------------------------------------ R95
def _int_param(ctx):
    m = nn.Module()
    m.p = nn.Parameter(torch.ones(4, dtype=torch.int64, device=ctx.device), requires_grad=False)
    return m, {}


def _mixed_requires_grad(ctx):
    m = nn.Linear(4, 4).to(ctx.device)
    m.weight.requires_grad_(False)
    return m, {"use_orig_params": False}


def _both_ignored(ctx):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(ctx.device)
    return m, {"ignored_modules": [m[0]], "ignored_states": [m[1]]}


def _init_fn_not_callable(ctx):
    return nn.Linear(4, 4, device="meta"), {"param_init_fn": 5}


def _group_and_mesh(ctx):
    mesh = ctx.make_mesh((ctx.world_size,), ("shard",))
    return nn.Linear(4, 4).to(ctx.device), {"process_group": mesh.get_group(), "device_mesh": mesh}


CONSTRUCTOR_CASES = {
    "integer_param": {
        "build": _int_param,
        "exc": ValueError,
        "pattern": r"Cannot flatten integer dtype tensors",
    },
    "mixed_requires_grad": {
        "build": _mixed_requires_grad,
        "exc": ValueError,
        "pattern": r"uniform `requires_grad` when `use_orig_params=False`",
    },
    "ignored_modules_and_states": {
        "build": _both_ignored,
        "exc": ValueError,
        "pattern": r"Cannot pass both ignored_modules and ignored_states",
    },
    "param_init_fn_not_callable": {
        "build": _init_fn_not_callable,
        "exc": ValueError,
        "pattern": r"to be callable but got <class 'int'>",
    },
    "process_group_and_mesh": {
        "build": _group_and_mesh,
        "exc": ValueError,
        "pattern": r"Cannot pass both process_group and device_mesh",
    },
}


@check(area="fsdp1_runtime", requires=REQUIRES, cases=CONSTRUCTOR_CASES, world_sizes=(1,))
def constructor_argument_refusals(ctx, build, exc, pattern):
    """R95: ``FullyShardedDataParallel(module, ...)`` refuses, with ValueError and upstream's
    words, a module holding an integer parameter ("Cannot flatten integer dtype tensors"), a
    Linear whose weight alone is frozen under ``use_orig_params=False`` ("uniform
    `requires_grad` when `use_orig_params=False`"), both ``ignored_modules`` and
    ``ignored_states`` ("Cannot pass both ignored_modules and ignored_states"), a
    ``param_init_fn`` that is not callable ("... to be callable but got <class 'int'>") and both
    ``process_group`` and ``device_mesh`` ("Cannot pass both process_group and device_mesh").
    The refused module keeps its parameters: the same names, objects and values, and no child
    ``_fsdp_wrapped_module``."""
    module, kwargs = build(ctx)
    before = {n: (p, p.detach().clone()) for n, p in module.named_parameters()}
    expect_error(
        ctx,
        f"FSDP(module, {sorted(kwargs)})",
        exc,
        pattern,
        lambda: ctx.impl.ns.FullyShardedDataParallel(module, **kwargs, **_kwargs(ctx)),
    )
    after = dict(module.named_parameters())
    assert list(after) == list(before), (
        f"{ctx.where()} after the refused construction the parameter names are {list(after)}, "
        f"were {list(before)}"
    )
    assert "_fsdp_wrapped_module" not in dict(module.named_children()), (
        f"{ctx.where()} the refused construction left a wrapped child in the module"
    )
    for name, (param, value) in before.items():
        assert after[name] is param, f"{ctx.where()} {name} was replaced by the refused call"
        if not value.is_meta:
            assert torch.equal(after[name].detach(), value), (
                f"{ctx.where()} {name} changed value in the refused construction"
            )


@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_HYBRID_SHARD}, world_sizes=(1,))
def hybrid_shard_without_group_refused(ctx):
    """R95: ``sharding_strategy=HYBRID_SHARD`` with neither ``process_group`` nor
    ``device_mesh`` nor an ``auto_wrap_policy`` is refused with ValueError "... requires explicit
    specification of process group or device_mesh"."""
    ns = ctx.impl.ns
    expect_error(
        ctx,
        "HYBRID_SHARD without a process group or mesh",
        ValueError,
        r"requires explicit specification of process group or device_mesh",
        lambda: ns.FullyShardedDataParallel(
            nn.Linear(4, 4).to(ctx.device),
            sharding_strategy=ns.ShardingStrategy.HYBRID_SHARD,
            **_kwargs(ctx),
        ),
    )


class _ScalarGain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.gain = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.gain


class _FrozenThenGain(nn.Module):
    """A frozen 1-D ``w`` registered before a trainable scalar ``gain``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3), requires_grad=False)
        self.gain = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return x * self.w * self.gain


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_API}, world_sizes=(1,))
def constructor_refusals(ctx):
    """R56: a module holding a 0-dim parameter ``gain`` is refused with ValueError naming
    ``gain`` as scalar, also when a frozen 1-D parameter ``w`` is registered before it
    (``use_orig_params=False``, where mixed ``requires_grad`` is refused too: the scalar is
    named); an FSDP unit among ``ignored_modules`` is refused with ValueError "should not include
    FSDP modules"; ignoring the wrapped module itself warns (UserWarning "top-level module"),
    the forward then equal to the unwrapped module's."""
    fsdp = ctx.impl.FSDP
    dev = {"device_id": ctx.device}
    expect_error(
        ctx,
        "a scalar parameter",
        ValueError,
        r"(?i)scalar.*gain|gain.*scalar",
        lambda: fsdp(_ScalarGain().to(ctx.device), **dev),
    )
    expect_error(
        ctx,
        "a scalar parameter after a frozen one (use_orig_params=False)",
        ValueError,
        r"(?i)scalar.*gain",
        lambda: fsdp(_FrozenThenGain().to(ctx.device), use_orig_params=False, **dev),
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


# ------------------------------------------------------------------------------ R116
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def former_root_under_new_root_refused(ctx):
    """R116: ``inner = FSDP(Linear(4, 4))`` that ran a forward alone (as the root of its own
    tree), then wrapped as ``FSDP(Sequential(inner, Linear(4, 4)))``: the new root's first
    forward raises AssertionError "Non-root FSDP instance's `_is_root` should not have been set
    yet or should have been set to `False`"."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    inner = fsdp(nn.Linear(4, 4).to(ctx.device), **_kwargs(ctx))
    x = torch.randn(B, 4, generator=torch.Generator().manual_seed(116)).to(ctx.device)
    inner(x)
    outer = fsdp(nn.Sequential(inner, nn.Linear(4, 4).to(ctx.device)), **_kwargs(ctx))
    expect_error(
        ctx,
        "the first forward of a new root over a unit that ran as a root",
        AssertionError,
        r"Non-root FSDP instance's `_is_root` should not have been set yet or should have been "
        r"set to `False`",
        lambda: outer(x),
    )
