"""Unit tests for the reference auto-wrap policies and machinery (spec §4 W1-W16).

Expected structures are written out from the spec, never read off the implementation. Most tests
use a stand-in wrapper class (``Unit``) so they run without a process group; a few check against
torch's FSDP1 with a dummy process group.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings

import pytest
import torch
from torch import nn

from reference import wrap as W
from reference.wrap import _wrap_utils as wu
from reference.wrap._wrap_plan import FullyShardedModuleState, _get_fully_sharded_module_to_states


class Unit(nn.Module):
    """Stand-in for FSDP: becomes the parent of the wrapped module and records the kwargs."""

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__()
        self.module = module
        self.kwargs = kwargs


def unit_names(root: nn.Module) -> list[str]:
    """FQNs (in the unwrapped model's naming) of every ``Unit`` in ``root``'s tree."""
    names = []
    for name, module in root.named_modules():
        if isinstance(module, Unit):
            parts = [p for p in name.split(".") if p and p != "module"]
            names.append(".".join(parts))
    return names


def nested_sequential() -> nn.Sequential:
    """Spec's NestedSequentialModel: 4 x Linear(5, 5) = 4 x 30 numel = 120."""
    return nn.Sequential(
        nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    )


def size_policy(min_num_params, **kw):
    return functools.partial(W.size_based_auto_wrap_policy, min_num_params=min_num_params, **kw)


def auto_wrap(root, policy, *, ignored=(), **root_kwargs):
    """Drive ``_auto_wrap`` like FSDP1's constructor (children only; the root is the caller's)."""
    ignored_modules = {m for top in ignored for m in top.modules()}
    ignored_params = {p for m in ignored_modules for p in m.parameters()}
    root_kwargs.setdefault("mixed_precision", None)
    wu._auto_wrap(root, policy, ignored_modules, ignored_params, root_kwargs, Unit)
    return root


# --- W1 ------------------------------------------------------------------------------------


def test_w1_size_based_thresholds_and_defaults():
    lin = nn.Linear(1, 1)
    policy = size_policy(40)
    assert policy(module=lin, recurse=True, nonwrapped_numel=39) is False
    assert policy(module=lin, recurse=True, nonwrapped_numel=40) is True
    assert policy(module=lin, recurse=False, nonwrapped_numel=39) is False
    assert policy(module=lin, recurse=False, nonwrapped_numel=40) is True
    sig = inspect.signature(W.size_based_auto_wrap_policy)
    assert sig.parameters["min_num_params"].default == 100_000_000
    assert isinstance(sig.parameters["min_num_params"].default, int)
    assert {nn.ModuleList, nn.ModuleDict} == W.size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
    assert {nn.MultiheadAttention} == W.size_based_auto_wrap_policy.FORCE_LEAF_MODULES
    # Defaults apply: a big MHA is not entered; a big ModuleList is not wrapped.
    mha, mlist = nn.MultiheadAttention(4, 1), nn.ModuleList()
    assert policy(module=mha, recurse=True, nonwrapped_numel=10**9) is False
    assert policy(module=mha, recurse=False, nonwrapped_numel=10**9) is True
    assert policy(module=mlist, recurse=True, nonwrapped_numel=10**9) is True
    assert policy(module=mlist, recurse=False, nonwrapped_numel=10**9) is False
    # Explicit empty sets replace the defaults.
    empty = size_policy(40, force_leaf_modules=set(), exclude_wrap_modules=set())
    assert empty(module=mha, recurse=True, nonwrapped_numel=40) is True
    assert empty(module=mlist, recurse=False, nonwrapped_numel=40) is True


def test_public_names():
    assert set(W.__all__) == {
        "always_wrap_policy",
        "lambda_auto_wrap_policy",
        "transformer_auto_wrap_policy",
        "size_based_auto_wrap_policy",
        "enable_wrap",
        "wrap",
        "CustomPolicy",
        "ModuleWrapPolicy",
    }
    for name in ("_post_order_apply", "_construct_wrap_fn", "_run_mixed_precision_override_policy"):
        assert getattr(W, name) is getattr(wu, name)
    from reference.wrap import _wrap_plan

    for name in ("build_wrap_plan", "WrapPlan", "WrapPlanEntry"):
        assert getattr(W, name) is getattr(_wrap_plan, name)
    with pytest.raises(AttributeError):
        W.no_such_name  # noqa: B018


# --- W2 / W14 ------------------------------------------------------------------------------


def test_w2_size_based_nested_sequential():
    assert unit_names(auto_wrap(nested_sequential(), size_policy(40))) == ["2"]


def test_w2_always_wrap():
    assert unit_names(auto_wrap(nested_sequential(), W.always_wrap_policy)) == [
        "0",
        "1",
        "2",
        "2.0",
        "2.1",
    ]


def test_w2_size_zero_wraps_everything_and_kwargs_are_inherited():
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.nested_lin = nn.Linear(1, 1, bias=False)

    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin1, self.lin2, self.lin3 = (nn.Linear(1, 1, bias=False) for _ in range(3))
            self.lin4 = Nested()

    kw = {"cpu_offload": "co", "backward_prefetch": "bp", "forward_prefetch": True}
    model = auto_wrap(MyModel(), size_policy(0), **kw)
    assert sorted(unit_names(model)) == sorted(["lin1", "lin2", "lin3", "lin4.nested_lin", "lin4"])
    for m in model.modules():
        if isinstance(m, Unit):
            assert {k: m.kwargs[k] for k in kw} == kw


def test_w14_recursive_wrap_returns_wrapped_numel():
    model = nested_sequential()
    out, numel = W._recursive_wrap(model, size_policy(40), Unit, set(), set())
    assert numel == 120  # inner Seq (60) + the root's remainder (60) == everything
    assert isinstance(out, Unit) and unit_names(out) == ["", "2"]

    model = nested_sequential()
    out, numel = W._recursive_wrap(model, size_policy(40), Unit, set(), set(), True)
    assert out is model and numel == 60 and unit_names(model) == ["2"]

    small = nested_sequential()
    assert W._recursive_wrap(small, size_policy(121), Unit, set(), set()) == (small, 0)


def test_w14_already_wrapped_child_asserts_and_leaves_model():
    model = nested_sequential()
    model[2][1] = Unit(model[2][1])
    before = list(model.named_modules())
    with pytest.raises(AssertionError, match=r"(?s)Child module .* is already wrapped by"):
        W._recursive_wrap(model, W.always_wrap_policy, Unit, set(), set())
    assert list(model.named_modules()) == before
    # A factory function cannot be checked by isinstance: no error.
    W._recursive_wrap(nested_sequential(), W.always_wrap_policy, lambda m, **k: m, set(), set())


# --- W3 / W4 / W5 --------------------------------------------------------------------------


def test_w3_exclude_wrap_module_list():
    m = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)])  # 60 in total, 30 each
    assert unit_names(auto_wrap(m, size_policy(40))) == []
    assert W._recursive_wrap(m, size_policy(40), Unit, set(), set())[1] == 0  # list not wrapped
    m = nn.ModuleList([nn.Linear(10, 10)])  # 110
    assert unit_names(auto_wrap(m, size_policy(40))) == ["0"]


