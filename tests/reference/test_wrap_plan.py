"""Tests for the side-effect-free wrap plan (``reference.wrap._wrap_plan.build_wrap_plan``).

The oracle is torch 2.13's FSDP1: ``FullyShardedDataParallel(model, auto_wrap_policy=...)`` in
one process with a rank/size-only process group and ``device_id=cpu``, and torch's own
``_auto_wrap`` driven with a recording stand-in (for the exact kwargs of each unit).
"""

from __future__ import annotations

import copy
import functools
import re
import warnings

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp import _wrap_utils as torch_wrap_utils
from torch.distributed.fsdp import wrap as TW

from reference import wrap as W
from reference.wrap import _wrap_utils as wu
from reference.wrap._wrap_plan import WrapPlan, WrapPlanEntry, build_wrap_plan

CPU = torch.device("cpu")


class DummyProcessGroup:
    """Answers rank()/size() only: enough to construct FSDP1 units on CPU."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class Block(nn.Module):
    """A custom container (children as attributes c0, c1, ...)."""

    def __init__(self, children):
        super().__init__()
        for i, child in enumerate(children):
            setattr(self, f"c{i}", child)


# --- random models and policies ----------------------------------------------------------------

LEAVES = st.one_of(
    st.tuples(st.just("linear"), st.integers(1, 9), st.integers(1, 9), st.booleans()),
    st.tuples(st.just("bn"), st.integers(1, 6)),
    st.tuples(st.just("ln"), st.integers(1, 6)),
    st.tuples(st.just("emb"), st.integers(1, 6), st.integers(1, 4)),
    st.just(("relu",)),
    st.just(("mha",)),  # a force-leaf module for the size-based policy
)


def _containers(inner):
    return st.tuples(
        st.sampled_from(["seq", "list", "block"]), st.lists(inner, min_size=1, max_size=4)
    )


MODELS = _containers(st.recursive(LEAVES, _containers, max_leaves=10))  # the root: a container

CLASSES = {
    "Linear": nn.Linear,
    "BatchNorm1d": nn.BatchNorm1d,
    "LayerNorm": nn.LayerNorm,
    "Embedding": nn.Embedding,
    "Sequential": nn.Sequential,
    "ModuleList": nn.ModuleList,
    "Block": Block,
    "MultiheadAttention": nn.MultiheadAttention,
}
CLASS_SETS = st.frozensets(st.sampled_from(sorted(CLASSES)), min_size=1, max_size=3)
ANSWERS = st.sampled_from([False, True, {}, {"forward_prefetch": True}])
POLICIES = st.one_of(
    st.tuples(st.just("size"), st.sampled_from([0, 5, 20, 40, 100, 300])),
    st.just(("always",)),
    st.tuples(st.just("module"), CLASS_SETS),
    st.tuples(st.just("transformer"), CLASS_SETS),
    st.tuples(st.just("lambda"), CLASS_SETS),
    st.tuples(st.just("custom"), st.dictionaries(st.sampled_from(sorted(CLASSES)), ANSWERS)),
    st.tuples(st.just("or"), st.sampled_from([20, 100]), CLASS_SETS),
)


def build_model(spec) -> nn.Module:
    kind = spec[0]
    if kind == "linear":
        return nn.Linear(spec[1], spec[2], bias=spec[3])
    if kind == "bn":
        return nn.BatchNorm1d(spec[1])
    if kind == "ln":
        return nn.LayerNorm(spec[1])
    if kind == "emb":
        return nn.Embedding(spec[1], spec[2])
    if kind == "relu":
        return nn.ReLU()
    if kind == "mha":
        return nn.MultiheadAttention(4, 1)  # 80 numel, with a Linear child (out_proj)
    children = [build_model(c) for c in spec[1]]
    if kind == "seq":
        return nn.Sequential(*children)
    return nn.ModuleList(children) if kind == "list" else Block(children)


def build_policy(spec, lib):
    """The same policy from torch's module (``lib=TW``) or the reference's (``lib=W``)."""
    kind = spec[0]
    if kind == "size":
        return functools.partial(lib.size_based_auto_wrap_policy, min_num_params=spec[1])
    if kind == "always":
        return lib.always_wrap_policy
    classes = None if kind == "custom" else {CLASSES[n] for n in spec[-1]}
    if kind == "module":
        return lib.ModuleWrapPolicy(classes)
    if kind == "transformer":
        return functools.partial(lib.transformer_auto_wrap_policy, transformer_layer_cls=classes)
    if kind == "lambda":
        return functools.partial(
            lib.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, tuple(classes))
        )
    if kind == "custom":
        answers = {CLASSES[n]: a for n, a in spec[1].items()}
        return lib.CustomPolicy(lambda m: copy.copy(answers.get(type(m), False)))
    size = functools.partial(lib.size_based_auto_wrap_policy, min_num_params=spec[1])
    individually = functools.partial(lib._wrap_module_cls_individually, module_classes=classes)
    return functools.partial(lib._or_policy, policies=[size, individually])


def pick(model: nn.Module, indices) -> list[nn.Module]:
    """Non-root modules of ``model`` at the given positions of ``named_modules()``."""
    modules = [m for _, m in model.named_modules()][1:]
    return [modules[i % len(modules)] for i in indices] if modules else []


def freeze(model: nn.Module, indices) -> None:
    params = list(model.parameters())
    for i in indices:
        if params:
            params[i % len(params)].requires_grad_(False)


def clean(name: str) -> str:
    return ".".join(p for p in name.split(".") if p and p != "_fsdp_wrapped_module")


def _are_params(ignored) -> bool:
    return all(isinstance(x, nn.Parameter) for x in ignored)


def _ignored_sets(ignored) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """FSDP1's normalisation: ignored modules with their subtrees, and all ignored parameters."""
    if _are_params(ignored):
        return set(), set(ignored)
    modules = {m for top in ignored for m in top.modules()}
    return modules, {p for m in modules for p in m.parameters()}


