"""Area "wrap": which submodules an auto-wrap policy turns into FSDP units, with which kwargs.

[Note: the rules the expected plans come from] (spec §4, W1-W16; torch 2.13's FSDP1)
  units        the root always; plus every descendant the policy selects. The root is never
               selected by the policy itself (the caller shards it), so it appears once.
  build order  children before parents, siblings in registration order, root last.
  size rule    ``size_based_auto_wrap_policy(min_num_params=n)``: a module is looked into iff its
               not-yet-wrapped numel is >= n and it is not a force-leaf (MultiheadAttention); it
               is wrapped iff the numel left after wrapping its children is >= n and it is not an
               excluded container (ModuleList / ModuleDict). Ignored parameters are not counted.
  managed      a unit manages the parameters of its subtree that no deeper unit manages and that
               are not ignored (ignored modules: their whole subtree).
  kwargs       the root gets the root kwargs; a descendant gets a copy of them, for a ``_Policy``
               with ``auto_wrap_policy=None`` and the policy's overrides (``CustomPolicy`` dict).
  W11          mixed precision + any auto_wrap_policy: every batch norm is its own unit with mixed
               precision disabled, and a UserWarning says so. No policy: no override.
  W12          a ``_Policy`` target whose managed parameters mix requires_grad True/False:
               ``ValueError`` (use_orig_params=False) or a ``UserWarning`` (True).
  ws 1         FSDP1 clamps every unit's sharding strategy to NO_SHARD on a world of one.

The expected units of each zoo case below are written out by hand from these rules (the comment
next to each says how); only the parameter FQNs per unit are computed, by the "managed" rule,
from the unwrapped model. Three checks apply them:
  * ``plan_matches_expected`` — the implementation's side-effect-free plan builder
    (``reference.wrap.build_wrap_plan``), world size 1;
  * ``fsdp1_auto_wrap_units`` — ``ns.FullyShardedDataParallel(model, auto_wrap_policy=...)``:
    the FSDP module names, their managed parameters and kwargs (mixed precision, sharding strategy,
    backward prefetch) read off the wrapped modules;
  * ``fsdp2_plan_units_and_parity`` — ``ctx.impl.shard(model, plan=...)`` with the expected units
    (children first): the ``FSDPModule`` set, each unit's parameters, and 3 SGD steps equal to the
    unwrapped model trained on the global batch.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.adapters.base import NotSupported
from conformance.checks.wrap import _models as zoo
from conformance.registry import check

FP16 = torch.float16


def _never(module, recurse, nonwrapped_numel):
    """A callable policy that never wraps (W11: the batch-norm override still applies)."""
    return False


def _size(n):
    return lambda W: functools.partial(W.size_based_auto_wrap_policy, min_num_params=n)


def _always(W):
    return W.always_wrap_policy


def _modules(*names):
    """ModuleWrapPolicy over classes named in nn or in the zoo."""

    def build(W):
        return W.ModuleWrapPolicy({getattr(nn, n, None) or getattr(zoo, n) for n in names})

    return build


def _transformer_custom(W):
    """W10 non-uniform: per-class kwargs; anything else is not a unit."""

    def answer(module):
        if isinstance(module, nn.TransformerEncoderLayer):
            return {"sharding_strategy": "FULL_SHARD", "backward_prefetch": "BACKWARD_PRE"}
        if isinstance(module, nn.TransformerDecoderLayer):
            return {"sharding_strategy": "SHARD_GRAD_OP", "backward_prefetch": "BACKWARD_POST"}
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return {"sharding_strategy": "NO_SHARD"}
        return False

    return answer  # resolved against the implementation's enums in _policy()


@dataclass(frozen=True)
class WrapCase:
    model: str
    policy: object  # W -> policy (None: no auto_wrap_policy); see _policy()
    units: tuple[str, ...]  # expected units in build order, root ("") last
    is_policy_class: bool = False  # a `_Policy` (targets get auto_wrap_policy=None)
    mixed_precision: bool = False  # root MixedPrecision(param_dtype=fp16)
    mp_off: tuple[str, ...] = ()  # units built with mixed_precision=None (W11)
    overrides: dict = field(default_factory=dict)  # unit -> {kwarg: enum member name}
    ignored_modules: tuple[str, ...] = ()
    ignored_params: tuple[str, ...] = ()
    custom: object = None  # CustomPolicy answer function (names of enum members)


NESTED_ALL = ("0", "1", "2.0", "2.1")

ZOO = {
    # W1/W2 size boundary. Each Linear has 30 elements, module 2 has 60.
    # min 30: every Linear is at the threshold -> wrapped; 2 then has 0 left -> not wrapped.
    "nested-size-linear-at": WrapCase("nested", _size(30), (*NESTED_ALL, "")),
    # min 31: a Linear (30) is just below; 2 (60) is above -> 2 wrapped with both Linears.
    "nested-size-linear-below": WrapCase("nested", _size(31), ("2", "")),
    # min 60: 2 is exactly at the threshold -> wrapped.
    "nested-size-seq-at": WrapCase("nested", _size(60), ("2", "")),
    # min 61: 2 (60) is just below -> not looked into, not wrapped: the root alone.
    "nested-size-seq-below": WrapCase("nested", _size(61), ("",)),
    # W2 always_wrap: every descendant, 2 after its children (and managing nothing).
    "nested-always": WrapCase("nested", _always, (*NESTED_ALL, "2", "")),
    # ModuleWrapPolicy({Sequential}) selects the root too; it still appears once, last.
    "nested-module-root-match": WrapCase(
        "nested", _modules("Sequential"), ("2", ""), is_policy_class=True
    ),
    # W5: ignored modules 1 and 2.0 are neither units nor counted.
    "nested-always-ignored": WrapCase(
        "nested", _always, ("0", "2.1", "2", ""), ignored_modules=("1", "2.0")
    ),
    # W5 size 40: 2 counts 30 without the ignored 2.0 -> below 40; 0 (30) too: the root alone.
    "nested-size40-ignored": WrapCase("nested", _size(40), ("",), ignored_modules=("1", "2.0")),
    # W5 ignored parameter: 0 is a unit that manages 0.weight only.
    "nested-module-ignored-param": WrapCase(
        "nested",
        _modules("Linear"),
        (*NESTED_ALL, ""),
        is_policy_class=True,
        ignored_params=("0.bias",),
    ),
    # W3 min 40: mlist (60) and mdict (170; 60 left after big) are looked into but never wrapped
    # (excluded containers); big (110) and head (55) are wrapped; each 30-element Linear is not.
    "containers-size40": WrapCase("containers", _size(40), ("mdict.big", "head", "")),
    # W4 custom force leaves {MultiheadAttention, Linear}, min 40: a force leaf is not looked into
    # and so never wrapped, however large (big 110, head 55): the root alone.
    "containers-size40-linear-leaf": WrapCase(
        "containers",
        lambda W: functools.partial(
            W.size_based_auto_wrap_policy,
            min_num_params=40,
            force_leaf_modules={nn.MultiheadAttention, nn.Linear},
        ),
        ("",),
    ),
    # W4 min 40: lin (110) wrapped; attn (440) is a force leaf: not looked into, so its out_proj
    # (110) is not wrapped either, and attn itself is not wrapped.
    "attention-size40": WrapCase("attention", _size(40), ("lin", "")),
    # W9 ModuleWrapPolicy on the layer classes: 4 layers + root; the tied embedding/head weight
    # stays with the root, once.
    "transformer-layers": WrapCase(
        "transformer",
        _modules("TransformerEncoderLayer", "TransformerDecoderLayer"),
        ("encoder.0", "encoder.1", "decoder.0", "decoder.1", ""),
        is_policy_class=True,
    ),
    # W9 the same layers through the callable transformer_auto_wrap_policy (no auto_wrap_policy
    # key in the children's kwargs on this path).
    "transformer-layers-callable": WrapCase(
        "transformer",
        lambda W: functools.partial(
            W.transformer_auto_wrap_policy,
            transformer_layer_cls={nn.TransformerEncoderLayer, nn.TransformerDecoderLayer},
        ),
        ("encoder.0", "encoder.1", "decoder.0", "decoder.1", ""),
    ),
    # W9 lambda_auto_wrap_policy wraps exactly the modules its function accepts (the Linears).
    "norm-lambda": WrapCase(
        "norm",
        lambda W: functools.partial(
            W.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)
        ),
        ("lin1", "lin2", ""),
    ),
    # W10 non-uniform CustomPolicy + root fp16: bn NO_SHARD with MP off (W11), encoder layers
    # FULL_SHARD/BACKWARD_PRE, decoder layers SHARD_GRAD_OP/BACKWARD_POST.
    "transformer-custom-mp": WrapCase(
        "transformer",
        None,
        ("encoder.0", "encoder.1", "decoder.0", "decoder.1", "bn", ""),
        is_policy_class=True,
        mixed_precision=True,
        mp_off=("bn",),
        custom=_transformer_custom,
        overrides={
            **{
                f"encoder.{i}": {
                    "sharding_strategy": "FULL_SHARD",
                    "backward_prefetch": "BACKWARD_PRE",
                }
                for i in range(2)
            },
            **{
                f"decoder.{i}": {
                    "sharding_strategy": "SHARD_GRAD_OP",
                    "backward_prefetch": "BACKWARD_POST",
                }
                for i in range(2)
            },
            "bn": {"sharding_strategy": "NO_SHARD"},
        },
    ),
    # W11 with a callable policy that never wraps: bn alone, MP off.
    "norm-mp-never": WrapCase(
        "norm", lambda W: _never, ("bn", ""), mixed_precision=True, mp_off=("bn",)
    ),
    # W11 with a _Policy: the Linears (fp16) and bn (MP off) in post-order; the root manages nothing.
    "norm-mp-module": WrapCase(
        "norm",
        _modules("Linear"),
        ("lin1", "bn", "lin2", ""),
        is_policy_class=True,
        mixed_precision=True,
        mp_off=("bn",),
    ),
    # W11 without an auto_wrap_policy: no override, bn stays in the root.
    "norm-mp-no-policy": WrapCase("norm", None, ("",), mixed_precision=True),
    # W11 needs mixed precision: without it the bn stays in the root.
    "norm-module-no-mp": WrapCase(
        "norm", _modules("Linear"), ("lin1", "lin2", ""), is_policy_class=True
    ),
    # W12 uniform: each adapter (trainable) and each attention (frozen rest) is its own unit.
    "lora-uniform": WrapCase(
        "lora",
        _modules("LoraAttention", "LoraAdapter"),
        ("layers.0.attn.lora", "layers.0.attn", "layers.1.attn.lora", "layers.1.attn", ""),
        is_policy_class=True,
    ),
    # W12: ignoring the trainable adapters makes each attention uniformly frozen.
    "lora-ignored": WrapCase(
        "lora",
        _modules("LoraAttention"),
        ("layers.0.attn", "layers.1.attn", ""),
        is_policy_class=True,
        ignored_modules=("layers.0.attn.lora", "layers.1.attn.lora"),
    ),
}
ZOO_CASES = {name: {"case": name} for name in ZOO}


# ------------------------------------------------------------------------------------- helpers
def _policy(case: WrapCase, ns, enums=True):
    """The case's policy built from the implementation's ``wrap`` module (enums from ``ns``, or
    enum names as opaque values when ``enums`` is false)."""
    if case.custom is not None:
        answer = case.custom(ns.wrap)

        def resolved(module):
            out = answer(module)
            if isinstance(out, dict):
                return {k: _enum(ns if enums else None, k, v) for k, v in out.items()}
            return out

        return ns.wrap.CustomPolicy(resolved)
    return case.policy(ns.wrap) if case.policy is not None else None


def _enum(ns, key: str, member: str):
    """The enum member ``member`` of the kwarg ``key`` from ``ns``; with ``ns=None`` the name
    itself (a plan builder treats kwargs as opaque values)."""
    if ns is None:
        return member
    cls = {"sharding_strategy": "ShardingStrategy", "backward_prefetch": "BackwardPrefetch"}[key]
    return getattr(getattr(ns, cls), member)


def _ignored(model: nn.Module, case: WrapCase):
    """(ignored modules, ignored parameters given explicitly, every ignored parameter)."""
    modules = [model.get_submodule(n) for n in case.ignored_modules]
    params = [model.get_parameter(n) for n in case.ignored_params]
    everything = {p for m in modules for p in m.parameters()} | set(params)
    return modules, params, everything


def expected_groups(model: nn.Module, units, ignored: set) -> tuple[dict[str, set], set]:
    """The "managed" rule: every non-ignored parameter (first name in ``named_parameters``)
    belongs to the deepest unit whose subtree holds it. (No zoo parameter is shared between two
    units' subtrees, so "deepest" is unambiguous.) Returns ({unit: FQNs}, ignored FQNs)."""
    groups = {u: set() for u in units}
    ignored_fqns = set()
    for name, param in model.named_parameters():
        if param in ignored:
            ignored_fqns.add(name)
            continue
        owners = [u for u in units if u == "" or name.startswith(u + ".")]
        groups[max(owners, key=lambda u: (u != "", u.count(".")))].add(name)
    return groups, ignored_fqns


def expected_kwargs(case: WrapCase, unit: str, root_kwargs: dict, ns) -> dict:
    """The kwargs rule (see the module docstring)."""
    if unit == "":
        return dict(root_kwargs)
    kwargs = dict(root_kwargs)
    if case.is_policy_class:
        kwargs["auto_wrap_policy"] = None
    kwargs.update({k: _enum(ns, k, v) for k, v in case.overrides.get(unit, {}).items()})
    if unit in case.mp_off:
        kwargs["mixed_precision"] = None
    return kwargs


def _seeded_model(ctx, name: str) -> nn.Module:
    ctx.seed(1234)
    return zoo.make_model(name)


def _plan_builder(ctx):
    """The implementation's side-effect-free plan builder, ``ns.wrap.build_wrap_plan`` (the
    reference's; upstream torch has none)."""
    fn = getattr(ctx.impl.ns.wrap, "build_wrap_plan", None)
    if fn is None:
        raise NotSupported("a wrap plan builder (ns.wrap.build_wrap_plan)")
    return fn


def _mp(ns, enabled: bool):
    return ns.MixedPrecision(param_dtype=FP16) if enabled else None


# --------------------------------------------------------------------------- plan (world size 1)
@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP2_API},
    cases=ZOO_CASES,
    world_sizes=(1,),
    timeout=180,
)
def plan_matches_expected(ctx, case):
    """build_wrap_plan lists exactly the expected units in build order, each with the kwargs and
    managed parameters the rules give, and leaves the model untouched (W1-W5, W9)."""
    build = _plan_builder(ctx)
    c, ns = ZOO[case], ctx.impl.ns
    model = _seeded_model(ctx, c.model)
    ignored_modules, ignored_params, ignored = _ignored(model, c)
    root_kwargs = {"mixed_precision": _mp(ns, c.mixed_precision), "use_orig_params": False}
    before = [
        (n, id(m), len(m._forward_pre_hooks), len(m._forward_hooks), sorted(vars(m)))
        for n, m in model.named_modules()
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = build(
            model,
            _policy(c, ns, enums=False),
            ignored_modules=ignored_modules,
            ignored_params=ignored_params,
            root_kwargs=root_kwargs,
        )
    where = f"{ctx.where()} {case}:"
    got = tuple(e.module_fqn for e in plan.entries)
    assert got == c.units, f"{where} planned units {got}, expected {c.units} (build order)"
    groups, ignored_fqns = expected_groups(model, c.units, ignored)
    for entry in plan.entries:
        unit = entry.module_fqn
        want = expected_kwargs(c, unit, root_kwargs, None)
        assert dict(entry.kwargs) == want, (
            f"{where} unit {unit!r} kwargs {dict(entry.kwargs)}, expected {want}"
        )
        assert set(entry.param_fqns) == groups[unit] and len(entry.param_fqns) == len(
            groups[unit]
        ), (
            f"{where} unit {unit!r} manages {sorted(entry.param_fqns)}, "
            f"expected {sorted(groups[unit])}"
        )
    assert set(plan.ignored_param_fqns) == ignored_fqns, (
        f"{where} ignored parameters {sorted(plan.ignored_param_fqns)}, expected {sorted(ignored_fqns)}"
    )
    after = [
        (n, id(m), len(m._forward_pre_hooks), len(m._forward_hooks), sorted(vars(m)))
        for n, m in model.named_modules()
    ]
    assert after == before, f"{where} building the plan changed the model"


def _lora_message(unit: str, use_orig_params: bool) -> str:
    """W12's message for one LoraAttention (q/v frozen 16+16, adapter A/B trainable 8+8)."""
    msg = f"{unit} has both parameters with requires_grad=True and False. "
    if use_orig_params:
        msg += (
            "We do not recommend wrapping such modules since the gradient memory usage will be "
            "higher than expected (48 numel instead of 16 numel before sharding via "
            "reduce-scatter). "
        )
    else:
        msg += "FSDP does not support wrapping such modules when use_orig_params=False. "
    return msg + (
        "If possible, wrap the frozen parameters with FSDP separately.\n"
        "The following parameters have requires_grad=True:\n"
        f"{[f'{unit}.lora.A.weight', f'{unit}.lora.B.weight']}\n"
        "The following parameters have requires_grad=False:\n"
        f"{[f'{unit}.q_proj.weight', f'{unit}.v_proj.weight']}"
    )


_MP_WARNING = (
    "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped module "
    "has submodules of type:\n{classes}\nThese modules will be wrapped as separate FSDP instacnes "
    "with mixed precision disabled."
)


def _user_warnings(record, needle: str) -> list[str]:
    return [
        str(w.message)
        for w in record
        if issubclass(w.category, UserWarning) and needle in str(w.message)
    ]


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP2_API}, world_sizes=(1,))
def plan_errors_and_warnings(ctx):
    """build_wrap_plan raises/warns as FSDP1's constructor would: W10 bad CustomPolicy answer
    (ValueError), W12 mixed frozen parameters (ValueError / UserWarning by use_orig_params), W11
    the batch-norm mixed-precision warning."""
    build, ns = _plan_builder(ctx), ctx.impl.ns
    W = ns.wrap
    model = zoo.nested_sequential()
    try:
        build(model, W.CustomPolicy(lambda m: 1))
    except ValueError as e:
        want = (
            "The lambda_fn passed to CustomPolicy should return False/True or a kwarg dict, "
            "but it returned 1"
        )
        assert str(e) == want, f"{ctx.where()} W10 message {str(e)!r}, expected {want!r}"
    else:
        raise AssertionError(f"{ctx.where()} W10: a CustomPolicy answer of 1 did not raise")

    policy = W.ModuleWrapPolicy({zoo.LoraAttention})
    try:
        build(zoo.LoraModel(), policy, root_kwargs={"use_orig_params": False})
    except ValueError as e:
        want = _lora_message("layers.0.attn", False)
        assert str(e) == want, f"{ctx.where()} W12 message {str(e)!r}, expected {want!r}"
    else:
        raise AssertionError(
            f"{ctx.where()} W12: mixed frozen parameters did not raise with use_orig_params=False"
        )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan = build(zoo.LoraModel(), policy, root_kwargs={"use_orig_params": True})
    got = _user_warnings(record, "requires_grad=True and False")
    want = [_lora_message(f"layers.{i}.attn", True) for i in range(2)]
    assert got == want, f"{ctx.where()} W12 warnings {got}, expected {want}"
    units = tuple(e.module_fqn for e in plan.entries)
    assert units == ("layers.0.attn", "layers.1.attn", ""), f"{ctx.where()} W12 units {units}"

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        build(zoo.NormNet(), _never, root_kwargs={"mixed_precision": _mp(ns, True)})
    got = _user_warnings(record, "Both mixed precision")
    want = [_MP_WARNING.format(classes={nn.BatchNorm1d})]
    assert got == want, f"{ctx.where()} W11 warnings {got}, expected {want}"