def test_w4_force_leaf_modules():
    m = nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1))
    # A force-leaf module is never entered, and a subtree that is not entered is not wrapped
    # either: the MHA (and its out_proj) stay inside the root's unit.
    assert unit_names(auto_wrap(m, size_policy(40))) == ["0"]

    m = nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)]))
    leaf = W.size_based_auto_wrap_policy.FORCE_LEAF_MODULES | {nn.Linear}
    assert unit_names(auto_wrap(m, size_policy(40, force_leaf_modules=leaf))) == []


@pytest.mark.parametrize("how", ["auto_wrap", "enable_wrap"])
def test_w5_ignored_modules_always_wrap(how):
    model = nested_sequential()
    ignored = [model[1], model[2][0]]
    if how == "auto_wrap":
        auto_wrap(model, W.always_wrap_policy, ignored=ignored)
    else:
        ignored_modules = {m for top in ignored for m in top.modules()}
        with W.enable_wrap(wrapper_cls=Unit):
            W._recursive_wrap(model, W.always_wrap_policy, W.wrap, ignored_modules, set(), True)
    assert unit_names(model) == ["0", "2", "2.1"]


def test_w5_ignored_numel_is_not_counted():
    model = nested_sequential()
    auto_wrap(model, size_policy(40), ignored=[model[1], model[2][0]])
    assert unit_names(model) == []  # module[2] has 30 counted numel < 40


# --- W6 ------------------------------------------------------------------------------------