def torch_fsdp1_units(model, policy, ignored, mp, use_orig_params):
    """{clean fqn: FSDP instance} of what torch FSDP1 builds (``""`` = the root)."""
    fsdp = FSDP(
        model,
        process_group=DummyProcessGroup(0, 1),
        auto_wrap_policy=policy,
        ignored_modules=None if not ignored or _are_params(ignored) else ignored,
        ignored_states=ignored if ignored and _are_params(ignored) else None,
        mixed_precision=mp,
        use_orig_params=use_orig_params,
        device_id=CPU,
    )
    return {clean(n): m for n, m in fsdp.named_modules() if isinstance(m, FSDP)}


def torch_param_groups(units) -> dict[str, set[str]]:
    """{unit fqn: FQNs (from the root) of the original parameters in its flat parameter}."""
    groups = {}
    for fqn, unit in units.items():
        handle = unit._handle
        names = handle.flat_param._fqns if handle is not None else []
        groups[fqn] = {f"{fqn}.{n}" if fqn else n for n in names}
    return groups


def torch_auto_wrap_calls(model, policy, ignored, root_kwargs):
    """What torch's ``_auto_wrap`` passes to the FSDP class, in call order: [(fqn, kwargs)]."""
    names = {m: n for n, m in model.named_modules()}
    calls = []

    class Recorder:
        def __new__(cls, module, **kwargs):
            calls.append((names[module], dict(kwargs)))
            return module

    ignored_modules, ignored_params = _ignored_sets(ignored)
    torch_wrap_utils._auto_wrap(
        model, policy, ignored_modules, ignored_params, dict(root_kwargs), Recorder
    )
    return calls


def run_or_error(fn):
    try:
        return fn(), None
    except (ValueError, TypeError, RuntimeError, AssertionError) as e:
        return None, e


# --- the property test -------------------------------------------------------------------------