# -------------------------------------------------------------------------------- FSDP1 API
def _device_id(ctx):
    return torch.device("cpu") if ctx.device.type == "cpu" else ctx.device


def _fsdp1_units(ctx, wrapped: nn.Module) -> dict[str, nn.Module]:
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    return {ctx.impl.clean_fqn(n): m for n, m in wrapped.named_modules() if isinstance(m, FSDP)}


def _fsdp1_managed(unit_fqn: str, unit: nn.Module) -> list[str]:
    handle = getattr(unit, "_handle", None)
    if handle is None:
        return []
    prefix = f"{unit_fqn}." if unit_fqn else ""
    return [prefix + f for f in handle.flat_param._fqns]


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, cases=ZOO_CASES, timeout=180)
def fsdp1_auto_wrap_units(ctx, case):
    """FullyShardedDataParallel(model, auto_wrap_policy=...) builds exactly the expected FSDP
    modules; each flattens exactly its managed parameters and carries the expected mixed
    precision, sharding strategy (NO_SHARD at world size 1), backward prefetch and the root's
    forward_prefetch (W1-W5, W9)."""
    c, ns = ZOO[case], ctx.impl.ns
    model = _seeded_model(ctx, c.model)
    ignored_modules, ignored_params, ignored = _ignored(model, c)
    groups, _ = expected_groups(model, c.units, ignored)
    # forward_prefetch=True (default False): every unit must inherit it from the root kwargs
    kwargs = {
        "device_id": _device_id(ctx),
        "mixed_precision": _mp(ns, c.mixed_precision),
        "forward_prefetch": True,
    }
    if ignored_modules:
        kwargs["ignored_modules"] = ignored_modules
    if ignored_params:
        kwargs["ignored_states"] = ignored_params
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = ns.FullyShardedDataParallel(model, auto_wrap_policy=_policy(c, ns), **kwargs)
    units = _fsdp1_units(ctx, wrapped)
    where = f"{ctx.where()} {case}:"
    assert set(units) == set(c.units), (
        f"{where} FSDP modules {sorted(units)}, expected {sorted(c.units)}"
    )
    root_mp = _mp(ns, c.mixed_precision) or ns.MixedPrecision()
    for fqn, unit in units.items():
        managed = _fsdp1_managed(fqn, unit)
        assert sorted(managed) == sorted(groups[fqn]), (
            f"{where} FSDP module {fqn!r} flattens {sorted(managed)}, expected {sorted(groups[fqn])}"
        )
        want_mp = ns.MixedPrecision() if fqn in c.mp_off else root_mp
        got_mp = unit.mixed_precision or ns.MixedPrecision()  # None: mixed precision disabled
        assert got_mp == want_mp, (
            f"{where} FSDP module {fqn!r} mixed_precision {got_mp}, expected {want_mp}"
        )
        assert unit.forward_prefetch is True, (
            f"{where} FSDP module {fqn!r} forward_prefetch {unit.forward_prefetch}, expected the "
            "root's True"
        )
        overrides = c.overrides.get(fqn, {})
        strategy = ns.ShardingStrategy[overrides.get("sharding_strategy", "FULL_SHARD")]
        if ctx.world_size == 1:
            strategy = ns.ShardingStrategy.NO_SHARD
        assert unit.sharding_strategy == strategy, (
            f"{where} FSDP module {fqn!r} sharding_strategy {unit.sharding_strategy}, expected {strategy}"
        )
        if "backward_prefetch" in overrides:
            want = _enum(ns, "backward_prefetch", overrides["backward_prefetch"])
            assert unit.backward_prefetch == want, (
                f"{where} FSDP module {fqn!r} backward_prefetch {unit.backward_prefetch}, expected {want}"
            )


