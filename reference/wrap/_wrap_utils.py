"""Applying an auto-wrap policy to a model: the machinery behind FSDP's ``auto_wrap_policy``.

Mirrors ``torch.distributed.fsdp._wrap_utils`` (plus the helpers it borrows from ``wrap.py``,
``_common_utils.py`` and ``_init_utils.py``). Vocabulary: see ``[Note: auto-wrap vocabulary]``
in :mod:`reference.wrap`.

[Note: the order of events in _auto_wrap]
  1. Refuse a tree in which some module already has FSDP applied (W6).
  2. Decide the targets and their kwargs: a ``_Policy`` at once; a callable policy by running
     ``_recursive_wrap`` with a recording stand-in for the wrapper (the counts it compares are
     taken before any child is wrapped, so recording decides what wrapping during the walk would).
  3. With mixed precision set, every instance of ``_module_classes_to_ignore`` (batch norm by
     default) becomes a target with ``mixed_precision=None`` (W11).
  4. ``_Policy`` path only: check that each target's parameters are uniformly frozen (W12).
  5. Attach the fp32 cast hooks of step 3, then build the units children-first; the root is left
     to the caller.
  Steps 1-4 are :func:`_decide_targets`, shared with ``build_wrap_plan``: everything that can reject
  the input runs before the first change to the model, so a rejected call leaves the model as it
  was. (Upstream attaches the cast hooks before step 4 and wraps a callable policy's targets during
  its walk; the warnings keep upstream's order.)
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from reference.wrap._policies import (
    _or_policy,
    _Policy,
    _recursive_wrap,
    _wrap_module_cls_individually,
)


# ---- Entry point and the decisions ----------------------------------------------------------
def _auto_wrap(
    root_module: nn.Module,
    policy: Callable | _Policy,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: dict[str, Any],
    fsdp_fn: Callable,
) -> None:
    """Wrap the descendants of ``root_module`` that ``policy`` selects, in place.

    ``root_kwargs`` holds every constructor argument except the module, including
    ``"mixed_precision"`` (may be ``None``). ``fsdp_fn`` builds one unit: a wrapper class (FSDP1)
    or a function. For a ``_Policy`` the targets are built with ``auto_wrap_policy=None`` (key
    ``"policy"`` when ``fsdp_fn`` is not a class) so they do not auto-wrap again. The units are
    those of :func:`_decide_targets` (the wrap plan's too); the root itself is never wrapped here.
    """
    key = "auto_wrap_policy" if inspect.isclass(fsdp_fn) else "policy"
    targets = _decide_targets(
        root_module, policy, ignored_modules, ignored_params, root_kwargs, key
    )
    classes = getattr(root_kwargs["mixed_precision"], "_module_classes_to_ignore", ())
    _override_module_mixed_precision(root_module, classes)  # none without mixed precision
    _post_order_apply(root_module, _construct_wrap_fn(root_module, targets, fsdp_fn))


def _decide_targets(
    root: nn.Module,
    policy: Callable | _Policy | None,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: dict[str, Any],
    policy_key: str = "auto_wrap_policy",
) -> dict[nn.Module, dict[str, Any]]:
    """Steps 1-4 of [Note: the order of events in _auto_wrap]: ``{unit: kwargs}`` for every
    descendant FSDP1's auto-wrap builds (the root excluded), with every error and warning, and no
    change to the model. The one place of the wrap decisions: :func:`_auto_wrap` applies them,
    ``build_wrap_plan`` reports them.

    With mixed precision, a callable policy is ORed with the override's classes (so the walk
    enters every subtree, as upstream's does), and every non-ignored instance of those classes
    ends up a target with ``mixed_precision=None`` on both paths. Warnings keep upstream's order:
    before a callable policy's walk; after a ``_Policy`` ran and before its frozen-parameter check.
    """
    _check_nested_wrapping(root)
    if policy is None:
        return {}
    mixed_precision = root_kwargs.get("mixed_precision")
    classes = tuple(getattr(mixed_precision, "_module_classes_to_ignore", ()))
    # Without mixed precision there are no classes: no warning, no override.
    present = {type(m) for m in root.modules() if isinstance(m, classes)}
    kwargs = {**root_kwargs, policy_key: None} if isinstance(policy, _Policy) else root_kwargs
    if isinstance(policy, _Policy):
        targets = policy._run_policy(root, ignored_modules, kwargs)
    else:
        _warn_on_overridden_mixed_precision(present)
        if mixed_precision is not None:
            individually = functools.partial(_wrap_module_cls_individually, module_classes=classes)
            policy = functools.partial(_or_policy, policies=[policy, individually])
        targets = _record_targets(root, policy, ignored_modules, ignored_params, kwargs)
    targets = _run_mixed_precision_override_policy(root, classes, ignored_modules, kwargs, targets)
    if isinstance(policy, _Policy):
        _warn_on_overridden_mixed_precision(present)
        use_orig_params = root_kwargs.get("use_orig_params", False)
        _validate_frozen_params(root, set(targets), ignored_params, use_orig_params)
    targets.pop(root, None)  # the caller shards the root with its own kwargs
    return targets


def _record_targets(
    root: nn.Module,
    policy: Callable,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: dict[str, Any],
) -> dict[nn.Module, dict[str, Any]]:
    """The descendants a callable policy wraps, each with the kwargs it would be built with:
    :func:`_recursive_wrap` (children only) with a stand-in wrapper that records and returns the
    module unchanged. The walk, the counts and the kwargs are those of wrapping during the walk,
    since every count is taken before a child is wrapped."""
    recorded: dict[nn.Module, dict[str, Any]] = {}

    def record(module: nn.Module, **kwargs: Any) -> nn.Module:
        recorded.setdefault(module, kwargs)
        return module

    _recursive_wrap(root, policy, record, ignored_modules, ignored_params, True, **root_kwargs)
    return recorded


# ---- Post-order application (the `_Policy` path; also reused by activation checkpointing) ---
def _post_order_apply(root_module: nn.Module, fn: Callable[[nn.Module], nn.Module | None]) -> None:
    """Call ``fn`` on every module of the tree, children before parents.

    Rules: children in registration order; a module reachable along several paths is visited once
    (at its first path); if ``fn`` returns a module, it replaces the visited one under the same
    attribute name of its parent (so returning a module for the root is an error, and so is one
    for a child registered under the empty name, which no attribute can reach); ``fn`` must
    return ``None`` or an ``nn.Module`` (``AssertionError`` otherwise).
    """
    visited = {root_module}

    def visit(module: nn.Module, name: str, parent: nn.Module | None) -> None:
        for child_name, child in module.named_children():
            if child is not None and child not in visited:  # None: an override's empty slot
                visited.add(child)
                visit(child, child_name, module)
        replacement = fn(module)
        if replacement is not None:
            if not isinstance(parent, nn.Module):
                raise AssertionError(  # noqa: TRY004 (upstream's exception type)
                    "Non-root modules should have their parent module set but got "
                    f"{parent} for {module}"
                )
            if not name:  # a child registered under "": no attribute of its parent reaches it
                raise AssertionError(f"cannot replace {module}: it has an empty module name")
            if not isinstance(replacement, nn.Module):
                raise AssertionError(  # noqa: TRY004 (upstream's exception type)
                    f"fn should return None or an nn.Module but got {replacement}"
                )
            setattr(parent, name, replacement)

    visit(root_module, "", None)


def _construct_wrap_fn(
    root_module: nn.Module,
    target_module_to_kwargs: dict[nn.Module, dict[str, Any]],
    fsdp_fn: Callable,
) -> Callable[[nn.Module], nn.Module | None]:
    """The ``fn`` for :func:`_post_order_apply`: build a unit for each target except the root."""

    def fn(module: nn.Module) -> nn.Module | None:
        if module is root_module or module not in target_module_to_kwargs:
            return None
        return fsdp_fn(module, **target_module_to_kwargs[module])

    return fn


# ---- W6: no nested FSDP; ignored modules and parameters ------------------------------------

# The class names that mark a module with FSDP applied, in torch and in this package alike: FSDP1's
# wrapper class, and the class ``fully_shard`` (FSDP2) mixes into the module's own class.
_FSDP_CLASS_NAMES = frozenset({"FullyShardedDataParallel", "FSDPModule"})


def _has_fsdp_state(module: nn.Module) -> bool:
    """Whether ``module`` already has some FSDP applied: its class or one of its bases is named
    ``FullyShardedDataParallel`` or ``FSDPModule``.

    Recognised that way: torch's FSDP1 wrapper and FSDP2 modules (``FSDPModule`` and what derives
    from it, such as ``replicate``'s modules), this package's FSDP1 wrapper and FSDP2
    ``FSDPModule``, and any other implementation that names its classes as upstream does. By name,
    because this part imports neither FSDP implementation.
    """
    return any(cls.__name__ in _FSDP_CLASS_NAMES for cls in type(module).__mro__)


def _check_nested_wrapping(root_module: nn.Module) -> None:
    """Raise ``ValueError`` naming the first module (``named_modules`` order) with FSDP applied.

    Stricter than torch 2.13, which only recognises FSDP1 states: it auto-wraps around a
    ``fully_shard`` (FSDP2) submodule without complaint.
    """
    for name, module in root_module.named_modules():
        if _has_fsdp_state(module):
            raise ValueError(
                "FSDP auto wrapping requires modules to not already have FSDP applied but found "
                f"{name} in\n{root_module}"
            )


def _get_ignored_states(
    root_module: nn.Module,
    ignored_modules: Iterable[nn.Module] = (),
    ignored_params: Iterable[nn.Parameter] = (),
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """FSDP1's normalisation of ``ignored_modules`` / ``ignored_states``, before auto-wrapping:
    ``(ignored modules, ignored parameters)``.

    Rules:
      * ``ignored_modules`` must hold only modules and ``ignored_params`` only parameters, else
        ``ValueError`` naming the element types (FSDP1's wording for its ``ignored_modules`` and
        ``ignored_states`` arguments; FSDP1 passes an ``ignored_states`` of modules as
        ``ignored_modules``); a module with FSDP applied → ``ValueError``.
      * The modules: the given ones with their whole subtrees, FSDP modules themselves excluded.
        Ignoring the root warns (all its parameters end up ignored).
      * The parameters: those given, plus every parameter of the ignored modules.
    """
    modules, params = list(ignored_modules), list(ignored_params)
    for items, cls, what in (
        (modules, nn.Module, "ignored_modules expects nn.Module"),
        (params, nn.Parameter, "ignored_states expects all nn.Parameter or all nn.Module"),
    ):
        if not all(isinstance(x, cls) for x in items):
            kinds = sorted({type(x) for x in items}, key=repr)
            raise ValueError(f"{what} list elements but got types {kinds}")
    if any(_has_fsdp_state(m) for m in modules):
        raise ValueError("`ignored_modules` should not include FSDP modules")
    ignored = {m for top in modules for m in top.modules() if not _has_fsdp_state(m)}
    if root_module in ignored:
        warnings.warn(
            "Trying to ignore the top-level module passed into the FSDP constructor itself will "
            f"result in all parameters being ignored and is not well-supported: {root_module}",
            stacklevel=3,
        )
    return ignored, {*params, *(p for m in ignored for p in m.parameters())}


# ---- W11: modules kept out of mixed precision (batch norm by default) -----------------------

# module -> dtype of the floating-point input its pre-hook last cast to fp32 (restored on output)
_MODULE_TO_INP_DTYPE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _run_mixed_precision_override_policy(
    root_module: nn.Module,
    module_classes: Sequence[type[nn.Module]],
    ignored_modules: set[nn.Module],
    root_kwargs: dict[str, Any],
    target_module_to_kwargs: dict[nn.Module, dict[str, Any]],
) -> dict[nn.Module, dict[str, Any]]:
    """Make every non-ignored instance of ``module_classes`` a target with ``mixed_precision=None``.

    A module the policy already chose keeps its kwargs apart from that one key; any other gets
    the root kwargs. Upstream aliases the caller's ``root_kwargs`` dict for the latter (and then
    sets its ``"mixed_precision"`` to ``None``); here each gets its own copy, which builds the same
    units without changing the caller's dict.
    """
    for module in root_module.modules():
        if module not in ignored_modules and isinstance(module, tuple(module_classes)):
            kwargs = target_module_to_kwargs.get(module, root_kwargs)
            target_module_to_kwargs[module] = {**kwargs, "mixed_precision": None}
    return target_module_to_kwargs


def _warn_on_overridden_mixed_precision(overridden_module_classes: set[type[nn.Module]]) -> None:
    if not overridden_module_classes:
        return
    # "instacnes" is upstream's spelling, kept so that the message matches.
    warnings.warn(
        "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped "
        f"module has submodules of type:\n{overridden_module_classes}\n"
        "These modules will be wrapped as separate FSDP instacnes with mixed precision disabled.",
        stacklevel=5,  # X5: the caller of FSDP1() -> _auto_wrap -> _decide_targets -> here
    )


def _override_module_mixed_precision(
    root: nn.Module, module_classes_to_override: Sequence[type[nn.Module]]
) -> set[type[nn.Module]]:
    """Prepare each instance of the classes to run in fp32 inside a low-precision model.

    For every instance (ignored ones too): set ``_wrap_overrides`` to ``{"mixed_precision":
    None}`` (one dict shared by all), and append a forward pre-hook that casts floating-point
    input tensors of another dtype to fp32 (remembering that dtype) and a forward hook that casts
    floating-point outputs back to the remembered dtype. Returns the exact types found.
    """
    wrap_override_dict = {"mixed_precision": None}
    found: set[type[nn.Module]] = set()
    for module in root.modules():
        if isinstance(module, tuple(module_classes_to_override)):
            found.add(type(module))
            module._wrap_overrides = wrap_override_dict
            module.register_forward_pre_hook(_cast_inputs_to_fp32, prepend=False)
            module.register_forward_hook(_cast_outputs_back, prepend=False)
    return found


def _cast_to(dtype: torch.dtype, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(x) or x.dtype == dtype:
        return x
    _MODULE_TO_INP_DTYPE[module] = x.dtype
    return x.to(dtype)


def _cast_inputs_to_fp32(module: nn.Module, args: Any) -> Any:
    return tree_map_only(torch.Tensor, functools.partial(_cast_to, torch.float32, module), args)


def _cast_outputs_back(module: nn.Module, args: Any, output: Any) -> Any:
    if module not in _MODULE_TO_INP_DTYPE:  # no floating-point input was ever cast
        return None
    cast = functools.partial(_cast_to, _MODULE_TO_INP_DTYPE[module], module)
    return tree_map_only(torch.Tensor, cast, output)


# ---- W12: uniformly frozen parameters per unit; what each unit manages ----------------------
def _validate_frozen_params(
    root_module: nn.Module,
    modules_to_wrap: set[nn.Module],
    ignored_params: set[nn.Parameter],
    use_orig_params: bool,
) -> None:
    """Each module in ``modules_to_wrap`` must manage only frozen or only trainable parameters
    (what it manages: :func:`_managed_params`). The first violating module in build order raises
    ``ValueError`` when ``use_orig_params`` is false; with ``use_orig_params`` every violating
    module gets a ``UserWarning`` instead."""
    for name, _, managed in _managed_params(root_module, modules_to_wrap, ignored_params):
        # upstream lists them breadth-first: depth-first order, stably sorted by depth
        by_depth = sorted(managed.items(), key=lambda item: item[0].count("."))
        trainable = [fqn for fqn, p in by_depth if p.requires_grad]
        frozen = [fqn for fqn, p in by_depth if not p.requires_grad]
        if not trainable or not frozen:
            continue
        nonfrozen = sum(p.numel() for p in managed.values() if p.requires_grad)
        msg = f"{name} has both parameters with requires_grad=True and False." + (
            " We do not recommend wrapping such modules since the gradient memory usage will be "
            f"higher than expected ({sum(p.numel() for p in managed.values())} numel instead of "
            f"{nonfrozen} numel before sharding via reduce-scatter). "
            if use_orig_params
            else " FSDP does not support wrapping such modules when use_orig_params=False. "
        )
        msg += (
            "If possible, wrap the frozen parameters with FSDP separately.\n"
            f"The following parameters have requires_grad=True:\n{trainable}\n"
            f"The following parameters have requires_grad=False:\n{frozen}"
        )
        if not use_orig_params:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=5)  # as in _warn_on_overridden_mixed_precision


def _managed_params(
    root: nn.Module, units: set[nn.Module], ignored_params: set[nn.Parameter]
) -> list[tuple[str, nn.Module, dict[str, nn.Parameter]]]:
    """``(fqn, unit, {param fqn: param})`` for each module of ``units`` in build order (children
    first, siblings in registration order, a module reachable along several paths once, at its
    first name): the parameters it manages, those of its subtree minus ignored ones and minus
    those of earlier units' subtrees (which it does not enter)."""
    names = {m: n for n, m in root.named_modules()}
    order: list[nn.Module] = []
    _post_order_apply(root, lambda m: order.append(m) if m in units else None)
    walked: set[nn.Module] = set()
    claimed = set(ignored_params)
    return [(names[m], m, _claim_params(m, names[m], walked, claimed)) for m in order]