@given(
    model_spec=MODELS,
    policy_spec=POLICIES,
    ignored_idx=st.lists(st.integers(0, 50), max_size=2),
    ignore_params=st.booleans(),
    frozen_idx=st.lists(st.integers(0, 50), max_size=2),
    with_mp=st.booleans(),
    use_orig_params=st.booleans(),
)
def test_plan_matches_torch_fsdp1(
    model_spec, policy_spec, ignored_idx, ignore_params, frozen_idx, with_mp, use_orig_params
):
    mp = MixedPrecision(param_dtype=torch.float16) if with_mp else None

    def fresh():
        model = build_model(model_spec)
        freeze(model, frozen_idx)
        if ignore_params:
            params = list(model.parameters())
            return model, [params[i % len(params)] for i in ignored_idx] if params else []
        return model, pick(model, ignored_idx)

    model, ignored = fresh()
    root_kwargs = {"mixed_precision": mp, "use_orig_params": use_orig_params, "limit": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, plan_error = run_or_error(
            lambda: build_wrap_plan(
                model,
                build_policy(policy_spec, W),
                ignored_modules=() if ignore_params else ignored,
                ignored_params=ignored if ignore_params else (),
                root_kwargs=root_kwargs,
            )
        )
        torch_model, torch_ignored = fresh()
        units, torch_error = run_or_error(
            lambda: torch_fsdp1_units(
                torch_model, build_policy(policy_spec, TW), torch_ignored, mp, use_orig_params
            )
        )
        rec_model, rec_ignored = fresh()
        calls, rec_error = run_or_error(
            lambda: torch_auto_wrap_calls(
                rec_model, build_policy(policy_spec, TW), rec_ignored, root_kwargs
            )
        )

    # Errors of the wrap step itself (W12) must match; FSDP1's own construction errors (a flat
    # parameter with mixed requires_grad outside W12's reach) are not the plan's business.
    event(f"wrap error: {type(rec_error).__name__}, FSDP1 error: {type(torch_error).__name__}")
    if rec_error is not None:
        assert plan_error is not None and type(plan_error) is type(rec_error)
        assert str(plan_error) == str(rec_error)
        return
    assert plan_error is None, plan_error
    event(f"units: {min(len(plan.entries), 6)}")
    assert [(fqn, dict(kw)) for fqn, kw in plan.targets[:-1]] == calls
    assert plan.entries[-1].module_fqn == "" and dict(plan.entries[-1].kwargs) == root_kwargs

    if torch_error is None:
        assert set(plan.module_fqns) == set(units)
        for fqn, kwargs in plan.targets:
            planned_mp = kwargs.get("mixed_precision")
            assert units[fqn].mixed_precision == (planned_mp or MixedPrecision())
            if fqn:
                assert units[fqn].forward_prefetch == kwargs.get("forward_prefetch", False)
        assert torch_param_groups(units) == {e.module_fqn: set(e.param_fqns) for e in plan.entries}
    else:
        assert "requires_grad" in str(torch_error), torch_error

    check_plan_invariants(model, plan, ignored)


def check_plan_invariants(model: nn.Module, plan: WrapPlan, ignored) -> None:
    fqns = plan.module_fqns
    assert fqns[-1] == "" and fqns.count("") == 1 and len(set(fqns)) == len(fqns)
    for i, earlier in enumerate(fqns):
        for later in fqns[i + 1 :]:
            # children before parents: nothing later lies inside an earlier unit
            assert earlier and not later.startswith(earlier + ".")
    # every parameter in exactly one group (ignored ones in none) ...
    groups = [p for e in plan.entries for p in e.param_fqns]
    all_params = [n for n, _ in model.named_parameters()]
    assert len(groups) == len(set(groups))
    assert sorted(groups + list(plan.ignored_param_fqns)) == sorted(all_params)
    ignored_ids = {id(p) for p in _ignored_sets(ignored)[1]}
    assert {n for n, p in model.named_parameters() if id(p) in ignored_ids} == set(
        plan.ignored_param_fqns
    )
    # ... namely the group of its lowest planned ancestor
    for entry in plan.entries:
        for p in entry.param_fqns:
            owner = p.rsplit(".", 1)[0] if "." in p else ""
            ancestors = [f for f in fqns if f == "" or owner == f or owner.startswith(f + ".")]
            assert max(ancestors, key=lambda f: (f != "", f.count("."), len(f))) == (
                entry.module_fqn
            )


# --- examples and rules ------------------------------------------------------------------------


def nested_sequential():
    return nn.Sequential(
        nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    )


def test_plan_nested_sequential_examples():
    size40 = functools.partial(W.size_based_auto_wrap_policy, min_num_params=40)
    plan = build_wrap_plan(nested_sequential(), size40, root_kwargs={"k": 1})
    assert plan.targets == [("2", {"k": 1}), ("", {"k": 1})]
    assert plan.entries[0].param_fqns == ("2.0.weight", "2.0.bias", "2.1.weight", "2.1.bias")
    assert plan.entries[1].param_fqns == ("0.weight", "0.bias", "1.weight", "1.bias")
    always = build_wrap_plan(nested_sequential(), W.always_wrap_policy)
    assert always.module_fqns == ("0", "1", "2.0", "2.1", "2", "")
    assert build_wrap_plan(nested_sequential(), None).module_fqns == ("",)
    model = nested_sequential()
    plan = build_wrap_plan(model, W.always_wrap_policy, ignored_modules=[model[1], model[2][0]])
    assert plan.module_fqns == ("0", "2.1", "2", "")
    assert plan.ignored_param_fqns == ("1.weight", "1.bias", "2.0.weight", "2.0.bias")
    plan = build_wrap_plan(model, W.ModuleWrapPolicy({nn.Linear}), ignored_params=[model[0].bias])
    assert plan.targets[0] == ("0", {"auto_wrap_policy": None})
    assert plan.entries[0].param_fqns == ("0.weight",)
    assert plan.ignored_param_fqns == ("0.bias",)
    # the FQNs name the unwrapped model's modules ("" = the root)
    assert model.get_submodule(plan.module_fqns[0]) is model[0]
    assert model.get_submodule(plan.module_fqns[-1]) is model


def test_plan_is_frozen_and_read_only():
    plan = build_wrap_plan(nested_sequential(), W.always_wrap_policy, root_kwargs={"a": 1})
    with pytest.raises(AttributeError):
        plan.entries = ()
    with pytest.raises(TypeError):
        plan.entries[0].kwargs["a"] = 2
    plan.targets[0][1]["a"] = 3  # a fresh dict each time
    assert plan.targets[0][1]["a"] == 1
    assert isinstance(plan.entries[0], WrapPlanEntry)


def snapshot(model: nn.Module):
    return [
        (
            name,
            id(m),
            sorted(m.__dict__),
            len(m._forward_pre_hooks),
            len(m._forward_hooks),
            [(n, id(p), p.requires_grad) for n, p in m.named_parameters(recurse=False)],
        )
        for name, m in model.named_modules()
    ]


@pytest.mark.parametrize(
    "policy",
    [
        W.ModuleWrapPolicy({nn.Linear}),
        W.always_wrap_policy,
        W.CustomPolicy(lambda m: isinstance(m, nn.BatchNorm1d) and {"x": 1}),
    ],
)
def test_plan_does_not_modify_model_and_overrides_batchnorm(policy):
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm1d(3)))
    before = snapshot(model)
    mp = MixedPrecision(param_dtype=torch.float16)
    with pytest.warns(UserWarning, match="instacnes with mixed precision disabled"):
        plan = build_wrap_plan(model, policy, root_kwargs={"mixed_precision": mp})
    assert snapshot(model) == before and not hasattr(model[1], "_wrap_overrides")
    kwargs = dict(plan.targets)
    assert kwargs["1"]["mixed_precision"] is None and kwargs["2.0"]["mixed_precision"] is None
    assert kwargs[""]["mixed_precision"] is mp
    if "0" in kwargs:
        assert kwargs["0"]["mixed_precision"] is mp


