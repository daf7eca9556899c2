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
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import nn

from reference.wrap._policies import _Policy
from reference.wrap._wrap_utils import (
    _decide_targets,
    _get_ignored_states,
    _managed_params,
    _record_targets,
    _take,
    _walk_unit,
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
    ignored_modules, ignored_params = _get_ignored_states(root, ignored_modules, ignored_params)
    targets = _decide_targets(root, policy, ignored_modules, ignored_params, root_kwargs)
    entries = [
        WrapPlanEntry(fqn, MappingProxyType(dict(targets.get(unit, root_kwargs))), tuple(managed))
        for fqn, unit, managed in _managed_params(root, {*targets, root}, ignored_params)
    ]
    ignored_fqns = tuple(n for n, p in root.named_parameters() if p in ignored_params)
    return WrapPlan(tuple(entries), ignored_fqns)


# ---------------------------------------------------------------------------------------------
# Seed era (W16): unit -> owned parameters and buffers, for the old composable `fully_shard`
# ---------------------------------------------------------------------------------------------


class FullyShardedModuleState(NamedTuple):
    """What one logical unit owns: parameters to flatten together and buffers."""

    params: list[nn.Parameter]
    buffers: list[torch.Tensor]


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
      * Units: the modules a callable policy wraps (recorded as ``_decide_targets`` records them;
        a non-callable ``_Policy`` contributes its ``_run_policy`` targets), plus the root. No
        other wrap decision applies here (no nested-FSDP, mixed-precision or frozen check).
      * The dict follows ``root_module.modules()`` order, so parents precede children.
      * Each unit owns the parameters and buffers of the modules its walk reaches (its subtree,
        not entering other units, depth-first in registration order), skipping ignored
        parameters and anything an earlier unit took. So a parameter shared between a parent unit
        and a child unit goes to the parent; shared between siblings, to the first sibling.
      * ``assign_shared_params_to_lca=True`` (the later seed-era variant): a parameter reachable
        under several names instead goes to the unit whose walk reaches the lowest common
        ancestor of its owning modules, right after that module's own parameters.
    The model is not modified.
    """
    units = {root_module}
    if isinstance(auto_wrap_policy, _Policy) and not callable(auto_wrap_policy):
        units.update(auto_wrap_policy._run_policy(root_module, ignored_modules, {}))
    elif auto_wrap_policy is not None:
        units.update(
            _record_targets(root_module, auto_wrap_policy, ignored_modules, ignored_params, {})
        )
    to_lca: dict[nn.Module, list[nn.Parameter]] = collections.defaultdict(list)
    if assign_shared_params_to_lca:
        for param, lca in _get_shared_param_to_lca_module(root_module, ignored_params).items():
            to_lca[lca].append(param)
    claimed, seen_buffers = set(ignored_params), set()  # what earlier units took
    walked = set(units)
    result: dict[nn.Module, FullyShardedModuleState] = {}
    for unit in [m for m in root_module.modules() if m in units]:
        walked.discard(unit)
        modules = [m for _, m in _walk_unit(unit, "", walked)]
        params = [p for m in modules for p in (*m.parameters(recurse=False), *to_lca[m])]
        buffers = [b for m in modules for b in m.buffers(recurse=False)]
        result[unit] = FullyShardedModuleState(_take(params, claimed), _take(buffers, seen_buffers))
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
    # commonprefix compares element by element, so on lists of names it gives the common path
    return {
        param: root_module.get_submodule(".".join(os.path.commonprefix(paths)))
        for param, paths in owners.items()
        if len(paths) > 1
    }