def _flat_and_nested():
    flat = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    flat.lin1 = nn.Linear(2, 2)
    nested = nn.Module()
    nested.lin1 = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    return flat, "lin1", nested, "lin1.1"


def test_w6_nested_wrapping_detection_paths():
    """W6 recognises FSDP by class name (FSDP1's wrapper, FSDP2's ``FSDPModule``), whichever
    implementation built the module: torch's, this package's, or another one named as upstream."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from reference import FSDPModule as RefFSDPModule

    def class_swapped(fsdp_module_cls):
        def fully_shard_like():
            lin = nn.Linear(2, 2)
            # fully_shard swaps the class the same way: FSDP<Name>(FSDPModule, Name)
            lin.__class__ = type("FSDPLinear", (fsdp_module_cls, nn.Linear), {})
            return lin

        return fully_shard_like

    class FullyShardedDataParallel(nn.Module):  # another implementation's FSDP1 wrapper
        pass

    class MyFsdp1(FullyShardedDataParallel):  # recognised through its base class
        pass

    makers = (class_swapped(TorchFSDPModule), class_swapped(RefFSDPModule), MyFsdp1)
    for make in makers:
        flat, flat_name, nested, nested_name = _flat_and_nested()
        setattr(flat, flat_name, make())
        nested.lin1[1] = make()
        for root, name in ((flat, flat_name), (nested, nested_name)):
            before = list(root.named_modules())
            msg = (
                "FSDP auto wrapping requires modules to not already have FSDP applied but found "
                f"{name} in\n{root}"
            )
            with pytest.raises(ValueError, match=re.escape(msg)):
                auto_wrap(root, W.always_wrap_policy)
            assert list(root.named_modules()) == before

    class Marked(nn.Module):  # any other name: not FSDP
        pass

    wu._check_nested_wrapping(nn.Sequential(nn.Linear(1, 1), Marked()))
    wu._check_nested_wrapping(nested_sequential())  # nothing applied: no error


def test_w6_torch_fsdp1_child(dummy_pg):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    nested = nn.Module()
    nested.lin1 = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    nested.lin1[1] = FSDP(nested.lin1[1], process_group=dummy_pg, device_id=torch.device("cpu"))
    with pytest.raises(
        ValueError, match=re.escape("already have FSDP applied but found lin1.1 in\n")
    ):
        auto_wrap(nested, W.always_wrap_policy)


# --- W7 ------------------------------------------------------------------------------------


def test_w7_wrap_outside_context_is_identity():
    lin = nn.Linear(2, 2)
    assert W.wrap(lin) is lin
    assert W.wrap(lin, sharding_strategy="x") is lin


def test_w7_enable_wrap_kwargs_overrides_and_nesting():
    with W.enable_wrap(wrapper_cls=Unit, a=1, b=2):
        out = W.wrap(nn.Linear(2, 2), b=3, c=4)
        assert isinstance(out, Unit) and out.kwargs == {"a": 1, "b": 3, "c": 4}
        lin = nn.Linear(2, 2)
        lin._wrap_overrides = {"a": "module wins", "c": "module wins"}
        assert W.wrap(lin, c=5).kwargs == {"a": "module wins", "b": 2, "c": "module wins"}
        msg = (
            "You are already within an autowrap context and we currently do not supported nested "
            "autowrap."
        )
        with pytest.raises(NotImplementedError, match=re.escape(msg)):  # noqa: SIM117 (the inner context must fail on entry)
            with W.enable_wrap(wrapper_cls=Unit):
                pass
        assert isinstance(W.wrap(nn.Linear(1, 1)), Unit)  # the outer context is still active
    assert isinstance(W.wrap(nn.Linear(1, 1)), nn.Linear)  # and closed after the block


def test_w7_wrap_in_init_outside_context_stays_plain():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = W.wrap(nn.Linear(2, 2))

    model = Model()
    with W.enable_wrap(wrapper_cls=Unit):
        outer = W.wrap(model)
    assert isinstance(outer, Unit) and type(outer.module.lin) is nn.Linear


def test_w7_torch_fsdp1_through_enable_wrap(dummy_pg_factory):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    pg1, pg2 = dummy_pg_factory(0, 1), dummy_pg_factory(0, 2)
    with W.enable_wrap(wrapper_cls=FSDP, process_group=pg1, device_id=torch.device("cpu")):
        layer = W.wrap(nn.Linear(5, 5), process_group=pg2)
    assert isinstance(layer, FSDP)
    assert layer.process_group is pg2 and layer.rank == 0 and layer.world_size == 2


# --- W8 / W9 -------------------------------------------------------------------------------


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)
        self.bn1, self.bn2, self.bn3 = nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2)
        self.sync_bn = nn.SyncBatchNorm(2)


def bn_individually(classes=(nn.modules.batchnorm._BatchNorm,)):
    return functools.partial(W._wrap_module_cls_individually, module_classes=classes)


def never(*args, **kwargs):
    return False


@pytest.mark.parametrize("use_or", [False, True])
def test_w8_batchnorm_individually(use_or):
    policy = bn_individually()
    if use_or:
        policy = functools.partial(W._or_policy, policies=[never, policy])
    model = auto_wrap(BatchNormNet(), policy)
    assert sorted(unit_names(model)) == ["bn1", "bn2", "bn3", "sync_bn"]


def test_w8_or_with_container_policy():
    class MyModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn_container = BatchNormNet()

    container = functools.partial(
        W.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, BatchNormNet)
    )
    or_policy = functools.partial(W._or_policy, policies=[container, bn_individually()])
    model = auto_wrap(MyModule(), or_policy)
    assert sorted(unit_names(model)) == sorted(
        [
            "bn_container",
            "bn_container.bn1",
            "bn_container.bn2",
            "bn_container.bn3",
            "bn_container.sync_bn",
        ]
    )
    assert unit_names(auto_wrap(MyModule(), container)) == ["bn_container"]
    assert W._or_policy(nn.Linear(1, 1), False, 0, [never, never]) is False


def test_w8_individually_and_module_policy_answers():
    lin, bn = nn.Linear(1, 1), nn.BatchNorm1d(1)
    assert W._wrap_module_cls_individually(lin, (nn.BatchNorm1d,), recurse=True) is True
    assert W._wrap_module_cls_individually(lin, (nn.BatchNorm1d,), recurse=False) is False
    assert W._wrap_module_cls_individually(bn, (nn.BatchNorm1d,), recurse=False) is True
    policy = W.ModuleWrapPolicy([nn.Linear, nn.Linear])
    assert policy(bn, True) is True and policy(bn, False) is False and policy(lin, False) is True
    assert repr(policy).endswith(f"({ {nn.Linear} })")
    assert policy._module_classes == {nn.Linear}


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(3, 3)


class Toy(nn.Module):
    """Embedding tied to the output head, three layers in a ModuleList."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.layers = nn.ModuleList([Layer() for _ in range(3)])
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.emb.weight