def test_plan_errors_leave_model_untouched():
    model = nested_sequential()
    before = snapshot(model)
    with pytest.raises(ValueError, match="should return False/True or a kwarg dict"):
        build_wrap_plan(model, W.CustomPolicy(lambda m: 1))
    msg = (  # FSDP1 names every element type, sorted by repr
        "ignored_modules expects nn.Module list elements but got types "
        "[<class 'int'>, <class 'torch.nn.modules.linear.Linear'>]"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        build_wrap_plan(model, W.always_wrap_policy, ignored_modules=[model[0], 1])
    msg = (
        "ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
        "[<class 'torch.Tensor'>]"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        build_wrap_plan(model, W.always_wrap_policy, ignored_params=[torch.ones(1)])
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="0 has both parameters with requires_grad=True and False"):
        build_wrap_plan(model, W.ModuleWrapPolicy({nn.Linear}))
    model[0].weight.requires_grad_(True)
    assert snapshot(model) == before


# --- model zoo: torch FSDP1 vs the reference machinery with a stand-in wrapper -------------------


class Unit(nn.Module):
    """Stand-in wrapper: parent of the wrapped module, keeps the kwargs."""

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__()
        self.module, self.kwargs = module, kwargs


def _size(n, **kw):
    return lambda lib: functools.partial(lib.size_based_auto_wrap_policy, min_num_params=n, **kw)


def _bn_individually(lib):
    bn = (nn.modules.batchnorm._BatchNorm,)
    return functools.partial(lib._wrap_module_cls_individually, module_classes=bn)


def _never(*args, **kwargs):
    return False


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2, self.lin3 = (nn.Linear(2, 2) for _ in range(3))
        self.lin4 = nn.Sequential()
        self.lin4.nested_lin = nn.Linear(2, 2)


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)
        self.bn1, self.bn2, self.bn3 = nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2)
        self.sync_bn = nn.SyncBatchNorm(2)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight


