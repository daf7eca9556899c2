"""Auto-wrap policies: which submodules of a model become their own sharded unit.

This file mirrors ``torch.distributed.fsdp.wrap`` name for name (all re-exported by
:mod:`reference.wrap`). The machinery that applies a policy to a model lives in
:mod:`reference.wrap._wrap_utils`; a side-effect-free "what would be wrapped" answer lives in
:mod:`reference.wrap._wrap_plan`.

[Note: auto-wrap vocabulary]
  root module        the module handed to the FSDP constructor. The caller shards it itself, so
                     auto-wrapping never replaces it; it only decides about its descendants.
  target module      a descendant the policy selects; it becomes its own FSDP unit and owns the
                     parameters of its subtree that no deeper target already owns.
  root kwargs        the keyword arguments the root was built with (process group, sharding
                     strategy, mixed precision, ...). Each target is built with a copy of them,
                     possibly overridden per target.
  nonwrapped numel   number of parameter elements in a subtree that no deeper unit owns yet,
                     ignored parameters excluded. Size-based policies compare it to a threshold.
  callable policy    the original protocol: ``policy(module=, recurse=, nonwrapped_numel=) ->
                     bool``. Asked once with ``recurse=True`` ("look inside this subtree?")
                     before the children, and once with ``recurse=False`` ("wrap this module
                     with what is left?") after them. Driven by :func:`_recursive_wrap`.
  ``_Policy``        the newer protocol: one call ``_run_policy(root, ignored_modules,
                     root_kwargs)`` returns ``{target module: its kwargs}`` for the whole tree at
                     once; applied children-first by ``_post_order_apply``.
  ignored module     a module (with its whole subtree) that no unit manages; it is neither
                     wrapped nor counted.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, ClassVar

from torch import nn

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]


# ---------------------------------------------------------------------------------------------
# The `_Policy` protocol and its two implementations
# ---------------------------------------------------------------------------------------------


class _Policy(ABC):
    """A policy that picks all of its targets in one pass over the tree.

    Rule: ``_run_policy`` returns a dict from each target module to the kwargs to build its unit
    with. It must not modify the model. Modules in ``ignored_modules`` are never targets. The
    root may appear in the result; appliers skip it because the caller shards the root.
    """

    @abstractmethod
    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]: ...


class ModuleWrapPolicy(_Policy):
    """Wrap every instance of the given classes (the root counts too), each with the root kwargs.

    Each target gets its own shallow copy of the root kwargs, so editing one target's dict never
    changes another's. The object is also usable as a callable policy (``recurse`` → ``True``;
    otherwise ``isinstance``), for example inside :func:`_or_policy`.
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self._module_classes = set(module_classes)  # deduplicated; never changed (repr shows it)

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        kinds = tuple(self._module_classes)
        picked = (m for m in root_module.modules() if isinstance(m, kinds))
        return {m: copy.copy(root_kwargs) for m in picked if m not in ignored_modules}

    def __call__(self, module, recurse, *args, **kwargs):
        return _wrap_module_cls_individually(module, self._module_classes, recurse)

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._module_classes})"


class CustomPolicy(_Policy):
    """Ask ``lambda_fn(module)`` for every non-ignored module (root included, ``.modules()`` order).

    The answer means:
      * ``False`` or ``{}``  — not a target;
      * ``True``             — a target built with (a copy of) the root kwargs;
      * a non-empty dict     — a target built with the root kwargs updated by that dict.
    Any other answer (``1``, ``None``, a string, ...) raises ``ValueError`` before anything is
    wrapped.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]):
        self._lambda_fn = lambda_fn

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        targets: dict[nn.Module, dict[str, Any]] = {}
        for module in root_module.modules():
            if module in ignored_modules:
                continue
            answer = self._lambda_fn(module)
            if not isinstance(answer, (bool, dict)):
                raise ValueError(  # noqa: TRY004 (upstream's exception type)
                    "The lambda_fn passed to CustomPolicy should return False/True or a kwarg "
                    f"dict, but it returned {answer}"
                )
            if answer:  # True or a non-empty dict: a copy of the root kwargs, updated by a dict
                targets[module] = {**root_kwargs, **(answer if isinstance(answer, dict) else {})}
        return targets


# ---------------------------------------------------------------------------------------------
# Callable policies (the `recurse` / `nonwrapped_numel` protocol)
# ---------------------------------------------------------------------------------------------


def always_wrap_policy(*args, **kwargs) -> bool:
    """Look inside everything and wrap everything (every non-ignored descendant)."""
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable
) -> bool:
    """Look inside everything; wrap ``module`` iff ``lambda_fn(module)`` is true."""
    return recurse or lambda_fn(module)


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: set[type[nn.Module]],
) -> bool:
    """:func:`_wrap_module_cls_individually` with the layer classes as ``module_classes``
    (upstream's ``_module_wrap_policy``).

    Typical use: one unit per transformer block, so parameters shared across blocks (tied
    embeddings) end up in the root's unit.
    """
    return _wrap_module_cls_individually(module, transformer_layer_cls, recurse)


def _wrap_module_cls_individually(
    module: nn.Module, module_classes: Sequence[type], recurse: bool, *args, **kwargs
) -> bool:
    """Look inside everything; wrap ``module`` iff it is an instance of ``module_classes``."""
    return recurse or isinstance(module, tuple(module_classes))


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies) -> bool:
    """True iff any policy in ``policies`` says true (for the same question).

    Each policy is called with keyword arguments ``module=, recurse=, nonwrapped_numel=``.
    Note the consequence for ``recurse``: one always-recurse member makes the OR recurse
    everywhere, even below a size-based policy's threshold or into its force-leaf modules.
    """
    return any(
        policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)
        for policy in policies
    )


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap once enough unowned parameter elements have accumulated.

    Rules (``large`` means ``nonwrapped_numel >= min_num_params``; the name says "params" but it
    counts elements):
      * recurse question → ``large`` and ``module`` is not a ``force_leaf_modules`` instance;
      * wrap question    → ``large`` and ``module`` is not an ``exclude_wrap_modules`` instance.
    ``None`` selects the defaults stored on this function: ``FORCE_LEAF_MODULES =
    {nn.MultiheadAttention}`` and ``EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}``
    (containers without a forward cannot run as a unit).
    """
    if force_leaf_modules is None:
        force_leaf_modules = size_based_auto_wrap_policy.FORCE_LEAF_MODULES
    if exclude_wrap_modules is None:
        exclude_wrap_modules = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
    classes = force_leaf_modules if recurse else exclude_wrap_modules  # not entered / not wrapped
    return nonwrapped_numel >= min_num_params and not isinstance(module, tuple(classes))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}


