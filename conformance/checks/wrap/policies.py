"""Area "wrap", the policies themselves: what each auto-wrap policy callable answers to the recurse
and wrap questions, and how ``_or_policy`` and the per-class helper combine them (W1, W8, W9),
and the abstract base of the one-pass policies (W23).

These call the policies directly, without building any FSDP module; what FSDP1 builds from them is
in ``auto_wrap.py``.
"""

from __future__ import annotations

import functools

from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks.wrap._helpers import wrap_api
from conformance.registry import check


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def policy_callables(ctx):
    """W1/W9: the callable policies answer the recurse and wrap questions directly:
    size-based(40) is False at 39 and True at 40 for both (without ``min_num_params`` the
    threshold is ``int(1e8)``: False at 99,999,999, True at 100,000,000), never recurses into a force leaf
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
        ("size_based()", W.size_based_auto_wrap_policy, lin, False, 10**8 - 1, False),
        ("size_based()", W.size_based_auto_wrap_policy, lin, False, 10**8, True),
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


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def or_policy_and_per_class_policy(ctx):
    """W8: ``_or_policy`` answers any(policy(module=, recurse=, nonwrapped_numel=)); the per-class
    helper ``_wrap_module_cls_individually`` answers True to recurse and isinstance to wrap."""
    or_policy = wrap_api(ctx, "_or_policy")
    individually = wrap_api(ctx, "_wrap_module_cls_individually")
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


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def policy_base_is_abstract(ctx):
    """W23: ``_Policy``, the base of the one-pass policies (``ModuleWrapPolicy``,
    ``CustomPolicy``), is abstract in ``_run_policy``: instantiating it, or a subclass that does
    not define ``_run_policy``, raises TypeError; a subclass that defines it instantiates."""
    policy_cls = wrap_api(ctx, "_Policy")

    class Partial(policy_cls):
        """Defines nothing: ``_run_policy`` is still abstract."""

    class Complete(policy_cls):
        def _run_policy(self, root_module, ignored_modules, root_kwargs):
            return {}

    for cls in (policy_cls, Partial):
        expect_error(ctx, f"{cls.__name__}()", TypeError, "abstract", cls)
    assert isinstance(Complete(), policy_cls), f"{ctx.where()} a complete _Policy subclass"