def test_w9_transformer_module_and_callable_policies_agree():
    expected = ["layers.0", "layers.1", "layers.2"]
    policies = [
        functools.partial(W.transformer_auto_wrap_policy, transformer_layer_cls={Layer}),
        W.ModuleWrapPolicy({Layer}),
        functools.partial(W._or_policy, policies=[W.ModuleWrapPolicy({Layer}), never]),
    ]
    for policy in policies:
        assert unit_names(auto_wrap(Toy(), policy)) == expected
    lam = functools.partial(
        W.lambda_auto_wrap_policy, lambda_fn=lambda m: m is not None and isinstance(m, nn.Embedding)
    )
    assert unit_names(auto_wrap(Toy(), lam)) == ["emb"]


# --- W10 -----------------------------------------------------------------------------------


def test_w10_custom_policy_answers():
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1))
    answers = {model[0]: False, model[1]: {}, model[2]: True, model[3]: {"b": "over", "c": 3}}
    policy = W.CustomPolicy(lambda m: answers.get(m, False))
    root_kwargs = {"a": 1, "b": 2}
    targets = policy._run_policy(model, set(), root_kwargs)
    assert targets == {model[2]: {"a": 1, "b": 2}, model[3]: {"a": 1, "b": "over", "c": 3}}
    assert targets[model[2]] is not root_kwargs  # shallow copies: no coupling
    targets[model[2]]["a"] = 99
    assert root_kwargs == {"a": 1, "b": 2} and targets[model[3]]["a"] == 1
    assert policy._run_policy(model, {model[2]}, root_kwargs).keys() == {model[3]}


