"""``fully_shard`` and ``FSDPModule``: the public face of the FSDP2 reference.

``fully_shard(module)`` shards the parameters the module manages (those not already under a
nested ``fully_shard``) into one :class:`FSDPParamGroup`, registers the forward hooks, and swaps
the module's class to a dynamic subclass ``FSDP<Name>`` of ``(FSDPModule, <Name>)`` so that the
methods below become available on it. Apply it bottom-up: to each block, then to the root.

[Note: where a module's state lives]
As upstream, the module itself holds its ``FSDPState``: in the composable-API slots torch keeps in
``module.__dict__`` (the state under ``STATE_KEY``, keyed by ``fully_shard``; the name
``"fully_shard"`` in the API registry under ``REGISTRY_KEY``), and torch's module-to-state map holds
a weak reference to it. So the state lives exactly as long as its module, and tools that recognise
``fully_shard`` modules through that bookkeeping (``_get_registry``, ``_get_module_state``: DCP,
``replicate``'s composability check) see the reference as they see upstream.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.utils import _get_root_modules

from ._fsdp_api import MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_init import (
    _get_device_from_mesh,
    _get_managed_modules,
    _get_managed_states,
    _get_mesh_info,
    _get_post_forward_mesh_info,
    _init_default_mesh,
    _move_states_to_device,
    _resolve_shard_placement,
    _validate_module,
)
from ._fsdp_param_group import FSDPParamGroup
from ._fsdp_state import FSDPState, _get_module_fsdp_state

cls_to_fsdp_cls: dict[type, type] = {}


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (upstream's signature)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
):
    """Shard ``module``'s managed parameters over ``mesh`` and return ``module`` (in place).

    Args (as upstream ``torch.distributed.fsdp.fully_shard``):
        module: a module, or a list of modules to group into one all-gather / reduce-scatter.
        mesh: 1-D (FSDP) or 2-D named ``(replicate, shard)`` (HSDP) mesh; defaults to the whole
            default group on the build's accelerator (or CPU).
        reshard_after_forward: ``True`` free after forward; ``False`` keep; ``None`` = ``False``
            for the root and ``True`` otherwise; an int reshards onto groups of that size.
        shard_placement_fn: ``param -> Shard(d) | None`` to shard on dim ``d`` (``None``: dim 0).
            Dims other than 0 must divide evenly by the shard-mesh size.
        mp_policy / offload_policy: see :class:`MixedPrecisionPolicy` / ``CPUOffloadPolicy``.
        ignored_params: parameters left alone (not sharded, not moved, grads not reduced).

    Every argument is checked before the module is changed.
    """
    _validate_module(module, "fully_shard")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, not {type(mp_policy)}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, not {type(offload_policy)}")
    modules = (module,) if isinstance(module, nn.Module) else tuple(_get_root_modules(module))
    for m in modules:
        if _get_module_fsdp_state(m) is not None:
            raise AssertionError(
                "Each distinct composable distributed API can only be applied to a module "
                f"once. fully_shard has already been applied to the following module:\n{m}"
            )
    mesh = mesh or _init_default_mesh()
    mesh_info, device = _get_mesh_info(mesh), _get_device_from_mesh(mesh)
    auto_reshard_after_forward = reshard_after_forward is None
    post_forward_mesh_info = _get_post_forward_mesh_info(
        True if auto_reshard_after_forward else reshard_after_forward, mesh_info
    )
    managed_modules = _get_managed_modules(modules, _get_module_fsdp_state)
    params, buffers = _get_managed_states(managed_modules, ignored_params)
    # Validate before the move below, which is the first change; the user's function runs once
    # per parameter (the move keeps the Parameter objects, so the FSDPParams look it up).
    placements = {p: _resolve_shard_placement(p, shard_placement_fn, mesh_info) for p in params}
    _move_states_to_device([*params, *buffers], device)
    group = None
    if params:  # builds and validates every FSDPParam before registering any of them
        group = FSDPParamGroup(
            params, modules, mesh_info, post_forward_mesh_info, device,
            placements.get, mp_policy, offload_policy,
        )  # fmt: skip
    state = FSDPState(modules, device, mp_policy, auto_reshard_after_forward)
    state._fsdp_param_group = group
    for m in modules:  # the module holds its state (see the Note); swap in the FSDP<Name> class
        m.__dict__.setdefault(STATE_KEY, {})[fully_shard] = state
        m.__dict__.setdefault(REGISTRY_KEY, {})["fully_shard"] = RegistryItem()
        cls = type(m)
        if cls not in cls_to_fsdp_cls:
            dct = {"__deepcopy__": _unimplemented_deepcopy}
            cls_to_fsdp_cls[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), dct)
        m.__class__ = cls_to_fsdp_cls[cls]
    return module


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")


class FSDPModule:
    """Mixed into every module ``fully_shard`` was applied to (``FSDP<Name>``)."""

    def __new__(cls, *args, **kwargs):
        # Containers build new instances with `type(self)(...)` (e.g. slicing nn.Sequential):
        # those are plain modules of the original class, not FSDP modules.
        orig_cls = cls.__mro__[2]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        if (group := self._get_fsdp_state()._fsdp_param_group) is not None:
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (not recursive), following ``param_dtype``.

        With ``async_op=True`` returns an :class:`UnshardHandle`; its ``wait()`` (or the next
        pre-forward) finishes the unshard. Otherwise waits and returns ``None``.
        """
        group = self._get_fsdp_state()._fsdp_param_group
        if group is not None:
            group.lazy_init()
            group.unshard(async_op=async_op)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """Recover after ``forward()`` or ``backward()`` raised: call it on the root, then run
        the next iteration as usual (the failed iteration's gradients are lost). On a unit that
        lazy init found not to be the root it raises RuntimeError."""
        self._get_fsdp_state()._reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step (see ``FSDPStateContext``)."""
        self._get_fsdp_state()._state_ctx.is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules`` right after this module's own all-gather in forward (see
        [Note: explicit prefetching] in ``_fsdp_state``)."""
        _assert_all_fsdp_modules(modules)
        states = [m._get_fsdp_state() for m in modules]
        self._get_fsdp_state()._states_to_forward_prefetch = states

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules`` right after this module's own all-gather in backward."""
        _assert_all_fsdp_modules(modules)
        states = [m._get_fsdp_state() for m in modules]
        self._get_fsdp_state()._states_to_backward_prefetch = states

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM collectives and a separate division (not recursive)."""
        for group in self._groups(recurse=False):
            group.force_sum_reduction_for_comms = enable

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatter inputs may be in flight: an int >= 1 (a bool is refused).
        Inert here (see [Note: knobs the reference honours trivially])."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for group in self._groups(recurse):
            group.reduce_scatter_max_input_buffers = max_input_buffers

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Staging buffers from the process group's allocator (inert here, not recursive)."""
        for group in self._groups(recurse=False):
            group.allocate_memory_from_process_group = enable

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True):
        """Reduce-scatter on a process group of its own over the shard ranks (``False``: the
        shared shard group again). Collective: every rank of the mesh calls it."""
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            if not enable:
                group.reduce_scatter_process_group = None
            elif group.reduce_scatter_process_group is None:
                group.reduce_scatter_process_group = _new_shard_group(group.mesh_info, created)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: do not all-gather this module's parameters again in backward (only when no
        gradient computation reads their values, e.g. an embedding; not recursive)."""
        for group in self._groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """Reduce gradients in backward (``True``) or accumulate them unsharded (``False``)."""
        for group in self._groups(recurse):
            group.reduce_grads = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True):
        """Change ``reshard_after_forward`` at run time (a bool; overrides the root default)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(  # noqa: TRY004 (upstream raises ValueError)
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        for module in self.modules() if recurse else [self]:
            if isinstance(module, FSDPModule):
                module._get_fsdp_state()._auto_reshard_after_forward = False
        for group in self._groups(recurse):
            group.post_forward_mesh_info = _get_post_forward_mesh_info(
                reshard_after_forward, group.mesh_info
            )

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        """Whether to free the unsharded parameters after backward (default ``True``)."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """A parameter the forward did not use gets ``.grad`` None (default ``False``), or with
        ``True`` a reduced zero gradient (every rank then joins the same reduce-scatter even when
        control flow differs between ranks)."""
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the reduced gradients by ``factor`` instead of the data-parallel size."""
        for group in self._groups(recurse=False):
            group.gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor`, with the same effect: it warns
        (``DeprecationWarning`` "Use `set_gradient_divide_factor` instead"), then sets the factor."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        """The parameter groups of this module (and, with ``recurse``, of FSDP submodules)."""
        modules = self.modules() if recurse else [self]
        states = [m._get_fsdp_state() for m in modules if isinstance(m, FSDPModule)]
        return [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]

    def _get_fsdp_state(self) -> FSDPState:
        if (state := _get_module_fsdp_state(self)) is None:
            raise AssertionError(f"No FSDP state found on {self}")
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, all or nothing, on the sharded ``DTensor`` s (load
        ``DTensor`` s with the same placements; plain tensors are rejected, spec P8).

        Upstream copies the valid entries before it raises for a bad one; the reference puts every
        parameter and buffer of the module tree back (object, and values unless ``assign=True``,
        which never writes the old tensors) before re-raising, so a failed load changes nothing.
        """
        saved = []
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
                for table in (module._parameters, module._buffers):
                    for name, t in table.items():
                        copy = _snapshot(_local(t)) if t is not None and not assign else None
                        saved.append((table, name, t, copy))
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except Exception:
            with torch.no_grad():
                for table, name, t, copy in saved:
                    table[name] = t
                    if copy is not None:
                        _local(t).copy_(copy)
                self._reset_sharded_params(recurse=True)
            raise

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``to`` / ``to_empty`` / ``cpu`` ...: reshard, apply, then re-pad every shard."""
        self.reshard()
        ret = super()._apply(*args, **kwargs)
        self._reset_sharded_params(recurse=False)
        return ret

    @torch.no_grad()
    def _reset_sharded_params(self, recurse: bool) -> None:
        for group in self._groups(recurse):
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()


class UnshardHandle:
    """A handle on an asynchronous :meth:`FSDPModule.unshard`."""

    def __init__(self, fsdp_param_group: FSDPParamGroup | None = None):
        self._fsdp_param_group = fsdp_param_group

    def wait(self) -> None:
        """Finish the unshard: the unsharded parameters are registered on return."""
        if self._fsdp_param_group is not None:
            self._fsdp_param_group.wait_for_unshard()
            self._fsdp_param_group = None


def _new_shard_group(mesh_info, created: dict) -> dist.ProcessGroup:
    """A new process group over this rank's shard ranks, one per rank set (``created``).

    [Note: one new group per shard row] ``dist.new_group`` is called by every rank of the
    mesh for every shard rank set (each row of the mesh along the shard dim), in the same order,
    so the groups need no rank-local naming; each rank keeps the group of its own row."""
    rows = mesh_info.mesh.mesh.movedim(mesh_info.shard_mesh_dim, -1)
    mine = tuple(dist.get_process_group_ranks(mesh_info.shard_process_group))
    for row in rows.reshape(-1, rows.shape[-1]).tolist():
        if tuple(row) not in created:
            created[tuple(row)] = dist.new_group(row)
    return created[mine]


def _assert_all_fsdp_modules(modules) -> None:
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(module)}: {module}")


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` to roll back to; a parameter subclass is asked only for ops upstream
    also uses on it (``new_zeros``, ``copy_``), not ``clone``."""
    if type(tensor) is torch.Tensor:
        return tensor.clone()
    return tensor.new_zeros(tensor.shape).copy_(tensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's values (a DTensor's local shard, else the tensor)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