def _expect_raise(ctx, what: str, exc_type, message: str, fn):
    try:
        fn()
    except exc_type as e:
        assert str(e) == message, f"{ctx.where()} {what}: message {str(e)!r}, expected {message!r}"
    else:
        raise AssertionError(f"{ctx.where()} {what}: expected {exc_type.__name__}, nothing raised")


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API})
def fsdp1_already_wrapped_error(ctx):
    """W6: auto-wrapping a tree that already holds an FSDP module raises ValueError naming it."""
    ns = ctx.impl.ns
    FSDP = ns.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner = FSDP(nn.Linear(4, 4), device_id=_device_id(ctx))
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), inner))
    message = (
        "FSDP auto wrapping requires modules to not already have FSDP applied but found "
        f"1.1 in\n{model}"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _expect_raise(
            ctx,
            "W6 nested FSDP",
            ValueError,
            message,
            lambda: FSDP(
                model, auto_wrap_policy=ns.wrap.always_wrap_policy, device_id=_device_id(ctx)
            ),
        )


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API})
def fsdp1_custom_policy_bad_return(ctx):
    """W10: a CustomPolicy lambda answering something other than a bool/dict raises ValueError."""
    ns = ctx.impl.ns
    message = (
        "The lambda_fn passed to CustomPolicy should return False/True or a kwarg dict, "
        "but it returned 1"
    )
    _expect_raise(
        ctx,
        "W10",
        ValueError,
        message,
        lambda: ns.FullyShardedDataParallel(
            zoo.nested_sequential(),
            auto_wrap_policy=ns.wrap.CustomPolicy(lambda m: 1),
            device_id=_device_id(ctx),
        ),
    )


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP1_API},
    cases={"use-orig-params": {"use_orig_params": True}, "flat-params": {"use_orig_params": False}},
)
def fsdp1_mixed_frozen_params(ctx, use_orig_params):
    """W12: a ModuleWrapPolicy target mixing frozen and trainable parameters raises ValueError
    (use_orig_params=False, first offender in post-order) or warns once per offender (True) and
    wraps as planned."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = zoo.LoraModel()
    policy = ns.wrap.ModuleWrapPolicy({zoo.LoraAttention})
    build = functools.partial(
        ns.FullyShardedDataParallel,
        model,
        auto_wrap_policy=policy,
        use_orig_params=use_orig_params,
        device_id=_device_id(ctx),
    )
    if not use_orig_params:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _expect_raise(ctx, "W12", ValueError, _lora_message("layers.0.attn", False), build)
        return
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        wrapped = build()
    got = _user_warnings(record, "requires_grad=True and False")
    want = [_lora_message(f"layers.{i}.attn", True) for i in range(2)]
    assert got == want, f"{ctx.where()} W12 warnings {got}, expected {want}"
    units = sorted(_fsdp1_units(ctx, wrapped))
    assert units == ["", "layers.0.attn", "layers.1.attn"], f"{ctx.where()} W12 units {units}"


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP1_API},
    cases={"never-policy": {"with_policy": True}, "no-policy": {"with_policy": False}},
)
def fsdp1_mixed_precision_override_warning(ctx, with_policy):
    """W11: mixed precision plus any auto_wrap_policy (even one that never wraps) warns once,
    naming the batch-norm classes, and wraps each batch norm alone with mixed precision disabled;
    without a policy there is neither warning nor override."""
    ns = ctx.impl.ns
    model = zoo.NormNet()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        wrapped = ns.FullyShardedDataParallel(
            model,
            auto_wrap_policy=_never if with_policy else None,
            mixed_precision=_mp(ns, True),
            device_id=_device_id(ctx),
        )
    got = _user_warnings(record, "Both mixed precision")
    want = [_MP_WARNING.format(classes={nn.BatchNorm1d})] if with_policy else []
    assert got == want, f"{ctx.where()} W11 warnings {got}, expected {want}"
    units = _fsdp1_units(ctx, wrapped)
    want_units = ["", "bn"] if with_policy else [""]
    assert sorted(units) == want_units, (
        f"{ctx.where()} W11 FSDP modules {sorted(units)}, expected {want_units}"
    )
    if with_policy:
        assert (units["bn"].mixed_precision or ns.MixedPrecision()) == ns.MixedPrecision(), (
            f"{ctx.where()} W11 bn mixed_precision {units['bn'].mixed_precision}, expected MixedPrecision()"
        )
        assert units[""].mixed_precision == _mp(ns, True), (
            f"{ctx.where()} W11 root mixed_precision {units[''].mixed_precision}"
        )


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API})
def fsdp1_enable_wrap_and_wrap(ctx):
    """W7: wrap() outside enable_wrap returns the module itself; inside, it builds the wrapper with
    the context kwargs, per-call overrides winning and a module's _wrap_overrides winning over
    both; a nested enable_wrap raises NotImplementedError; on exit wrap() is inert again."""
    ns = ctx.impl.ns
    W, FSDP = ns.wrap, ns.FullyShardedDataParallel
    lin = nn.Linear(3, 3)
    assert W.wrap(lin) is lin, f"{ctx.where()} wrap() outside enable_wrap did not return the module"
    overridden = nn.Linear(3, 3)
    overridden._wrap_overrides = {"forward_prefetch": False}
    message = (
        "You are already within an autowrap context and we currently do not supported "
        "nested autowrap."
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with W.enable_wrap(
            wrapper_cls=FSDP,
            device_id=_device_id(ctx),
            forward_prefetch=False,
            limit_all_gathers=False,
        ):
            a = W.wrap(nn.Linear(3, 3))
            b = W.wrap(nn.Linear(3, 3), forward_prefetch=True)
            c = W.wrap(overridden, forward_prefetch=True)

            def nested():
                with W.enable_wrap(wrapper_cls=FSDP):
                    pass

            _expect_raise(ctx, "W7 nested enable_wrap", NotImplementedError, message, nested)
            d = W.wrap(nn.Linear(3, 3))  # the outer context is still active
    for name, m, fp in (("a", a, False), ("b", b, True), ("c", c, False), ("d", d, False)):
        assert isinstance(m, FSDP), f"{ctx.where()} W7 wrap() ({name}) returned {type(m).__name__}"
        assert m.forward_prefetch is fp, (
            f"{ctx.where()} W7 ({name}) forward_prefetch {m.forward_prefetch}, expected {fp}"
        )
        assert m.limit_all_gathers is False, (
            f"{ctx.where()} W7 ({name}) limit_all_gathers {m.limit_all_gathers}, expected the "
            "context's False (the default is True)"
        )
    after = nn.Linear(3, 3)
    assert W.wrap(after) is after, f"{ctx.where()} wrap() after enable_wrap exited still wraps"


# -------------------------------------------------------------------------------- FSDP2 API
STEPS, LR, PER_RANK = 3, 0.05, 2


def _fsdp2_groups(ctx, model: nn.Module) -> dict[str, set[str]]:
    """{FSDPModule FQN: FQNs of the parameters its state manages} (upstream's private contract:
    ``_get_fsdp_state()._fsdp_param_group.fsdp_params[i].sharded_param``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, ctx.impl.ns.FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        params = group.fsdp_params if group is not None else []
        out[fqn] = {names.get(id(fp.sharded_param), "<unregistered>") for fp in params}
    return out


def _eval_norms(model: nn.Module) -> None:
    """Batch norms run on running statistics, so a rank's half batch computes what the global
    batch does (training-mode statistics are per rank under data parallelism)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP2_API, base.TRAINING},
    cases=ZOO_CASES,
    timeout=180,
)
def fsdp2_plan_units_and_parity(ctx, case):
    """Sharding the expected units children-first makes exactly those modules FSDPModules, each
    managing the parameters the rules give (ignored ones stay plain tensors), and 3 SGD steps on
    each rank's share of the batch give the parameters of the unwrapped model trained on the
    global batch."""
    from torch.distributed.tensor import DTensor

    c = ZOO[case]
    model = _seeded_model(ctx, c.model)
    _eval_norms(model)
    oracle = copy.deepcopy(model)
    _, _, ignored = _ignored(model, c)
    groups, ignored_fqns = expected_groups(model, c.units, ignored)
    extra = {"ignored_params": set(ignored)} if ignored else {}
    plan = [(u, dict(extra)) for u in c.units]
    model = ctx.impl.shard(model, ctx, plan=plan)
    where = f"{ctx.where()} {case}:"

    got = _fsdp2_groups(ctx, model)
    assert set(got) == set(c.units), (
        f"{where} FSDPModules {sorted(got)}, expected {sorted(c.units)}"
    )
    for unit in c.units:
        assert got[unit] == groups[unit], (
            f"{where} FSDPModule {unit!r} manages {sorted(got[unit])}, expected {sorted(groups[unit])}"
        )
    for name, p in model.named_parameters():
        want = name not in ignored_fqns
        assert isinstance(p, DTensor) == want, (
            f"{where} {name} is {type(p).__name__}; expected {'a DTensor' if want else 'plain (ignored)'}"
        )

    gen = torch.Generator().manual_seed(99)
    batches = [zoo.make_batch(c.model, PER_RANK * ctx.world_size, gen) for _ in range(STEPS)]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    ref_opt = torch.optim.SGD([p for p in oracle.parameters() if p.requires_grad], lr=LR)
    lo = ctx.rank * PER_RANK
    for batch in batches:
        _loss(model(batch[lo : lo + PER_RANK].to(ctx.device))).backward()
        for name, p in model.named_parameters():  # ignored parameters: average by hand
            if name in ignored_fqns and p.grad is not None and ctx.world_size > 1:
                dist.all_reduce(p.grad)
                p.grad /= ctx.world_size
        opt.step()
        opt.zero_grad()
        _loss(oracle(batch)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    expected = dict(oracle.named_parameters())
    for name, p in model.named_parameters():
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        ref = expected[name].detach()
        if not torch.allclose(full, ref, rtol=1e-4, atol=1e-5):
            diff = (full - ref).abs().max().item()
            raise AssertionError(
                f"{where} after {STEPS} SGD steps {name} differs from the unwrapped "
                f"model trained on the global batch (max abs diff {diff:.3g})"
            )


# ---------------------------------------------------------------- W8, W13-W16: the helper APIs
class Box(nn.Module):
    """A stand-in wrapper class: holds ``module`` and the kwargs it was built with."""

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__()
        self.module = module
        self.kwargs = kwargs


def _wrap_api(ctx, name: str):
    """``name`` from the implementation's wrap module (``ns.wrap``), else from the module that
    defines it in upstream's or the reference's layout; NotSupported when it has none."""
    import importlib

    base_name = ctx.impl.ns.__name__
    for module_name in (
        f"{base_name}.wrap",
        f"{base_name}._wrap_utils",
        f"{base_name}.wrap._wrap_plan",
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise NotSupported(f"{name} (not in {base_name}.wrap)")


def _names(model: nn.Module) -> dict[int, str]:
    """id(module) -> its first name in ``named_modules()``."""
    return {id(m): n for n, m in model.named_modules()}


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def or_policy_and_per_class_policy(ctx):
    """W8: ``_or_policy`` answers any(policy(module=, recurse=, nonwrapped_numel=)); the per-class
    helper ``_wrap_module_cls_individually`` answers True to recurse and isinstance to wrap."""
    or_policy = _wrap_api(ctx, "_or_policy")
    individually = _wrap_api(ctx, "_wrap_module_cls_individually")
    calls = []

    def yes(module, recurse, nonwrapped_numel):
        calls.append(("yes", recurse, nonwrapped_numel))
        return True

    def no(module, recurse, nonwrapped_numel):
        calls.append(("no", recurse, nonwrapped_numel))
        return False

    lin, bn = nn.Linear(2, 2), nn.BatchNorm1d(2)
    for policies, want in (([no, no], False), ([no, yes], True), ([yes], True), ([], False)):
        for recurse in (True, False):
            calls.clear()
            got = or_policy(lin, recurse, 7, policies)
            assert got is want, (
                f"{ctx.where()} W8 _or_policy({[p.__name__ for p in policies]}, "
                f"recurse={recurse}) = {got}, expected {want}"
            )
            if policies:
                assert calls and all(c[1:] == (recurse, 7) for c in calls), (
                    f"{ctx.where()} W8 _or_policy passed {calls} to its policies, expected "
                    f"recurse={recurse}, nonwrapped_numel=7"
                )
    classes = (nn.modules.batchnorm._BatchNorm,)
    for module, recurse, want in (
        (lin, True, True),
        (bn, True, True),
        (lin, False, False),
        (bn, False, True),
    ):
        got = individually(module, module_classes=classes, recurse=recurse, nonwrapped_numel=0)
        assert got is want, (
            f"{ctx.where()} W8 _wrap_module_cls_individually({type(module).__name__}, "
            f"recurse={recurse}) = {got}, expected {want}"
        )


W8_CASES = {
    # the four norm layers alone, lin not (the per-class helper alone, or OR'd with a never-policy)
    "individually": ("bn_net", False, ("bn1", "bn2", "bn3", "sync_bn", "")),
    "or-never": ("bn_net", True, ("bn1", "bn2", "bn3", "sync_bn", "")),
    # OR(container policy, per-class): the container and each norm layer inside it
    "container-or": (
        "container",
        True,
        (
            "bn_container.bn1",
            "bn_container.bn2",
            "bn_container.bn3",
            "bn_container.sync_bn",
            "bn_container",
            "",
        ),
    ),
    # the container policy alone: the norm layers stay inside the container's unit
    "container-alone": ("container", False, ("bn_container", "")),
    # W9: a ModuleWrapPolicy used as the container callable inside _or_policy: as container-or
    "module-policy-or": (
        "container",
        "module-policy",
        (
            "bn_container.bn1",
            "bn_container.bn2",
            "bn_container.bn3",
            "bn_container.sync_bn",
            "bn_container",
            "",
        ),
    ),
}


@check(
    area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, cases={k: {"case": k} for k in W8_CASES}
)
def fsdp1_or_policy_units(ctx, case):
    """W8/W9: FSDP1 with ``_or_policy`` / the per-class helper as ``auto_wrap_policy`` builds
    exactly the expected units: every norm layer its own unit, ``lin`` never; a container policy
    (a function or a ModuleWrapPolicy as a callable) OR'd with the per-class helper nests the norm
    units inside the container's unit."""
    ns = ctx.impl.ns
    or_policy = _wrap_api(ctx, "_or_policy")
    per_class = functools.partial(
        _wrap_api(ctx, "_wrap_module_cls_individually"),
        module_classes=(nn.modules.batchnorm._BatchNorm,),
    )
    model_name, with_or, units = W8_CASES[case]

    def container_policy(module, recurse, nonwrapped_numel):
        return recurse or isinstance(module, zoo.BatchNormNet)

    if model_name == "bn_net":
        model = zoo.BatchNormNet()
        policy = (
            functools.partial(or_policy, policies=[_never, per_class]) if with_or else per_class
        )
    else:
        model = zoo.BatchNormContainer()
        if with_or == "module-policy":
            container_policy = ns.wrap.ModuleWrapPolicy({zoo.BatchNormNet})
        policy = (
            functools.partial(or_policy, policies=[container_policy, per_class])
            if with_or
            else container_policy
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = ns.FullyShardedDataParallel(
            model, auto_wrap_policy=policy, device_id=_device_id(ctx)
        )
    got = sorted(_fsdp1_units(ctx, wrapped))
    assert got == sorted(units), (
        f"{ctx.where()} W8 {case}: FSDP modules {got}, expected {sorted(units)}"
    )


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def post_order_apply(ctx):
    """W13: ``_post_order_apply(root, fn)`` calls fn on children before parents, siblings in
    registration order, root last, a shared module once; a returned module replaces the child
    (setattr on its parent); returning a module for the root or a non-module raises
    AssertionError with upstream's message."""
    apply = _wrap_api(ctx, "_post_order_apply")
    model = zoo.nested_sequential()
    names, order = _names(model), []
    apply(model, lambda m: order.append(names[id(m)]))
    want = ["0", "1", "2.0", "2.1", "2", ""]
    assert order == want, f"{ctx.where()} W13 visit order {order}, expected {want} (post-order)"

    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.Sequential(shared, nn.Linear(2, 2)))
    names, order = _names(model), []
    apply(model, lambda m: order.append(names[id(m)]))
    want = ["0", "1.1", "1", ""]
    assert order == want, f"{ctx.where()} W13 shared module: visit order {order}, expected {want}"

    model = zoo.nested_sequential()
    originals = [model[0], model[2][1]]
    apply(model, lambda m: Box(m) if any(m is o for o in originals) else None)
    assert isinstance(model[0], Box) and model[0].module is originals[0], (
        f"{ctx.where()} W13: the module returned for 0 did not replace it ({type(model[0]).__name__})"
    )
    assert isinstance(model[2][1], Box) and model[2][1].module is originals[1], (
        f"{ctx.where()} W13: the module returned for 2.1 did not replace it"
    )
    assert isinstance(model[1], nn.Linear), (
        f"{ctx.where()} W13: 1 was replaced by {type(model[1]).__name__}"
    )

    model = zoo.nested_sequential()
    _expect_raise(
        ctx,
        "W13 replacing the root",
        AssertionError,
        f"Non-root modules should have their parent module set but got None for {model}",
        lambda: apply(model, lambda m: Box(m) if m is model else None),
    )
    model = zoo.nested_sequential()
    _expect_raise(
        ctx,
        "W13 a non-module return",
        AssertionError,
        "fn should return None or an nn.Module but got 1",
        lambda: apply(model, lambda m: 1 if m is model[0] else None),
    )


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def recursive_wrap_numel(ctx):
    """W14: ``_recursive_wrap`` with size_based(40) on the nested Sequential wraps ``2`` (60) and
    then the root remainder, returning (wrapper, 120); with only_wrap_children the root stays
    and it returns 60; the kwargs reach the wrapper; an already wrapped child raises
    AssertionError("Child module ... is already wrapped by ...")."""
    recursive_wrap = _wrap_api(ctx, "_recursive_wrap")
    policy = functools.partial(ctx.impl.ns.wrap.size_based_auto_wrap_policy, min_num_params=40)
    model = zoo.nested_sequential()
    inner = model[2]
    out, numel = recursive_wrap(model, policy, Box, set(), set(), tag="t")
    assert isinstance(out, Box) and out.module is model and numel == 120, (
        f"{ctx.where()} W14 returned ({type(out).__name__}, {numel}), expected (Box(root), 120)"
    )
    assert (
        isinstance(model[2], Box) and model[2].module is inner and model[2].kwargs == {"tag": "t"}
    ), f"{ctx.where()} W14: 2 is {type(model[2]).__name__}, expected Box(2) with the kwargs"
    assert isinstance(model[0], nn.Linear), f"{ctx.where()} W14: 0 (30 < 40) was wrapped"

    model = zoo.nested_sequential()
    out, numel = recursive_wrap(model, policy, Box, set(), set(), only_wrap_children=True)
    assert out is model and numel == 60 and isinstance(model[2], Box), (
        f"{ctx.where()} W14 only_wrap_children: returned ({type(out).__name__}, {numel}), expected "
        f"(the root itself, 60) with 2 wrapped"
    )

    model = nn.Sequential(nn.Linear(5, 5), Box(nn.Linear(5, 5)))
    _expect_raise(
        ctx,
        "W14 an already wrapped child",
        AssertionError,
        f"Child module {model[1]} is already wrapped by {Box}",
        lambda: recursive_wrap(model, policy, Box, set(), set()),
    )


@check(area="wrap", requires={base.AUTO_WRAP})
def zero_argument_forward(ctx):
    """W15: a sharded module whose ``forward()`` takes no argument runs, returns the unwrapped
    module's output, and its backward reaches every parameter."""
    expected = zoo.ZeroArgNet()().detach()
    model = ctx.impl.shard(zoo.ZeroArgNet().to(ctx.device), ctx)
    out = model()
    assert torch.equal(out.detach().cpu(), expected), (
        f"{ctx.where()} W15 forward() returned {out.tolist()}, expected {expected.tolist()}"
    )
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters()), (
        f"{ctx.where()} W15: backward after a zero-argument forward left a parameter without grad"
    )


