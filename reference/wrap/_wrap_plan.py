"""What an auto-wrap policy would wrap, computed without touching the model.

Two answers live here:

* :func:`build_wrap_plan` → :class:`WrapPlan`: the units FSDP1's ``auto_wrap_policy`` would build,
  in build order, each with its kwargs and the parameters it would manage. Implementations that
  do not wrap (FSDP2-style ``fully_shard``) apply a plan by sharding each planned module in
  order; FSDP1-style implementations pass the policy itself and get the same units.
* :func:`_get_fully_sharded_module_to_states` (seed era, removed upstream in later versions):
  the "pseudo auto-wrap" used by the old FSDP1-based composable ``fully_shard``, mapping each
  unit to the parameters and buffers it would own.

[Note: plan vocabulary]
  unit        one module that gets sharded as a whole: a planned descendant or the root.
  build order children before parents, siblings in registration order, the root last (the
              order in which FSDP1 constructs its nested instances).
  managed     the parameters of a unit's subtree that no earlier unit (in build order) manages
              and that are not ignored; every non-ignored parameter is managed by exactly one
              unit. A parameter shared between two units' subtrees goes to the earlier unit
              (torch 2.13 FSDP1 does the same with use_orig_params=True; with False it
              flattens such a parameter into both units).
  module FQN  the name from ``root.named_modules()`` of the unwrapped model ("" = root); a
              module reachable along several paths is planned once, under its first name.
"""

from __future__ import annotations

import collections
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import nn

from reference.wrap._policies import _Policy, _recursive_wrap
from reference.wrap._wrap_utils import (
    _claim_params,
    _decide_targets,
    _has_fsdp_state,
    _managed_params,
)

__all__ = ["WrapPlan", "WrapPlanEntry", "build_wrap_plan"]


@dataclass(frozen=True)
class WrapPlanEntry:
    """One unit of a :class:`WrapPlan`."""

    module_fqn: str  # "" for the root
    kwargs: Mapping[str, Any]  # read-only; what FSDP1 would construct this unit with
    param_fqns: tuple[str, ...]  # parameters this unit manages: FQNs from the root, in
    #                              named_parameters() order (a tied one under its first name)


