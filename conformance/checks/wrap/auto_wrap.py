"""Area "wrap", the FSDP1 auto-wrap constructor path: what ``FullyShardedDataParallel(model,
auto_wrap_policy=...)`` builds, and what it refuses or warns about (W1-W6, W8-W12).

The expected units, kwargs and messages come from the rules in ``_cases.py``'s Note; the FSDP
modules and their flat parameters are read off the wrapped model (``_helpers.py``).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks.wrap import _models as zoo
from conformance.checks.wrap._cases import (
    FP16,
    MP_WARNING,
    ZOO,
    ZOO_CASES,
    build_policy,
    enum_member,
    expected_groups,
    ignored_of,
    lora_message,
    mp_policy,
    never_wrap,
    seeded_model,
    user_warnings,
)
from conformance.checks.wrap._helpers import (
    device_id,
    expect_raise,
    fsdp1_managed,
    fsdp1_units,
    wrap_api,
)
from conformance.registry import check


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, cases=ZOO_CASES, timeout=180)
def fsdp1_auto_wrap_units(ctx, case):
    """FullyShardedDataParallel(model, auto_wrap_policy=...) builds exactly the expected FSDP
    modules; each flattens exactly its managed parameters and carries the expected mixed
    precision, sharding strategy (NO_SHARD at world size 1), backward prefetch and the root's
    forward_prefetch (W1-W5, W9)."""
    c, ns = ZOO[case], ctx.impl.ns
    model = seeded_model(ctx, c.model)
    ignored_modules, ignored_params, ignored = ignored_of(model, c)
    groups, _ = expected_groups(model, c.units, ignored)
    # forward_prefetch=True (default False): every unit must inherit it from the root kwargs
    kwargs = {
        "device_id": device_id(ctx),
        "mixed_precision": mp_policy(ns, c.mixed_precision),
        "forward_prefetch": True,
    }
    if ignored_modules:
        kwargs["ignored_modules"] = ignored_modules
    if ignored_params:
        kwargs["ignored_states"] = ignored_params
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = ns.FullyShardedDataParallel(model, auto_wrap_policy=build_policy(c, ns), **kwargs)
    units = fsdp1_units(ctx, wrapped)
    where = f"{ctx.where()} {case}:"
    assert set(units) == set(c.units), (
        f"{where} FSDP modules {sorted(units)}, expected {sorted(c.units)}"
    )
    root_mp = mp_policy(ns, c.mixed_precision) or ns.MixedPrecision()
    for fqn, unit in units.items():
        managed = fsdp1_managed(fqn, unit)
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
            want = enum_member(ns, "backward_prefetch", overrides["backward_prefetch"])
            assert unit.backward_prefetch == want, (
                f"{where} FSDP module {fqn!r} backward_prefetch {unit.backward_prefetch}, expected {want}"
            )


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API})
def fsdp1_already_wrapped_error(ctx):
    """W6: auto-wrapping a tree that already holds an FSDP module raises ValueError naming it."""
    ns = ctx.impl.ns
    FSDP = ns.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner = FSDP(nn.Linear(4, 4), device_id=device_id(ctx))
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), inner))
    message = (
        "FSDP auto wrapping requires modules to not already have FSDP applied but found "
        f"1.1 in\n{model}"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect_raise(
            ctx,
            "W6 nested FSDP",
            ValueError,
            message,
            lambda: FSDP(
                model, auto_wrap_policy=ns.wrap.always_wrap_policy, device_id=device_id(ctx)
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
    expect_raise(
        ctx,
        "W10",
        ValueError,
        message,
        lambda: ns.FullyShardedDataParallel(
            zoo.nested_sequential(),
            auto_wrap_policy=ns.wrap.CustomPolicy(lambda m: 1),
            device_id=device_id(ctx),
        ),
    )


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP1_API},
    cases={
        "use-orig-params": {"use_orig_params": True},
        "flat-params": {"use_orig_params": False},
        # layers.0.attn wholly frozen (uniform): the offender is layers.1.attn, after it
        "flat-params-first-uniform": {"use_orig_params": False, "first_uniform": True},
    },
)
def fsdp1_mixed_frozen_params(ctx, use_orig_params, first_uniform=False):
    """W12: a ModuleWrapPolicy target mixing frozen and trainable parameters raises ValueError
    (use_orig_params=False, first offender in post-order, also when a uniform target comes
    before it) or warns once per offender (True) and wraps as planned."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = zoo.LoraModel()
    if first_uniform:
        for p in model.layers[0].attn.parameters():
            p.requires_grad_(False)
    policy = ns.wrap.ModuleWrapPolicy({zoo.LoraAttention})
    build = functools.partial(
        ns.FullyShardedDataParallel,
        model,
        auto_wrap_policy=policy,
        use_orig_params=use_orig_params,
        device_id=device_id(ctx),
    )
    if not use_orig_params:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            offender = "layers.1.attn" if first_uniform else "layers.0.attn"
            expect_raise(ctx, "W12", ValueError, lora_message(offender, False), build)
        return
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        wrapped = build()
    got = user_warnings(record, "requires_grad=True and False")
    want = [lora_message(f"layers.{i}.attn", True) for i in range(2)]
    assert got == want, f"{ctx.where()} W12 warnings {got}, expected {want}"
    units = sorted(fsdp1_units(ctx, wrapped))
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
            auto_wrap_policy=never_wrap if with_policy else None,
            mixed_precision=mp_policy(ns, True),
            device_id=device_id(ctx),
        )
    got = user_warnings(record, "Both mixed precision")
    want = [MP_WARNING.format(classes={nn.BatchNorm1d})] if with_policy else []
    assert got == want, f"{ctx.where()} W11 warnings {got}, expected {want}"
    units = fsdp1_units(ctx, wrapped)
    want_units = ["", "bn"] if with_policy else [""]
    assert sorted(units) == want_units, (
        f"{ctx.where()} W11 FSDP modules {sorted(units)}, expected {want_units}"
    )
    if with_policy:
        assert (units["bn"].mixed_precision or ns.MixedPrecision()) == ns.MixedPrecision(), (
            f"{ctx.where()} W11 bn mixed_precision {units['bn'].mixed_precision}, expected MixedPrecision()"
        )
        assert units[""].mixed_precision == mp_policy(ns, True), (
            f"{ctx.where()} W11 root mixed_precision {units[''].mixed_precision}"
        )


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP1_API, base.MIXED_PRECISION},
    cases={"module-policy": {"never": False}, "never-policy": {"never": True}},
)
def fsdp1_batch_norm_override_forward(ctx, never):
    """W11: under FSDP1 with fp16 mixed precision and an auto_wrap_policy, the batch norm's own
    unit computes in fp32 (its input is cast up and its weight is fp32; a non-floating input,
    a bool mask, arrives unchanged) and hands its output back in the dtype its input had (fp16);
    forward and backward run, the output is fp16."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = zoo.RecordingNormNet()
    policy = never_wrap if never else ns.wrap.ModuleWrapPolicy({nn.Linear})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = ns.FullyShardedDataParallel(
            model,
            auto_wrap_policy=policy,
            mixed_precision=mp_policy(ns, True),
            device_id=device_id(ctx),
        )
    bn_out = []
    model.bn.register_forward_hook(lambda m, args, out: bn_out.append(out.dtype))
    out = wrapped(torch.randn(4, 4, device=ctx.device))
    assert model.bn.seen == [(torch.float32, torch.float32)], (
        f"{ctx.where()} W11 the batch norm saw (input, weight) dtypes {model.bn.seen}, expected "
        "[(float32, float32)] (mixed precision disabled for its unit)"
    )
    assert model.bn.mask_seen == [torch.bool], (
        f"{ctx.where()} W11 the batch norm's bool mask arrived as {model.bn.mask_seen}, expected "
        "[torch.bool] (the fp32 input cast leaves non-floating inputs as they are)"
    )
    assert bn_out == [FP16], (
        f"{ctx.where()} W11 the batch norm's output was {bn_out}, expected [float16] (cast back)"
    )
    assert out.dtype == FP16, f"{ctx.where()} W11 output dtype {out.dtype}, expected float16"
    out.float().sum().backward()


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
    or_policy = wrap_api(ctx, "_or_policy")
    per_class = functools.partial(
        wrap_api(ctx, "_wrap_module_cls_individually"),
        module_classes=(nn.modules.batchnorm._BatchNorm,),
    )
    model_name, with_or, units = W8_CASES[case]

    def container_policy(module, recurse, nonwrapped_numel):
        return recurse or isinstance(module, zoo.BatchNormNet)

    if model_name == "bn_net":
        model = zoo.BatchNormNet()
        policy = (
            functools.partial(or_policy, policies=[never_wrap, per_class]) if with_or else per_class
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
            model, auto_wrap_policy=policy, device_id=device_id(ctx)
        )
    got = sorted(fsdp1_units(ctx, wrapped))
    assert got == sorted(units), (
        f"{ctx.where()} W8 {case}: FSDP modules {got}, expected {sorted(units)}"
    )
