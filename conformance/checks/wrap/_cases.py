"""The zoo cases of the wrap area and the rules their expected plans come from.

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
  * ``plans.py::plan_matches_expected`` — the implementation's side-effect-free plan builder
    (``reference.wrap.build_wrap_plan``), world size 1;
  * ``auto_wrap.py::fsdp1_auto_wrap_units`` — ``ns.FullyShardedDataParallel(model,
    auto_wrap_policy=...)``: the FSDP module names, their managed parameters and kwargs (mixed
    precision, sharding strategy, backward prefetch) read off the wrapped modules;
  * ``applying.py::fsdp2_plan_units_and_parity`` — ``ctx.impl.shard(model, plan=...)`` with the
    expected units (children first): the ``FSDPModule`` set, each unit's parameters, and 3 SGD
    steps equal to the unwrapped model trained on the global batch.
The W11 and W12 messages an implementation must give are built here too (:func:`lora_message`,
:data:`MP_WARNING`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from conformance.checks.wrap import _models as zoo

FP16 = torch.float16


def never_wrap(module, recurse, nonwrapped_numel):
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

    return answer  # resolved against the implementation's enums in build_policy()


@dataclass(frozen=True)
class WrapCase:
    model: str
    policy: object  # W -> policy (None: no auto_wrap_policy); see build_policy()
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
        "norm", lambda W: never_wrap, ("bn", ""), mixed_precision=True, mp_off=("bn",)
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


def build_policy(case: WrapCase, ns, enums=True):
    """The case's policy built from the implementation's ``wrap`` module (enums from ``ns``, or
    enum names as opaque values when ``enums`` is false)."""
    if case.custom is not None:
        answer = case.custom(ns.wrap)

        def resolved(module):
            out = answer(module)
            if isinstance(out, dict):
                return {k: enum_member(ns if enums else None, k, v) for k, v in out.items()}
            return out

        return ns.wrap.CustomPolicy(resolved)
    return case.policy(ns.wrap) if case.policy is not None else None


def enum_member(ns, key: str, member: str):
    """The enum member ``member`` of the kwarg ``key`` from ``ns``; with ``ns=None`` the name
    itself (a plan builder treats kwargs as opaque values)."""
    if ns is None:
        return member
    cls = {"sharding_strategy": "ShardingStrategy", "backward_prefetch": "BackwardPrefetch"}[key]
    return getattr(getattr(ns, cls), member)


def ignored_of(model: nn.Module, case: WrapCase):
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
    kwargs.update({k: enum_member(ns, k, v) for k, v in case.overrides.get(unit, {}).items()})
    if unit in case.mp_off:
        kwargs["mixed_precision"] = None
    return kwargs


def seeded_model(ctx, name: str) -> nn.Module:
    ctx.seed(1234)
    return zoo.make_model(name)


def mp_policy(ns, enabled: bool):
    return ns.MixedPrecision(param_dtype=FP16) if enabled else None


def lora_message(unit: str, use_orig_params: bool) -> str:
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


MP_WARNING = (
    "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped module "
    "has submodules of type:\n{classes}\nThese modules will be wrapped as separate FSDP instances "
    "with mixed precision disabled."
)


def user_warnings(record, needle: str) -> list[str]:
    """The UserWarning messages in ``record`` that contain ``needle``. Upstream's misspelling
    "instacnes" in the W11 message (torch <= 2.13; 2.14 spells it "instances") reads as the word it
    means: the rule is the message's meaning, not one release's spelling."""
    return [
        str(w.message).replace("FSDP instacnes", "FSDP instances")
        for w in record
        if issubclass(w.category, UserWarning) and needle in str(w.message)
    ]