@dataclass(frozen=True)
class WrapPlan:
    """The units an auto-wrap policy selects, in build order (children first, root last)."""

    entries: tuple[WrapPlanEntry, ...]  # len == number of units; entries[-1] is the root
    ignored_param_fqns: tuple[str, ...]  # parameters no unit manages

    @property
    def targets(self) -> list[tuple[str, dict[str, Any]]]:
        """``[(module_fqn, kwargs), ...]`` in build order (fresh dicts)."""
        return [(e.module_fqn, dict(e.kwargs)) for e in self.entries]

    @property
    def module_fqns(self) -> tuple[str, ...]:
        return tuple(e.module_fqn for e in self.entries)

    def resolve(self, root: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
        """The planned modules of ``root`` (looked up by FQN) with their kwargs, in build order."""
        return [(root.get_submodule(e.module_fqn), dict(e.kwargs)) for e in self.entries]


def build_wrap_plan(
    root: nn.Module,
    policy: _Policy | Callable | None,
    *,
    ignored_modules: Iterable[nn.Module] = (),
    ignored_params: Iterable[nn.Parameter] = (),
    root_kwargs: Mapping[str, Any] | None = None,
) -> WrapPlan:
    """Plan ``FullyShardedDataParallel(root, auto_wrap_policy=policy, **root_kwargs)``.

    Rules:
      * The planned descendants and their kwargs are exactly what FSDP1's constructor would pass
        to each nested instance (``_auto_wrap``): for a ``_Policy`` a copy of ``root_kwargs`` with
        ``auto_wrap_policy=None`` plus the policy's overrides; for a callable policy
        ``root_kwargs`` as given (plus a module's own ``_wrap_overrides``).
      * ``root_kwargs["mixed_precision"]`` not ``None`` → every non-ignored instance of its
        ``_module_classes_to_ignore`` (batch norm by default) is planned with
        ``mixed_precision=None``, with upstream's warning (W11). The model gets no hooks: the
        applier does that (``_override_module_mixed_precision``).
      * The root is always the last entry, with ``root_kwargs`` unchanged; ``policy=None`` plans
        the root alone.
      * ``ignored_modules`` are expanded to their subtrees; they and ``ignored_params`` are
        neither planned nor counted (as FSDP's ``ignored_states``).
      * Raises as FSDP1 would, before anything else: bad ``ignored_modules`` /
        ``ignored_params`` (``ValueError``, FSDP1's ``ignored_states`` wording); a module with FSDP
        already applied (W6); a ``CustomPolicy`` answer that is not a bool/dict (W10); mixed
        frozen and trainable parameters in one ``_Policy`` target (W12, ``ValueError`` unless
        ``use_orig_params``).
    The model is not modified (no attribute, hook or child changes).
    """
    root_kwargs = dict(root_kwargs or {})
    ignored_modules, ignored_params = list(ignored_modules), list(ignored_params)
    _check_uniform(ignored_modules, nn.Module, "ignored_modules expects nn.Module list elements")
    _check_uniform(
        ignored_params,
        nn.Parameter,
        "ignored_states expects all nn.Parameter or all nn.Module list elements",
    )
    ignored_module_set = _get_ignored_modules(root, ignored_modules)
    ignored_param_set = _get_ignored_params(root, ignored_module_set, ignored_params)
    targets = _decide_targets(root, policy, ignored_module_set, ignored_param_set, root_kwargs)
    entries = [
        WrapPlanEntry(fqn, MappingProxyType(dict(targets.get(unit, root_kwargs))), tuple(managed))
        for fqn, unit, managed in _managed_params(root, {*targets, root}, ignored_param_set)
    ]
    ignored_fqns = tuple(n for n, p in root.named_parameters() if p in ignored_param_set)
    return WrapPlan(tuple(entries), ignored_fqns)


def _check_uniform(items: list, cls: type, message: str) -> None:
    """FSDP1's check of ``ignored_modules`` / ``ignored_states``: ``ValueError`` naming types."""
    if not all(isinstance(x, cls) for x in items):
        kinds = sorted({type(x) for x in items}, key=repr)
        raise ValueError(f"{message} but got types {kinds}")


# ---------------------------------------------------------------------------------------------
# Ignored modules and parameters (as FSDP's constructor normalises them before auto-wrapping)
# ---------------------------------------------------------------------------------------------


def _get_ignored_modules(
    root_module: nn.Module, ignored_modules: Iterable[nn.Module] | None
) -> set[nn.Module]:
    """The given modules plus their whole subtrees (FSDP-managed modules themselves excluded).

    Errors: a non-iterable → ``TypeError``; a non-module element → ``TypeError``; a module
    with FSDP applied → ``ValueError``. Ignoring the root warns (all parameters ignored).
    """
    prefix = "`ignored_modules` should be an iterable of `torch.nn.Module`s "
    try:
        roots = set(ignored_modules) if ignored_modules is not None else set()
    except TypeError as e:
        raise TypeError(prefix + f"but got {type(ignored_modules)}") from e
    for module in roots:
        if not isinstance(module, nn.Module):
            raise TypeError(prefix + f"but got an iterable with {type(module)}")
        if _has_fsdp_state(module):
            raise ValueError("`ignored_modules` should not include FSDP modules")
    result = {m for r in roots for m in r.modules() if not _has_fsdp_state(m)}
    if root_module in result:
        warnings.warn(
            "Trying to ignore the top-level module passed into the FSDP constructor itself will "
            f"result in all parameters being ignored and is not well-supported: {root_module}",
            stacklevel=3,
        )
    return result


def _get_ignored_params(
    root_module: nn.Module,
    ignored_modules: set[nn.Module],
    ignored_parameters: Iterable[nn.Parameter] | None = None,
) -> set[nn.Parameter]:
    """Every parameter of the ignored modules, plus the explicitly ignored parameters."""
    result = {p for m in ignored_modules for p in m.parameters()}
    result.update(ignored_parameters or ())
    return result


# ---------------------------------------------------------------------------------------------
# Seed era (W16): unit -> owned parameters and buffers, for the old composable `fully_shard`
# ---------------------------------------------------------------------------------------------


class FullyShardedModuleState(NamedTuple):
    """What one logical unit owns: parameters to flatten together and buffers."""

    params: list[nn.Parameter]
    buffers: list[torch.Tensor]


def _record_module_wrapper_cls(
    wrapped_modules_set: set[nn.Module], module: nn.Module, **kwargs: Any
) -> nn.Module:
    """A stand-in ``wrapper_cls`` for :func:`_recursive_wrap`: remember ``module``, return it."""
    wrapped_modules_set.add(module)
    return module


def _get_fully_sharded_module_to_states(
    root_module: nn.Module,
    auto_wrap_policy: _Policy | Callable | None,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    *,
    assign_shared_params_to_lca: bool = False,
) -> dict[nn.Module, FullyShardedModuleState]:
    """Map each unit the policy selects (and the root, always) to the state it would own.

    Rules:
      * Units: the modules ``_recursive_wrap`` (root included) would wrap with the policy (a
        non-callable ``_Policy`` contributes its ``_run_policy`` targets), plus the root.
      * The dict follows ``root_module.modules()`` order, so parents precede children.
      * Each unit owns the parameters and buffers of its subtree, not entering other units,
        walked depth-first in registration order, skipping ignored parameters and anything an
        earlier unit took. So a parameter shared between a parent unit and a child unit goes to
        the parent; shared between siblings, to the first sibling.
      * ``assign_shared_params_to_lca=True`` (the later seed-era variant): a parameter reachable
        under several names instead goes to the unit whose walk reaches the lowest common
        ancestor of its owning modules, appended after that module's own parameters.
    The model is not modified.
    """
    units: set[nn.Module] = set()
    if isinstance(auto_wrap_policy, _Policy) and not callable(auto_wrap_policy):
        units.update(auto_wrap_policy._run_policy(root_module, ignored_modules, {}))
    elif auto_wrap_policy is not None:
        recorder = functools.partial(_record_module_wrapper_cls, units)
        _recursive_wrap(root_module, auto_wrap_policy, recorder, ignored_modules, ignored_params)
    units.add(root_module)

    claimed: set[torch.Tensor] = set(ignored_params)
    lca_to_shared: dict[nn.Module, dict[str, nn.Parameter]] = collections.defaultdict(dict)
    if assign_shared_params_to_lca:
        names = {p: n for n, p in root_module.named_parameters()}
        for param, lca in _get_shared_param_to_lca_module(root_module, ignored_params).items():
            lca_to_shared[lca][names[param]] = param
            claimed.add(param)
    # The walks of _claim_params, parents first; a unit never enters another unit's subtree.
    result: dict[nn.Module, FullyShardedModuleState] = {}
    walked, walked_for_buffers, seen_buffers = set(units), set(units), set()
    for unit in (m for m in root_module.modules() if m in units):
        walked.discard(unit)
        walked_for_buffers.discard(unit)
        params = _claim_params(unit, "", walked, claimed, extra=lca_to_shared)
        buffers = _claim_params(unit, "", walked_for_buffers, seen_buffers, kind="buffers")
        result[unit] = FullyShardedModuleState(list(params.values()), list(buffers.values()))
    return result


def _get_shared_param_to_lca_module(
    root_module: nn.Module, ignored_params: set[nn.Parameter]
) -> dict[nn.Parameter, nn.Module]:
    """Each non-ignored parameter registered under more than one name → the lowest module whose
    subtree contains all of those registrations."""
    owners: dict[nn.Parameter, list[list[str]]] = collections.defaultdict(list)
    for fqn, param in root_module.named_parameters(remove_duplicate=False):
        if param not in ignored_params:
            owners[param].append(fqn.split(".")[:-1])
    result: dict[nn.Parameter, nn.Module] = {}
    for param, paths in owners.items():
        if len(paths) < 2:
            continue
        common: list[str] = []
        for parts in zip(*paths):
            if any(part != parts[0] for part in parts):
                break
            common.append(parts[0])
        result[param] = root_module.get_submodule(".".join(common))
    return result
