"""Harness code of the wrap area: ``plan_entries`` and the expectation helpers of
``conformance/checks/wrap/_cases.py`` (the plan logic itself is tested in tests/reference)."""

from __future__ import annotations

from types import MappingProxyType

from torch import nn

from conformance.adapters.base import plan_entries
from conformance.checks.wrap import _cases as wrap
from conformance.checks.wrap import _models as zoo


class _Entry:  # shaped like reference.wrap._wrap_plan.WrapPlanEntry
    def __init__(self, module_fqn, kwargs):
        self.module_fqn, self.kwargs, self.param_fqns = module_fqn, MappingProxyType(kwargs), ()


class _Plan:
    def __init__(self, entries):
        self.entries = tuple(entries)


def test_plan_entries_accepts_none_pairs_and_plan_objects():
    assert plan_entries(None) == [("", {})]
    pairs = [("a", {"x": 1}), ("", {})]
    got = plan_entries(pairs)
    assert got == pairs and got[0][1] is not pairs[0][1]  # fresh dicts
    plan = _Plan([_Entry("a.b", {"k": 2}), _Entry("", {})])
    assert plan_entries(plan) == [("a.b", {"k": 2}), ("", {})]
    assert isinstance(plan_entries(plan)[0][1], dict)


def test_expected_groups_deepest_unit_and_ignored():
    model = zoo.nested_sequential()
    groups, ignored = wrap.expected_groups(model, ("2.1", "2", ""), set(model[1].parameters()))
    assert groups == {
        "2.1": {"2.1.weight", "2.1.bias"},
        "2": {"2.0.weight", "2.0.bias"},
        "": {"0.weight", "0.bias"},
    }
    assert ignored == {"1.weight", "1.bias"}
    # a prefix that is not a module boundary ("2" vs "21") does not capture
    seq = nn.Sequential(*[nn.Linear(1, 1, bias=False) for _ in range(22)])
    groups, _ = wrap.expected_groups(seq, ("2", ""), set())
    assert groups["2"] == {"2.weight"} and "21.weight" in groups[""]


def test_expected_groups_tied_parameter_counted_once():
    model = zoo.SharedParamsTransformer()
    groups, _ = wrap.expected_groups(model, ("",), set())
    assert "embed.weight" in groups[""] and "head.weight" not in groups[""]


def test_zoo_cases_are_well_formed():
    for name, case in wrap.ZOO.items():
        model = zoo.make_model(case.model)
        modules = dict(model.named_modules())
        assert case.units[-1] == "" and case.units.count("") == 1, name
        assert all(u in modules for u in case.units), name
        assert set(case.mp_off) <= set(case.units) and set(case.overrides) <= set(case.units), name
        assert all(m in modules for m in case.ignored_modules), name


def test_expected_kwargs_rule():
    case = wrap.ZOO["transformer-custom-mp"]
    root = {"mixed_precision": "MP", "use_orig_params": False}
    assert wrap.expected_kwargs(case, "", root, None) == root
    assert wrap.expected_kwargs(case, "bn", root, None) == {
        "mixed_precision": None,
        "use_orig_params": False,
        "auto_wrap_policy": None,
        "sharding_strategy": "NO_SHARD",
    }
    callable_case = wrap.ZOO["norm-mp-never"]
    assert wrap.expected_kwargs(callable_case, "bn", root, None) == {
        "mixed_precision": None,
        "use_orig_params": False,
    }