def _transformer():
    return nn.Transformer(
        d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16
    )


TRANSFORMER_LAYERS = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}


class LoraAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 4, bias=False)
        self.lora_A = nn.Linear(4, 2, bias=False)
        self.lora_B = nn.Linear(2, 4, bias=False)


class LoraModel(nn.Module):
    """Frozen base weights, trainable lora_A (W12's model)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.layers = nn.ModuleList([nn.Sequential(LoraAttn(), nn.LayerNorm(4)) for _ in range(2)])
        for name, p in self.named_parameters():
            p.requires_grad_("lora_A" in name)


def _lora_apart(lib):
    def fn(m):
        return isinstance(m, LoraAttn) or (isinstance(m, nn.Linear) and m.weight.requires_grad)

    return lib.CustomPolicy(fn)


ZOO = {
    "nested-size40": (nested_sequential, _size(40), None, False),
    "nested-always": (nested_sequential, lambda lib: lib.always_wrap_policy, None, False),
    "nested-always-ignored": (
        nested_sequential,
        lambda lib: lib.always_wrap_policy,
        lambda m: [m[1], m[2][0]],
        False,
    ),
    "nested-size40-ignored": (nested_sequential, _size(40), lambda m: [m[1], m[2][0]], False),
    "mymodel-size0": (MyModel, _size(0), None, False),
    "modulelist-small": (
        lambda: nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]),
        _size(40),
        None,
        False,
    ),
    "modulelist-big": (lambda: nn.ModuleList([nn.Linear(10, 10)]), _size(40), None, False),
    "mha-force-leaf": (
        lambda: nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1)),
        _size(40),
        None,
        False,
    ),
    "custom-force-leaf": (
        lambda: nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)])),
        _size(40, force_leaf_modules={nn.MultiheadAttention, nn.Linear}),
        None,
        False,
    ),
    "bn-individually": (BatchNormNet, _bn_individually, None, False),
    "bn-or-never": (
        BatchNormNet,
        lambda lib: functools.partial(lib._or_policy, policies=[_never, _bn_individually(lib)]),
        None,
        False,
    ),
    "bn-mp-module-policy": (
        BatchNormNet,
        lambda lib: lib.ModuleWrapPolicy({nn.Linear}),
        None,
        True,
    ),
    "bn-mp-never": (BatchNormNet, lambda lib: _never, None, True),
    "bn-mp-size": (BatchNormNet, _size(3), None, True),
    "tied-size0": (Tied, _size(0), None, False),
    "tied-module": (Tied, lambda lib: lib.ModuleWrapPolicy({nn.Sequential}), None, False),
    "tied-custom": (
        Tied,
        lambda lib: lib.CustomPolicy(
            lambda m: isinstance(m, nn.Linear) and {"forward_prefetch": True}
        ),
        None,
        False,
    ),
    "transformer-layers": (
        _transformer,
        lambda lib: functools.partial(
            lib.transformer_auto_wrap_policy, transformer_layer_cls=TRANSFORMER_LAYERS
        ),
        None,
        False,
    ),
    "transformer-module-mp": (
        _transformer,
        lambda lib: lib.ModuleWrapPolicy(TRANSFORMER_LAYERS),
        None,
        True,
    ),
    "lora-module": (LoraModel, lambda lib: lib.ModuleWrapPolicy({LoraAttn}), None, False),
    "lora-custom-mp": (LoraModel, _lora_apart, None, True),
    "transformer-size500": (_transformer, _size(500), None, False),
    "transformer-size500-mp": (_transformer, _size(500), None, True),
}


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_tied_parameter_goes_to_the_first_unit(use_orig_params):
    policy = {nn.Embedding, nn.Linear}
    plan = build_wrap_plan(Tied(), W.ModuleWrapPolicy(policy))
    groups = {e.module_fqn: e.param_fqns for e in plan.entries}
    assert groups["emb"] == ("emb.weight",) and groups["head"] == () and groups[""] == ()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        units = torch_fsdp1_units(Tied(), TW.ModuleWrapPolicy(policy), [], None, use_orig_params)
    torch_groups = torch_param_groups(units)
    assert torch_groups["emb"] == {"emb.weight"}
    # torch 2.13 FSDP1 with use_orig_params=False flattens the tied weight a second time into
    # the later unit; with use_orig_params=True it skips it there, as the plan does.
    assert torch_groups["head"] == (set() if use_orig_params else {"head.weight"})


@pytest.mark.parametrize("case", sorted(ZOO))
def test_zoo_reference_machinery_matches_torch_fsdp1(case):
    make_model, make_policy, pick_ignored, with_mp = ZOO[case]
    mp = MixedPrecision(param_dtype=torch.float16) if with_mp else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_model = make_model()
        ignored = pick_ignored(torch_model) if pick_ignored else []
        units = torch_fsdp1_units(torch_model, make_policy(TW), ignored, mp, True)

        ref_model = make_model()
        ignored = pick_ignored(ref_model) if pick_ignored else []
        ignored_modules = {m for top in ignored for m in top.modules()}
        ignored_params = {p for m in ignored_modules for p in m.parameters()}
        root_kwargs = {"mixed_precision": mp, "use_orig_params": True}
        wu._auto_wrap(ref_model, make_policy(W), ignored_modules, ignored_params, root_kwargs, Unit)

        plan_model = make_model()
        ignored = pick_ignored(plan_model) if pick_ignored else []
        plan = build_wrap_plan(
            plan_model,
            make_policy(W),
            ignored_modules=ignored,
            root_kwargs={"mixed_precision": mp, "use_orig_params": True},
        )
    ref_units = {"": None}
    for name, module in ref_model.named_modules():
        if isinstance(module, Unit):
            ref_units[".".join(p for p in name.split(".") if p != "module")] = module
    assert set(ref_units) == set(units)
    assert set(plan.module_fqns) == set(units)
    assert torch_param_groups(units) == {e.module_fqn: set(e.param_fqns) for e in plan.entries}
    # Spec W3/W4/W5: these leave everything in the root's unit; every other case splits.
    root_only = {"custom-force-leaf", "modulelist-small", "nested-size40-ignored"}
    assert (len(units) == 1) == (case in root_only)
    for fqn, unit in ref_units.items():
        if fqn:
            assert units[fqn].mixed_precision == (
                unit.kwargs["mixed_precision"] or MixedPrecision()
            )


# --- W6 with real FSDP objects (one gloo rank) ---------------------------------------------------


def _nested_fsdp_body(rank, world_size):
    """Apply each real FSDP flavour to ``lin1.1`` and ask the reference to auto-wrap around it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import reference

    mesh = init_device_mesh("cpu", (world_size,))
    appliers = {
        "torch-fsdp1": lambda m: FSDP(m, device_id=CPU),
        "torch-fsdp2": lambda m: torch_fully_shard(m, mesh=mesh),
        "reference-fsdp1": lambda m: reference.FullyShardedDataParallel(m, device_id=CPU),
        "reference-fsdp2": lambda m: reference.fully_shard(m, mesh=mesh),
    }
    outcome = {}
    for flavour, apply in appliers.items():
        root = nn.Module()
        root.lin1 = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root.lin1[1] = apply(root.lin1[1])
        try:
            build_wrap_plan(root, W.always_wrap_policy)
            outcome[flavour] = "no error"
        except ValueError as e:
            outcome[flavour] = str(e).split("\n")[0]
    return outcome