@pytest.mark.parametrize("bad", [1, None, "yes", [True]])
def test_w10_custom_policy_bad_answer(bad):
    model = nested_sequential()
    before = list(model.named_modules())
    msg = (
        "The lambda_fn passed to CustomPolicy should return False/True or a kwarg dict, but it "
        f"returned {bad}"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        auto_wrap(model, W.CustomPolicy(lambda m: bad))
    assert list(model.named_modules()) == before


def test_w10_policy_path_sets_auto_wrap_policy_none():
    model = auto_wrap(nested_sequential(), W.CustomPolicy(lambda m: isinstance(m, nn.Linear)), x=1)
    units = [m for m in model.modules() if isinstance(m, Unit)]
    assert len(units) == 4
    assert all(
        u.kwargs == {"x": 1, "mixed_precision": None, "auto_wrap_policy": None} for u in units
    )
    # A non-class fsdp_fn gets the key "policy" instead.
    seen = []
    root_kwargs = {"mixed_precision": None}
    wu._auto_wrap(
        nested_sequential(),
        W.ModuleWrapPolicy({nn.Linear}),
        set(),
        set(),
        root_kwargs,
        lambda m, **kw: seen.append(kw),
    )
    assert seen == [{"mixed_precision": None, "policy": None}] * 4


# --- W11 -----------------------------------------------------------------------------------

BN_WARNING = (
    "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped "
    "module has submodules of type:\n{classes}\n"
    "These modules will be wrapped as separate FSDP instacnes with mixed precision disabled."
)


class MP:
    """Duck-typed FSDP1 MixedPrecision: only the attribute the wrap machinery reads."""

    def __init__(self, classes=(nn.modules.batchnorm._BatchNorm,)):
        self._module_classes_to_ignore = classes


def bn_model():
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm1d(3)))


@pytest.mark.parametrize(
    "policy", [never, W.ModuleWrapPolicy({nn.Linear}), W.CustomPolicy(lambda m: False)]
)
def test_w11_batchnorm_split_out_with_mp_disabled(policy):
    mp = MP()
    model = bn_model()
    with pytest.warns(UserWarning) as record:
        auto_wrap(model, policy, mixed_precision=mp)
    messages = [str(w.message) for w in record]
    assert BN_WARNING.format(classes={nn.BatchNorm1d}) in messages
    units = {
        name: m
        for name, m in zip(unit_names(model), (m for m in model.modules() if isinstance(m, Unit)))
    }
    bn_units = {n for n, u in units.items() if isinstance(u.module, nn.BatchNorm1d)}
    assert bn_units == {"1", "2.0"}
    for name, unit in units.items():
        expected_mp = None if name in bn_units else mp
        assert unit.kwargs["mixed_precision"] is expected_mp
    assert units["1"].module._wrap_overrides == {"mixed_precision": None}


def test_w11_no_mixed_precision_no_override_and_custom_classes():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = auto_wrap(bn_model(), never)  # mixed_precision=None: nothing split, no warning
    assert unit_names(model) == []
    assert not hasattr(model[1], "_wrap_overrides")
    with pytest.warns(UserWarning, match=re.escape(f"submodules of type:\n{ {nn.Linear} }\n")):
        model = auto_wrap(bn_model(), never, mixed_precision=MP((nn.Linear,)))
    assert unit_names(model) == ["0"]