def _claim_params(
    unit: nn.Module, prefix: str, walked: set[nn.Module], claimed: set[torch.Tensor]
) -> dict[str, nn.Parameter]:
    """FQN -> parameter for what ``unit`` owns: the parameters of the modules :func:`_walk_unit`
    reaches, in that order, skipping ``claimed`` ones (and marking what it takes claimed). A
    parameter registered under several names inside the unit gets the first one (as FSDP1 names
    it), so the order is ``named_parameters()`` order."""
    names: dict[nn.Parameter, str] = {}
    for name, module in _walk_unit(unit, prefix, walked):
        for param_name, param in module.named_parameters(recurse=False):
            names.setdefault(param, f"{name}.{param_name}" if name else param_name)
    return {names[param]: param for param in _take(list(names), claimed)}


def _take(tensors: list[torch.Tensor], taken: set[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` without repeats and without ``taken`` ones, in order; marks them taken."""
    new = [t for t in dict.fromkeys(tensors) if t not in taken]
    taken.update(new)
    return new


def _walk_unit(
    module: nn.Module, name: str, walked: set[nn.Module]
) -> Iterator[tuple[str, nn.Module]]:
    """``(fqn, module)`` for a unit's subtree, depth-first in registration order, not entering
    ``walked`` modules (earlier units' subtrees) nor a ``None`` child (an override of
    ``named_children()`` may yield one); marks what it yields walked."""
    if module is None or module in walked:
        return
    walked.add(module)
    yield name, module
    for child_name, child in module.named_children():
        yield from _walk_unit(child, f"{name}.{child_name}" if name else child_name, walked)
