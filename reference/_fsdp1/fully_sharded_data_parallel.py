"""``FullyShardedDataParallel``: the flat-parameter FSDP wrapper (FSDP1), reduced to its contract.

[Note: the FSDP1 module tree]
  ``FSDP(module)`` becomes the parent of ``module`` under the child name ``_fsdp_wrapped_module``.
  The parameters of ``module`` that are not owned by a nested FSDP module or by an ignored module
  are *managed*: they are flattened into one :class:`~reference._fsdp1._flat_param.FlatParameter`
  registered as ``_fsdp_wrapped_module._flat_param`` (``use_orig_params=False``; the original
  names disappear from the module until an unshard) or kept as 1-D sharded views under their own
  names (``use_orig_params=True``). ``FSDP(Sequential(FSDP(lin1), lin2))`` therefore has the two
  flat parameters ``_fsdp_wrapped_module._flat_param`` (lin2) and
  ``_fsdp_wrapped_module.0._fsdp_wrapped_module._flat_param`` (lin1).

  *Root*: an FSDP module with no FSDP ancestor. Wrapping marks every FSDP module inside as
  non-root. The root lazily initialises the tree on first use (see ``_runtime_utils``).

  *Owned buffers*: buffers of the wrapped module outside nested FSDP modules and ignored modules;
  buffer mixed precision applies to them and state dicts restore their original dtype.

Behaviour kept from upstream (torch 2.13): a process group of size 1 runs NO_SHARD with a warning;
NO_SHARD on more ranks warns that it is deprecated; state dicts turn into FULL under NO_SHARD (see
``_state_dict_utils``). ``sync_module_states=True`` broadcasts rank 0's managed parameters and owned
buffers before flattening (on any device; upstream refuses CPU modules). Left out: CPU offload of
parameters, HYBRID_SHARD, ``param_init_fn``, prefetching, optimizer-state APIs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from reference._fsdp1._clip_grad_utils import _clip_grad_norm
from reference._fsdp1._common_utils import (
    FSDP_WRAPPED_MODULE,
    _fsdp_modules,
    _FSDPState,
    _warn,
    clean_tensor_name,
)
from reference._fsdp1._flat_param import FlatParameter, FlatParamHandle
from reference._fsdp1._init_utils import (
    _clamp_strategy,
    _compute_device,
    _managed_tensors,
    _materialize_with_init_fn,
    _materialize_with_reset_parameters,
)
from reference._fsdp1._runtime_utils import (
    TrainingState,
    _forward,
    _lazy_init,
    _read_orig_param,
    _unshard_params,
)
from reference._fsdp1._state_dict_utils import _register_all_state_dict_hooks
from reference.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from reference.wrap._wrap_utils import _auto_wrap, _get_ignored_states

__all__ = ["FullyShardedDataParallel"]

_CONFIG_TYPES = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (
        ShardedStateDictConfig,
        ShardedOptimStateDictConfig,
    ),
}


class FullyShardedDataParallel(_FSDPState):
    """Shard ``module`` 's managed parameters over ``process_group`` as one flat parameter.

    Attributes::

        _fsdp_wrapped_module: nn.Module
        _handle: FlatParamHandle | None          # None when no parameter is managed
        process_group: dist.ProcessGroup
        rank, world_size: int
        sharding_strategy: ShardingStrategy      # after the world-size-1 clamp
        mixed_precision: MixedPrecision | None
        compute_device: torch.device
        _use_orig_params: bool
        _is_root, _ran_as_root: bool             # the latter: a forward ran with it as the root
        _ignored_modules: set[nn.Module]         # every module under an ignored module
        _ignored_params: set[nn.Parameter]       # their parameters + parameters ignored directly
        _owned_buffers: list[tuple[str, nn.Module, str]]  # (clean fqn, owner module, name)
        _buffer_name_to_orig_dtype: dict[str, torch.dtype]
        _state_dict_type: StateDictType
        _state_dict_config: StateDictConfig
        training_state: TrainingState
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Any = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Module] | None = None,
        device_mesh: Any = None,
    ) -> None:
        if isinstance(module, FullyShardedDataParallel):
            raise TypeError(
                "FSDP was given a module that is already a FullyShardedDataParallel; wrap the "
                "inner module once (or wrap a parent module instead)"
            )
        if cpu_offload is not None and cpu_offload.offload_params:
            raise NotImplementedError("The reference FSDP does not implement CPUOffload")
        if ignored_modules is not None and ignored_states is not None:
            raise ValueError("Cannot pass both ignored_modules and ignored_states")
        if process_group is not None and device_mesh is not None:
            raise ValueError("Cannot pass both process_group and device_mesh")
        super().__init__()
        if device_mesh is not None and device_mesh.ndim != 1:
            raise NotImplementedError("The reference FSDP supports 1-D device meshes only")
        group = device_mesh.get_group() if device_mesh is not None else process_group
        self.process_group = group or dist.distributed_c10d._get_default_group()
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self.sharding_strategy = _clamp_strategy(sharding_strategy, self.world_size)
        self.mixed_precision = mixed_precision
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self.cpu_offload = cpu_offload or CPUOffload()
        self._use_orig_params = use_orig_params
        self._device_mesh = device_mesh
        self._is_root = True
        self._lazy_init_done = self._ran_as_root = False
        self._load_strict: bool | None = None  # set while this module's load_state_dict runs
        self.training_state = TrainingState.IDLE
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config: StateDictConfig = FullStateDictConfig()
        self._optim_state_dict_config: OptimStateDictConfig = FullOptimStateDictConfig()
        # ignored_states of modules count as ignored_modules; anything else must be parameters
        states = list(ignored_states if ignored_states is not None else ignored_modules or [])
        try:  # they are kept as a set: an unhashable module (one defining __eq__ only) cannot be
            set(states)
        except TypeError as exc:
            raise TypeError(
                "`ignored_modules` should be an iterable of hashable `torch.nn.Module`s but got "
                f"{[type(s) for s in states]}"
            ) from exc
        as_modules = ignored_states is None or all(isinstance(s, nn.Module) for s in states)
        self._ignored_modules, self._ignored_params = _get_ignored_states(
            module, states if as_modules else (), () if as_modules else states
        )

        # Reject what the flat parameter cannot hold before anything is wrapped or moved.
        for name, p in module.named_parameters():
            if p.dim() == 0 and p not in self._ignored_params:
                raise ValueError(
                    f"FSDP cannot flatten the scalar (0-dim) parameter {clean_tensor_name(name)}; "
                    "give it shape (1,) or put its module in ignored_modules"
                )

        if auto_wrap_policy is not None:
            root_kwargs = {
                "process_group": process_group,
                "sharding_strategy": sharding_strategy,
                "cpu_offload": cpu_offload,
                "backward_prefetch": backward_prefetch,
                "mixed_precision": mixed_precision,
                "param_init_fn": param_init_fn,
                "device_id": device_id,
                "sync_module_states": sync_module_states,
                "forward_prefetch": forward_prefetch,
                "limit_all_gathers": limit_all_gathers,
                "use_orig_params": use_orig_params,
                "ignored_states": self._ignored_params,  # children skip them too
                "device_mesh": device_mesh,
            }
            _auto_wrap(
                module,
                auto_wrap_policy,
                self._ignored_modules,
                self._ignored_params,
                root_kwargs,
                FullyShardedDataParallel,
            )

        if param_init_fn is not None:
            _materialize_with_init_fn(module, param_init_fn, self._ignored_modules)
        else:
            device = torch.device("cpu" if device_id is None else device_id)
            _materialize_with_reset_parameters(module, device, self._ignored_modules)
        params, self._owned_buffers = _managed_tensors(
            module, self._ignored_modules, self._ignored_params
        )
        self.compute_device = _compute_device(device_id, params, module)
        for p in params:
            if p.device != self.compute_device:
                p.data = p.data.to(self.compute_device)
        for _, owner, name in self._owned_buffers:
            owner._buffers[name] = owner._buffers[name].to(self.compute_device)
        if sync_module_states:
            src = dist.get_global_rank(self.process_group, 0)
            for t in [p.data for p in params] + [o._buffers[n] for _, o, n in self._owned_buffers]:
                for part in _plain_parts(t):
                    dist.broadcast(part, src=src, group=self.process_group)
        self._buffer_name_to_orig_dtype = {
            fqn: owner._buffers[name].dtype for fqn, owner, name in self._owned_buffers
        }
        self._ignored_buffer_names = {
            clean_tensor_name(f"{mod_name}.{b}" if mod_name else b)
            for mod_name, m in module.named_modules()
            if m in self._ignored_modules
            for b, _ in m.named_buffers(recurse=False)
        }
        self._handle: FlatParamHandle | None = None
        if params:
            mp = mixed_precision or MixedPrecision()
            self._handle = FlatParamHandle(
                params,
                module,
                self.process_group,
                sharded=self.sharding_strategy != ShardingStrategy.NO_SHARD,
                use_orig_params=use_orig_params,
                param_dtype=mp.param_dtype,
                reduce_dtype=mp.reduce_dtype,
                keep_low_precision_grads=mp.keep_low_precision_grads,
                reshard_after_forward=self.sharding_strategy == ShardingStrategy.FULL_SHARD,
            )
            if not use_orig_params:
                module._parameters["_flat_param"] = self._handle.flat_param
        for sub in module.modules():
            if isinstance(sub, FullyShardedDataParallel):
                sub._is_root = False
        self._fsdp_wrapped_module = module
        _register_all_state_dict_hooks(self)

    # -- nn.Module plumbing -----------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._modules[FSDP_WRAPPED_MODULE]

    @property
    def _flat_param(self) -> FlatParameter | None:
        return self._handle.flat_param if self._handle is not None else None

    def __getattr__(self, name: str) -> Any:
        """Attributes not found on the wrapper come from the wrapped module (a managed parameter
        read by a parent's forward is gathered first, see ``_runtime_utils``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            read = _read_orig_param(self, name)
            return read if read is not None else getattr(self._modules[FSDP_WRAPPED_MODULE], name)

    def __getitem__(self, key: int) -> Any:
        return self._modules[FSDP_WRAPPED_MODULE].__getitem__(key)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module``'s, but inside ``summon_full_params`` the names lose every
        ``_fsdp_wrapped_module.`` (upstream's rule, so they match the unwrapped model)."""
        clean = self.training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, param in super().named_parameters(*args, **kwargs):
            yield (name.replace(f"{FSDP_WRAPPED_MODULE}.", "") if clean else name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Buffer names, cleaned like :meth:`named_parameters` inside ``summon_full_params``."""
        clean = self.training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, buf in super().named_buffers(*args, **kwargs):
            yield (name.replace(f"{FSDP_WRAPPED_MODULE}.", "") if clean else name), buf

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _forward(self, *args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, remembering ``strict`` for the up-front validation
        (``nn.Module`` hands its hooks ``strict=True`` whatever the caller passed)."""
        self._load_strict = strict
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            self._load_strict = None

    # -- traversal --------------------------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FSDP module in ``module`` 's tree (``modules()`` order), or only the roots."""
        found = _fsdp_modules(module)
        return [m for m in found if m._is_root] if root_only else found

    def check_is_root(self) -> bool:
        """Whether this unit is a root: no FSDP module above it. Wrapping marks every FSDP
        module it contains as non-root, so the answer is known before the first forward."""
        return self._is_root

    def apply(self, fn: Any) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with the full parameters: ``fn`` runs on every module inside
        :meth:`summon_full_params` (``writeback=True``), so it sees each original parameter
        with its global shape, and an in-place change it makes lands in every rank's shard."""
        if self.training_state == TrainingState.SUMMON_FULL_PARAMS:  # a nested unit: the
            return super().apply(fn)  # enclosing apply already unsharded it
        with _unshard_params(self, True, True, False, False, False):
            return super().apply(fn)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """Replace every unit's gradient reduction (root only, before training): a unit that
        shards calls ``hook(state, unsharded_grad, output)`` and must write its shard of the
        reduced gradient into ``output``; one that does not (NO_SHARD, world size 1) calls
        ``hook(state, grad)``, which reduces ``grad`` in place. Nothing divides by the world
        size any more: the hook decides."""
        if not self._is_root:
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        if not callable(hook):
            raise ValueError(f"The communication hook must be callable but got {hook}")
        for unit in _fsdp_modules(self):
            if unit._handle is not None:
                if unit._handle.comm_hook is not None:
                    raise AssertionError("A communication hook is already registered")
                unit._handle.comm_hook = (hook, state)

    # -- gradient accumulation --------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside skip the gradient reduction: each flat parameter accumulates its
        unsharded gradient locally, and the first backward after the context reduces the sum.
        Only on a root (it covers every FSDP module of the tree)."""
        if not self._is_root:
            raise RuntimeError(
                "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` "
                "on root FSDP module."
            )
        self._assert_idle()
        handles = [m._handle for m in _fsdp_modules(self) if m._handle is not None]
        before = [h._sync_gradients for h in handles]
        for h in handles:
            h._sync_gradients = False
        try:
            yield
        finally:
            for h, flag in zip(handles, before):
                h._sync_gradients = flag

    # -- gradient clipping ------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole tree as ``torch.nn.utils.clip_grad_norm_`` would clip
        the unsharded gradients, and return their total norm (see ``_clip_grad_utils``). Only on a
        root, outside forward/backward and summon; every rank must call it (collectives)."""
        _lazy_init(self)
        if not self._is_root:
            raise RuntimeError(
                "`clip_grad_norm_()` should only be called on the root FSDP instance"
            )
        self._assert_idle()
        return _clip_grad_norm(self, max_norm, norm_type)

    def _assert_idle(self) -> None:
        """Refuse (ValueError, upstream's type) a call made inside forward, backward or
        ``summon_full_params``: the parameters are not in their sharded resting state."""
        if self.training_state != TrainingState.IDLE:
            raise ValueError(
                f"expected to be in states [{TrainingState.IDLE}] but current state is "
                f"{self.training_state}"
            )

    # -- unshard ----------------------------------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Expose full, unflattened parameters of every FSDP module in the tree (all ranks must
        enter). Changes made inside persist on exit when ``writeback`` (each rank keeps its own
        range). ``with_grads`` (use_orig_params only) also exposes full gradients as ``.grad``."""
        with _unshard_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    # -- state-dict type --------------------------------------------------------------------------

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set the state-dict type (and config) of every FSDP module under ``module``; return the
        previous settings. A config of the wrong class raises ``RuntimeError`` before any change.
        """
        _warn(
            "FSDP.state_dict_type() and FSDP.set_state_dict_type() are deprecated upstream in "
            "favour of torch.distributed.checkpoint.state_dict.get_state_dict/set_state_dict.",
            FutureWarning,
        )
        config_cls, optim_cls = _CONFIG_TYPES[state_dict_type]
        state_dict_config = state_dict_config if state_dict_config is not None else config_cls()
        if optim_state_dict_config is None:
            optim_state_dict_config = optim_cls()
        if type(state_dict_config) is not config_cls:
            raise RuntimeError(
                f"Expected state_dict_config of type {config_cls} but got {type(state_dict_config)}"
            )
        if type(optim_state_dict_config) is not optim_cls:
            raise RuntimeError(
                f"Expected optim_state_dict_config of type {optim_cls} "
                f"but got {type(optim_state_dict_config)}"
            )
        modules = FullyShardedDataParallel.fsdp_modules(module)
        if len({m._state_dict_type for m in modules}) > 1:
            raise AssertionError("All FSDP modules should have the same state_dict_type.")
        prev = (
            StateDictSettings(
                modules[0]._state_dict_type,
                modules[0]._state_dict_config,
                modules[0]._optim_state_dict_config,
            )
            if modules
            else None
        )
        for m in modules:
            m._state_dict_type = state_dict_type
            m._state_dict_config = state_dict_config
            m._optim_state_dict_config = optim_state_dict_config
        return prev

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings | None:
        """The common state-dict settings of the FSDP modules under ``module``; None when there is
        none, AssertionError when two of them differ (as upstream)."""
        settings = None
        for m in FullyShardedDataParallel.fsdp_modules(module):
            mine = StateDictSettings(
                m._state_dict_type, m._state_dict_config, m._optim_state_dict_config
            )
            if settings is None:
                settings = mine
            elif mine != settings:
                raise AssertionError(
                    "All FSDP modules must have the same state dict settings. "
                    f"Got {mine} and {settings}."
                )
        return settings

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Iterator[None]:
        """Use ``state_dict_type`` inside the block; the previous settings come back on exit."""
        prev = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            if prev is not None:
                FullyShardedDataParallel.set_state_dict_type(
                    module,
                    prev.state_dict_type,
                    prev.state_dict_config,
                    prev.optim_state_dict_config,
                )


def _plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: ``t`` itself, or a wrapper subclass's inner tensors
    (``__tensor_flatten__``), so a broadcast reaches every one of them whatever the subclass's
    dispatch does with a collective."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [part for name in names for part in _plain_parts(getattr(t, name))]