def test_w11_cast_hooks_run_in_fp32_and_restore_dtype():
    bn = nn.BatchNorm1d(3)
    seen = []
    bn.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    found = wu._override_module_mixed_precision(nn.Sequential(bn), (nn.BatchNorm1d,))
    assert found == {nn.BatchNorm1d}
    out = bn(torch.randn(4, 3, dtype=torch.float16))
    assert seen == [torch.float16]  # user hooks registered earlier run first, before the cast
    assert out.dtype == torch.float16
    out32 = bn(torch.randn(4, 3))
    assert out32.dtype == torch.float32
    inner = []
    bn2 = nn.BatchNorm1d(3)
    wu._override_module_mixed_precision(bn2, (nn.BatchNorm1d,))
    bn2.register_forward_pre_hook(lambda m, args: inner.append(args[0].dtype))  # runs after cast
    assert bn2(torch.randn(2, 3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert inner == [torch.float32]
    ints = torch.ones(2, 3, dtype=torch.int64)
    assert wu._cast_inputs_to_fp32(bn2, (ints,))[0] is ints  # non-floating left alone


# --- W12 -----------------------------------------------------------------------------------


class LoraAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 4, bias=False)
        self.lora_A = nn.Linear(4, 2, bias=False)
        self.lora_B = nn.Linear(2, 4, bias=False)


class LoraLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = LoraAttn()


class LoraModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([LoraLayer(), LoraLayer()])
        for name, p in self.named_parameters():
            p.requires_grad_("lora_A" in name)
        self.layers[0].attn.lora_B.weight.requires_grad_(False)


def test_w12_frozen_params_message_error_and_warning():
    head = "layers.0.attn has both parameters with requires_grad=True and False."
    tail = (
        "If possible, wrap the frozen parameters with FSDP separately.\n"
        "The following parameters have requires_grad=True:\n['layers.0.attn.lora_A.weight']\n"
        "The following parameters have requires_grad=False:\n"
        "['layers.0.attn.q_proj.weight', 'layers.0.attn.lora_B.weight']"
    )
    policy = W.ModuleWrapPolicy({LoraAttn})
    model = LoraModel()
    before = list(model.named_modules())
    err = head + " FSDP does not support wrapping such modules when use_orig_params=False. " + tail
    with pytest.raises(ValueError) as info:
        auto_wrap(model, policy, use_orig_params=False)
    assert str(info.value) == err
    assert list(model.named_modules()) == before
    # total = 16 + 8 + 8 = 32 numel; trainable = lora_A = 8
    warn = (
        head + " We do not recommend wrapping such modules since the gradient memory usage will "
        "be higher than expected (32 numel instead of 8 numel before sharding via "
        "reduce-scatter). " + tail
    )
    with pytest.warns(UserWarning) as record:
        auto_wrap(LoraModel(), policy, use_orig_params=True)
    texts = [str(w.message) for w in record]
    assert warn in texts
    assert sum("layers.1.attn has both" in t for t in texts) == 1  # every violator warns


def test_w12_uniform_units_and_ignored_params_pass():
    def lora_apart(m):
        return isinstance(m, (LoraAttn, nn.Linear)) and (
            not isinstance(m, nn.Linear) or m.weight.requires_grad
        )

    auto_wrap(LoraModel(), W.CustomPolicy(lora_apart))  # the trainable Linear gets its own unit
    model = LoraModel()
    ignored = {model.layers[0].attn.lora_A.weight, model.layers[1].attn.lora_A.weight}
    wu._validate_frozen_params(model, set(model.modules()) - set(), ignored, False)
    with pytest.raises(ValueError, match="layers.0.attn has both"):
        wu._validate_frozen_params(model, {model.layers[0].attn, model}, set(), False)
    # The callable-policy path does not validate.
    auto_wrap(
        LoraModel(),
        functools.partial(W.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, LoraAttn)),
    )


def test_w12_post_order_named_modules():
    m = nn.Module()
    m.S1, m.S2, m.S3 = nn.Linear(1, 1), nn.Module(), nn.Linear(1, 1)
    m.S2.SS1, m.S2.SS2 = nn.Linear(1, 1), nn.Linear(1, 1)
    names = [n for n, _, _ in wu._managed_params(m, set(m.modules()), set())]
    assert names == ["S1", "S2.SS1", "S2.SS2", "S2", "S3", ""]


# --- W13 -----------------------------------------------------------------------------------


def test_w13_post_order_apply_order_and_sharing():
    model = nested_sequential()
    order = []
    wu._post_order_apply(model, lambda m: order.append(m))
    expected = [model[0], model[1], model[2][0], model[2][1], model[2], model]
    assert len(order) == 6 and all(a is b for a, b in zip(order, expected))
    shared = nn.Linear(1, 1)
    root = nn.Sequential(shared, nn.Sequential(shared))
    order = []
    wu._post_order_apply(root, lambda m: order.append(m))
    assert len(order) == 3 and order[0] is shared


def test_w13_replacement_and_errors():
    model = nested_sequential()
    wu._post_order_apply(model, lambda m: Unit(m) if m is model[2][1] else None)
    assert isinstance(model[2][1], Unit)
    model = nested_sequential()
    with pytest.raises(
        AssertionError,
        match="Non-root modules should have their parent module set but got None for",
    ):
        wu._post_order_apply(model, lambda m: Unit(m) if m is model else None)
    with pytest.raises(AssertionError, match="fn should return None or an nn.Module but got 5"):
        wu._post_order_apply(model, lambda m: 5)
    fn = wu._construct_wrap_fn(model, {model: {}, model[0]: {"k": 1}}, Unit)
    assert fn(model) is None and fn(model[1]) is None and fn(model[0]).kwargs == {"k": 1}