def _states_by_name(model: nn.Module, states) -> dict[str, tuple[set[str], set[str]]]:
    names = _names(model)
    params = {id(p): n for n, p in model.named_parameters()}
    buffers = {id(b): n for n, b in model.named_buffers()}
    return {
        names[id(unit)]: (
            {params[id(p)] for p in state.params},
            {buffers[id(b)] for b in state.buffers},
        )
        for unit, state in states.items()
    }


W16_CASES = {
    # shared parameter between a parent unit (root, through lin) and a child unit (seq2.0): the
    # parent walks first (modules() order) and takes it
    "parent-child": (
        "parent-child",
        False,
        {
            "": ({"lin.weight"}, set()),
            "seq1": ({"seq1.0.weight", "seq1.1.weight"}, {"seq1.seq1_buffer"}),
            "seq2": ({"seq2.1.weight"}, {"seq2.1.seq2_1_buffer"}),
            "seq2.0": (set(), set()),
        },
    ),
    # shared between siblings (seq1.0 and seq2.0.0), LCA variant: their lowest common ancestor's
    # unit (the root) takes it
    "siblings-lca": (
        "siblings",
        True,
        {
            "": ({"lin.weight", "seq1.0.weight"}, set()),
            "seq1": ({"seq1.1.weight"}, {"seq1.seq1_buffer"}),
            "seq2": ({"seq2.1.weight"}, {"seq2.1.seq2_1_buffer"}),
            "seq2.0": (set(), set()),
        },
    ),
    # an ignored parameter (seq1.1.weight) belongs to no unit, and the others keep their owners
    "ignored-param": (
        "parent-child",
        False,
        {
            "": ({"lin.weight"}, set()),
            "seq1": ({"seq1.0.weight"}, {"seq1.seq1_buffer"}),
            "seq2": ({"seq2.1.weight"}, {"seq2.1.seq2_1_buffer"}),
            "seq2.0": (set(), set()),
        },
    ),
}


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP1_API},
    world_sizes=(1,),
    cases={k: {"case": k} for k in W16_CASES},
)
def module_to_states(ctx, case):
    """W16 (seed era; removed upstream in torch 2.13, so not supported there):
    ``_get_fully_sharded_module_to_states`` maps the root and each unit ModuleWrapPolicy({Sequential})
    selects, in modules() order, to the parameters and buffers it owns: a shared parameter goes to
    the first unit walking to it (or, LCA variant, to the unit of the lowest common ancestor); an
    ignored parameter goes to no unit."""
    try:
        states_of = _wrap_api(ctx, "_get_fully_sharded_module_to_states")
    except NotSupported as exc:
        raise NotSupported(f"{exc}: a seed-era helper, removed upstream in torch 2.13") from None
    share, lca, want = W16_CASES[case]
    model = zoo.StatesModel(share)
    policy = ctx.impl.ns.wrap.ModuleWrapPolicy({nn.Sequential})
    kwargs = {"assign_shared_params_to_lca": True} if lca else {}
    ignored = {model.seq1[1].weight} if case == "ignored-param" else set()
    states = states_of(model, policy, set(), ignored, **kwargs)
    got = _states_by_name(model, states)
    assert list(got) == ["", "seq1", "seq2", "seq2.0"], (
        f"{ctx.where()} W16 {case}: units {list(got)}, expected ['', 'seq1', 'seq2', 'seq2.0'] "
        "(modules() order)"
    )
    for unit, (params, buffers) in want.items():
        assert got[unit] == (params, buffers), (
            f"{ctx.where()} W16 {case}: unit {unit!r} owns params {sorted(got[unit][0])} buffers "
            f"{sorted(got[unit][1])}, expected {sorted(params)} / {sorted(buffers)}"
        )


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP1_API, base.MIXED_PRECISION},
    cases={"module-policy": {"never": False}, "never-policy": {"never": True}},
)
def fsdp1_batch_norm_override_forward(ctx, never):
    """W11: under FSDP1 with fp16 mixed precision and an auto_wrap_policy, the batch norm's own
    unit computes in fp32 (its input is cast up and its weight is fp32) and hands its output back
    in the dtype its input had (fp16); forward and backward run, the output is fp16."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = zoo.RecordingNormNet()
    policy = _never if never else ns.wrap.ModuleWrapPolicy({nn.Linear})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = ns.FullyShardedDataParallel(
            model, auto_wrap_policy=policy, mixed_precision=_mp(ns, True), device_id=_device_id(ctx)
        )
    bn_out = []
    model.bn.register_forward_hook(lambda m, args, out: bn_out.append(out.dtype))
    out = wrapped(torch.randn(4, 4, device=ctx.device))
    assert model.bn.seen == [(torch.float32, torch.float32)], (
        f"{ctx.where()} W11 the batch norm saw (input, weight) dtypes {model.bn.seen}, expected "
        "[(float32, float32)] (mixed precision disabled for its unit)"
    )
    assert bn_out == [FP16], (
        f"{ctx.where()} W11 the batch norm's output was {bn_out}, expected [float16] (cast back)"
    )
    assert out.dtype == FP16, f"{ctx.where()} W11 output dtype {out.dtype}, expected float16"
    out.float().sum().backward()


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def policy_callables(ctx):
    """W1/W9: the callable policies answer the recurse and wrap questions directly:
    size-based(40) is False at 39 and True at 40 for both, never recurses into a force leaf
    (MultiheadAttention) nor wraps an excluded container (ModuleList); ModuleWrapPolicy /
    transformer_auto_wrap_policy say True to recurse and isinstance to wrap; lambda_auto_wrap_policy
    recurses always and wraps where its function says; always_wrap_policy always says True;
    ModuleWrapPolicy's repr ends with its class set in parentheses."""
    W = ctx.impl.ns.wrap
    lin, mha, mlist = nn.Linear(2, 2), nn.MultiheadAttention(4, 1), nn.ModuleList([nn.Linear(2, 2)])
    size40 = functools.partial(W.size_based_auto_wrap_policy, min_num_params=40)
    module_policy = W.ModuleWrapPolicy({nn.Linear})
    transformer = functools.partial(
        W.transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear}
    )
    lam = functools.partial(W.lambda_auto_wrap_policy, lambda_fn=lambda m: m is lin)
    cases = [
        ("size_based(40)", size40, lin, True, 39, False),
        ("size_based(40)", size40, lin, True, 40, True),
        ("size_based(40)", size40, lin, False, 39, False),
        ("size_based(40)", size40, lin, False, 40, True),
        ("size_based(40)", size40, mha, True, 400, False),
        ("size_based(40)", size40, mha, False, 400, True),
        ("size_based(40)", size40, mlist, True, 400, True),
        ("size_based(40)", size40, mlist, False, 400, False),
        ("ModuleWrapPolicy", module_policy, mha, True, 0, True),
        ("ModuleWrapPolicy", module_policy, lin, False, 0, True),
        ("ModuleWrapPolicy", module_policy, mha, False, 0, False),
        ("transformer", transformer, mha, True, 0, True),
        ("transformer", transformer, lin, False, 0, True),
        ("transformer", transformer, mha, False, 0, False),
        ("lambda", lam, mha, True, 0, True),
        ("lambda", lam, lin, False, 0, True),
        ("lambda", lam, mha, False, 0, False),
        ("always", W.always_wrap_policy, mha, False, 0, True),
    ]
    for name, policy, module, recurse, numel, want in cases:
        got = policy(module=module, recurse=recurse, nonwrapped_numel=numel)
        assert bool(got) is want and isinstance(got, bool), (
            f"{ctx.where()} {name}({type(module).__name__}, recurse={recurse}, nonwrapped_numel="
            f"{numel}) = {got!r}, expected {want}"
        )
    tail = f"({ {nn.Linear} })"
    assert repr(module_policy).endswith(tail), (
        f"{ctx.where()} W9 repr(ModuleWrapPolicy({{Linear}})) = {module_policy!r}, expected it to end "
        f"with {tail!r}"
    )