def test_nested_wrapping_detects_every_fsdp_flavour():
    from tests._spawn import run_on_ranks

    (outcome,) = run_on_ranks(_nested_fsdp_body, 1)
    want = (
        "FSDP auto wrapping requires modules to not already have FSDP applied but found lin1.1 in"
    )
    assert outcome == dict.fromkeys(
        ["torch-fsdp1", "torch-fsdp2", "reference-fsdp1", "reference-fsdp2"], want
    )


# --- W10: upstream's CustomPolicy expectations through torch FSDP1 (world of two) ----------------


class TransformerWithBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = _transformer()
        self.bn = nn.BatchNorm1d(8)


@pytest.mark.parametrize("uniform", [True, False])
def test_custom_policy_kwargs_match_torch_fsdp1(uniform):
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

    def lambda_fn(module):
        if isinstance(module, nn.BatchNorm1d):
            return True if uniform else {"sharding_strategy": ShardingStrategy.NO_SHARD}
        if isinstance(module, nn.TransformerEncoderLayer):
            return True
        if isinstance(module, nn.TransformerDecoderLayer):
            return (
                True
                if uniform
                else {
                    "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP,
                    "backward_prefetch": BackwardPrefetch.BACKWARD_POST,
                }
            )
        return False

    mp = MixedPrecision(param_dtype=torch.float16)
    root_kwargs = {
        "sharding_strategy": ShardingStrategy.FULL_SHARD,
        "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
        "mixed_precision": mp,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = build_wrap_plan(
            TransformerWithBN(), W.CustomPolicy(lambda_fn), root_kwargs=root_kwargs
        )
        fsdp = FSDP(
            TransformerWithBN(),
            process_group=DummyProcessGroup(0, 2),
            auto_wrap_policy=TW.CustomPolicy(lambda_fn),
            device_id=CPU,
            **root_kwargs,
        )
    units = {clean(n): m for n, m in fsdp.named_modules() if isinstance(m, FSDP)}
    layers = [f"transformer.encoder.layers.{i}" for i in range(2)]
    layers += [f"transformer.decoder.layers.{i}" for i in range(2)]
    assert set(plan.module_fqns) == set(units) == {"", "bn", *layers}
    for fqn, kwargs in plan.targets:
        unit = units[fqn]
        want_strategy = kwargs["sharding_strategy"]
        assert unit.sharding_strategy == want_strategy
        assert unit.backward_prefetch == kwargs["backward_prefetch"]
        assert unit.mixed_precision == (kwargs["mixed_precision"] or MixedPrecision())
        # upstream's expectations, written out (spec W10)
        if fqn == "bn":
            assert unit.mixed_precision == MixedPrecision()
            want = ShardingStrategy.FULL_SHARD if uniform else ShardingStrategy.NO_SHARD
            assert want_strategy == want
        elif "decoder" in fqn and not uniform:
            assert want_strategy == ShardingStrategy.SHARD_GRAD_OP
            assert kwargs["backward_prefetch"] == BackwardPrefetch.BACKWARD_POST
        else:
            assert want_strategy == ShardingStrategy.FULL_SHARD
            assert kwargs["backward_prefetch"] == BackwardPrefetch.BACKWARD_PRE
            assert unit.mixed_precision == mp


# --- FSDP1's constructor uses the same ignored-state normalisation ----------------------------


def _fsdp1_ignored_states_outcomes(rank, world_size):
    """Each case built with the reference's and torch's FSDP1: ``(error type, message)`` or
    ``("ok", the ignored parameter FQNs, the "top-level module" warnings)``."""
    import reference

    def build(fsdp_cls, case):
        torch.manual_seed(0)
        model = nested_sequential()
        kwargs = {"device_id": CPU} if fsdp_cls is FSDP else {}
        args = {
            "modules-with-an-int": {"ignored_modules": [model[0], 1]},
            "states-mixed": {"ignored_states": [model[0].weight, model[1]]},
            "states-plain-tensor": {"ignored_states": [torch.ones(1)]},
            "states-modules": {"ignored_states": [model[2]]},
            "states-params": {"ignored_states": [model[0].weight, model[2][1].bias]},
            "modules-root": {"ignored_modules": [model]},
        }.get(case)
        if case == "modules-fsdp-child":
            model[2] = fsdp_cls(model[2], **kwargs)
            args = {"ignored_modules": [model[2]]}
        fsdp = fsdp_cls(model, **args, **kwargs)
        names = {p: n for n, p in model.named_parameters()}
        return sorted(names[p] for p in fsdp._ignored_params if p in names)

    outcomes = {}
    cases = ("modules-with-an-int", "states-mixed", "states-plain-tensor", "states-modules")
    cases += ("states-params", "modules-root", "modules-fsdp-child")
    for case in cases:
        for name, fsdp_cls in (("reference", reference.FullyShardedDataParallel), ("torch", FSDP)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    ignored = build(fsdp_cls, case)
                except Exception as e:  # noqa: BLE001 - the outcome under test
                    outcomes[case, name] = (type(e).__name__, str(e))
                    continue
            top = [str(w.message)[:60] for w in caught if "top-level module" in str(w.message)]
            outcomes[case, name] = ("ok", ignored, top)
    return outcomes


def test_fsdp1_ignored_states_as_torch():
    from tests._spawn import run_on_ranks

    (outcomes,) = run_on_ranks(_fsdp1_ignored_states_outcomes, 1)
    cases = sorted({case for case, _ in outcomes})
    assert len(cases) == 7
    for case in cases:
        assert outcomes[case, "reference"] == outcomes[case, "torch"], case
    # the cases cover errors, warnings and successes (so the comparison above is not vacuous)
    kinds = {case: outcomes[case, "torch"][0] for case in cases}
    assert kinds["modules-with-an-int"] == kinds["states-mixed"] == "ValueError"
    assert kinds["modules-fsdp-child"] == "ValueError"
    assert outcomes["states-modules", "torch"][1] == [
        "2.0.bias",
        "2.0.weight",
        "2.1.bias",
        "2.1.weight",
    ]
    assert outcomes["modules-root", "torch"][2], "torch warns when the root itself is ignored"