# --- W16 -----------------------------------------------------------------------------------


class StatesModel(nn.Module):
    def __init__(self, share: str):
        super().__init__()
        self.seq1 = nn.Sequential(nn.Linear(5, 5, bias=False), nn.Linear(5, 5, bias=False))
        self.seq1.register_buffer("seq1_buffer", torch.randn(5))
        self.lin = nn.Linear(5, 5, bias=False)
        self.seq2 = nn.Sequential(
            nn.Sequential(nn.Linear(5, 5, bias=False)), nn.Linear(5, 5, bias=False)
        )
        if share == "parent_child":
            self.seq2[0][0].weight = self.lin.weight
        else:
            self.seq2[0][0].weight = self.seq1[0].weight
        self.seq2[1].register_buffer("seq2_1_buffer", torch.randn(5))


def _same(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@pytest.mark.parametrize("lca", [False, True])
def test_w16_parent_child_sharing(lca):
    m = StatesModel("parent_child")
    states = _get_fully_sharded_module_to_states(
        m, W.ModuleWrapPolicy({nn.Sequential}), set(), set(), assign_shared_params_to_lca=lca
    )
    assert list(states) == [m, m.seq1, m.seq2, m.seq2[0]]  # `.modules()` order
    assert _same(states[m].params, [m.lin.weight]) and states[m].buffers == []
    assert _same(states[m.seq1].params, [m.seq1[0].weight, m.seq1[1].weight])
    assert _same(states[m.seq1].buffers, [m.seq1.seq1_buffer])
    assert _same(states[m.seq2].params, [m.seq2[1].weight])
    assert _same(states[m.seq2].buffers, [m.seq2[1].seq2_1_buffer])
    assert states[m.seq2[0]] == FullyShardedModuleState([], [])


def test_w16_sibling_sharing_first_owner_and_lca():
    m = StatesModel("sibling")
    policy = W.ModuleWrapPolicy({nn.Sequential})
    first = _get_fully_sharded_module_to_states(m, policy, set(), set())
    assert _same(first[m].params, [m.lin.weight])
    assert _same(first[m.seq1].params, [m.seq1[0].weight, m.seq1[1].weight])
    lca = _get_fully_sharded_module_to_states(
        m, policy, set(), set(), assign_shared_params_to_lca=True
    )
    assert {id(p) for p in lca[m].params} == {id(m.lin.weight), id(m.seq1[0].weight)}
    assert _same(lca[m.seq1].params, [m.seq1[1].weight])
    assert _same(lca[m.seq2].params, [m.seq2[1].weight]) and lca[m.seq2[0]].params == []
    from reference.wrap._wrap_plan import _get_shared_param_to_lca_module

    mapping = _get_shared_param_to_lca_module(m, set())
    assert len(mapping) == 1 and mapping[m.seq1[0].weight] is m


def test_w16_shared_buffer_goes_to_the_first_unit():
    m = StatesModel("parent_child")
    m.seq2[1].register_buffer("alias", m.seq1.seq1_buffer)  # one buffer, two units' subtrees
    states = _get_fully_sharded_module_to_states(
        m, W.ModuleWrapPolicy({nn.Sequential}), set(), set()
    )
    # seq1 comes before seq2 in modules() order, so it takes the shared buffer
    assert _same(states[m.seq1].buffers, [m.seq1.seq1_buffer])
    assert _same(states[m.seq2].buffers, [m.seq2[1].seq2_1_buffer])


def test_w16_root_only_without_policy_and_ignored():
    m = StatesModel("parent_child")
    states = _get_fully_sharded_module_to_states(m, None, set(), {m.lin.weight})
    assert list(states) == [m]
    assert {id(p) for p in states[m].params} == {id(p) for p in m.parameters()} - {id(m.lin.weight)}


# --- fixtures ------------------------------------------------------------------------------


class DummyProcessGroup:
    """A process group that only answers rank()/size() (no communication is needed to build
    FSDP1 units on CPU without ``sync_module_states``)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.fixture
def dummy_pg_factory():
    return DummyProcessGroup


@pytest.fixture
def dummy_pg():
    return DummyProcessGroup(0, 1)