# ---------------------------------------------------------------------------------------------
# Manual wrapping: `enable_wrap` + `wrap`
# ---------------------------------------------------------------------------------------------


class _ConfigAutoWrap:
    """Process-wide state of the (single, non-nestable) ``enable_wrap`` context.

    A class attribute, not an instance attribute: ``wrap()`` reads it from anywhere.
    """

    # (wrapper_cls, the context's kwargs for every wrap() call) inside enable_wrap, else None
    context: ClassVar[tuple[Callable | None, dict[str, Any]] | None] = None


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Make :func:`wrap` active: inside, ``wrap(m, **o)`` returns ``wrapper_cls(m, **kw, **o)``.

    Entering a second context while one is active raises ``NotImplementedError`` (the outer one
    stays active).
    """
    if _ConfigAutoWrap.context is not None:
        raise NotImplementedError(
            "You are already within an autowrap context and we currently do not supported "
            "nested autowrap."
        )
    _ConfigAutoWrap.context = (wrapper_cls, wrapper_kwargs)
    try:
        yield
    finally:
        _ConfigAutoWrap.context = None


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` if inside :func:`enable_wrap`; otherwise return it unchanged.

    Precedence of kwargs, lowest first: the context's kwargs, this call's ``wrap_overrides``,
    then the module's own ``_wrap_overrides`` attribute (set by the batch-norm mixed-precision
    override) — see :func:`_wrap`.
    """
    if _ConfigAutoWrap.context is None:
        return module
    wrapper_cls, kwargs = _ConfigAutoWrap.context
    if wrapper_cls is None:
        raise AssertionError("Expected _ConfigAutoWrap.wrapper_cls to be set")
    return _wrap(module, wrapper_cls, **{**kwargs, **wrap_overrides})


def _wrap(module: nn.Module, wrapper_cls: Callable, **kwargs: Any) -> nn.Module:
    """Build ``wrapper_cls(module, **kwargs)``, with ``module._wrap_overrides`` winning if set.

    Callers check ``wrapper_cls`` first (``wrap`` and ``_recursive_wrap`` raise on ``None``).
    """
    return wrapper_cls(module, **{**kwargs, **(getattr(module, "_wrap_overrides", None) or {})})


# ---------------------------------------------------------------------------------------------
# Applying a callable policy
# ---------------------------------------------------------------------------------------------


def _recursive_wrap(
    module: nn.Module,
    auto_wrap_policy: Callable,
    wrapper_cls: Callable,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    only_wrap_children: bool = False,
    **kwargs: Any,
) -> tuple[nn.Module, int]:
    """Apply a callable policy depth-first; return ``(module or its wrapper, wrapped numel)``.

    Rules, for one ``module``:
      1. If ``wrapper_cls`` is a class and any non-ignored module of the subtree is already an
         instance of it → ``AssertionError`` (nothing has been changed yet).
      2. ``numel`` = elements of the subtree's parameters, ignored parameters excluded, counted
         before any child is wrapped.
      3. If the policy's recurse answer for ``numel`` is false → ``(module, 0)``.
      4. Otherwise recurse into each non-ignored child (registration order) and put the result
         back under the same name; ``wrapped`` = the sum of the children's wrapped numel.
      5. Unless ``only_wrap_children``, ask the wrap question with ``numel - wrapped``; if true,
         return ``(_wrap(module, wrapper_cls, **kwargs), numel)``, else ``(module, wrapped)``.
    FSDP's constructor calls this with ``only_wrap_children=True`` because it wraps the root
    itself.
    """
    if auto_wrap_policy is None:
        raise AssertionError("Must specify auto_wrap_policy.")
    if wrapper_cls is None:
        raise AssertionError("Must specify wrapper_cls")
    if isinstance(wrapper_cls, type):  # a factory function cannot be checked this way
        for submodule in module.modules():
            if submodule not in ignored_modules and isinstance(submodule, wrapper_cls):
                raise AssertionError(
                    f"Child module {submodule} is already wrapped by {wrapper_cls}"
                )

    numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not auto_wrap_policy(module=module, recurse=True, nonwrapped_numel=numel):
        return module, 0

    wrapped = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        new_child, child_wrapped = _recursive_wrap(
            child, auto_wrap_policy, wrapper_cls, ignored_modules, ignored_params, **kwargs
        )
        if new_child is not child:  # a recording stand-in may hand the module back unchanged
            setattr(module, name, new_child)
        wrapped += child_wrapped

    if not only_wrap_children and auto_wrap_policy(
        module=module, recurse=False, nonwrapped_numel=numel - wrapped
    ):
        return _wrap(module, wrapper_cls, **kwargs), numel
    return module, wrapped
