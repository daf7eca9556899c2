"""FSDP1 state-dict hooks: FULL, SHARDED and LOCAL save and load, registered on every FSDP module.

[Note: how the hooks ride on nn.Module.state_dict]
  ``nn.Module.state_dict()`` visits modules parent first. On an FSDP module it calls the *pre-save*
  hook, saves the module's own tensors, recurses, then calls the *post-save* hook with the whole
  dict. The keys it produces carry ``_fsdp_wrapped_module.``; the post-save hook of the FSDP module
  at ``prefix`` rewrites ``prefix + "_fsdp_wrapped_module."`` to ``prefix`` (deeper FSDP modules
  have already cleaned their part), so the final keys equal those of the unwrapped model.

  FULL and SHARDED need the original parameters, so pre-save *enters* an unshard (the original
  names become full-shape ``nn.Parameter`` views and ``_flat_param`` is hidden) and post-save
  converts the entries and *exits* it. LOCAL needs no unshard: ``_flat_param`` itself is saved.

  Loading is the mirror image: the *pre-load* hook of the FSDP module at ``prefix`` rewrites
  ``prefix`` to ``prefix + "_fsdp_wrapped_module."`` so that ``nn.Module`` finds the tensors,
  converts SHARDED/LOCAL values into what ``nn.Module`` will copy, and (FULL/SHARDED) enters an
  unshard with writeback; the *post-load* hook exits it (this rank's range is copied back into
  the shard) and strips wrapper prefixes from the reported missing/unexpected keys.

[Note: NO_SHARD]  A NO_SHARD module has nothing to shard, so every hook runs as FULL_STATE_DICT
with a default ``FullStateDictConfig`` and warns (texts as upstream, including the missing space
in the load warning).

The root's pre-load hook first validates the whole input (``_load_checks``): a bad dict
raises before any tensor is written.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
    init_from_local_shards,
)
from torch.distributed._shard.sharding_spec import ShardMetadata

from reference._fsdp1._collectives import all_gather_single
from reference._fsdp1._common_utils import FSDP_PREFIX, _FSDPState, _warn, clean_tensor_name
from reference._fsdp1._flat_param import FLAT_PARAM
from reference._fsdp1._load_checks import _validate_load_input
from reference._fsdp1._runtime_utils import _lazy_init, _unshard_fsdp_state_params
from reference.api import FullStateDictConfig, ShardingStrategy, StateDictType

FULL, LOCAL, SHARDED = (
    StateDictType.FULL_STATE_DICT,
    StateDictType.LOCAL_STATE_DICT,
    StateDictType.SHARDED_STATE_DICT,
)


def _replace_by_prefix(state_dict: dict[str, Any], old: str, new: str) -> None:
    """Rename keys starting with ``old`` to start with ``new`` (renamed keys move to the end)."""
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old) :]] = state_dict.pop(key)


def _param_fqns(state: _FSDPState) -> Iterator[tuple[str, int]]:
    """Clean FQN (relative to the FSDP module) and parameter index of every managed name,
    primaries first, then shared aliases."""
    handle = state._handle
    if handle is None:
        return
    for _, module_name, name, index in handle._all_names():
        yield clean_tensor_name(f"{module_name}.{name}" if module_name else name), index


@contextlib.contextmanager
def _effective_type(state: _FSDPState, load: bool) -> Iterator[None]:
    """Run a hook as FULL (default config) under NO_SHARD, with upstream's warning."""
    if state.sharding_strategy != ShardingStrategy.NO_SHARD:
        yield
        return
    sep = "" if load else " "
    _warn(
        f"When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will{sep}be returned."
    )
    saved = state._state_dict_type, state._state_dict_config
    state._state_dict_type, state._state_dict_config = FULL, FullStateDictConfig()
    try:
        yield
    finally:
        state._state_dict_type, state._state_dict_config = saved


def _set_use_dtensor(state: _FSDPState) -> None:
    if state._device_mesh is None:
        return
    if state._state_dict_type == LOCAL:
        raise RuntimeError(
            "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with "
            "LOCAL_STATE_DICT. Please set state_dict_type to SHARDED_STATE_DICT to get DTensor "
            "state_dict."
        )
    if state._state_dict_type == SHARDED:
        state._state_dict_config._use_dtensor = True


def _enter_unshard(state, writeback: bool, rank0_only: bool, offload_to_cpu: bool) -> None:
    if getattr(state, "_unshard_stack", None) is not None:
        raise AssertionError("An unshard for the state dict is already active on this module")
    stack = contextlib.ExitStack()
    stack.enter_context(_unshard_fsdp_state_params(state, writeback, rank0_only, offload_to_cpu))
    state._unshard_stack = stack


def _exit_unshard(state) -> None:
    stack, state._unshard_stack = state._unshard_stack, None
    if stack is not None:
        stack.close()


def _check_local_supported(state) -> None:
    if state._handle is not None and not state._handle.uses_sharded_strategy:
        raise RuntimeError(
            "``local_state_dict`` can only be used when parameters are flatten and sharded."
        )
    if state._use_orig_params and state._handle is not None:
        raise RuntimeError(
            "LOCAL_STATE_DICT is not supported with use_orig_params=True (upstream leaves it "
            "undefined); use SHARDED_STATE_DICT or FULL_STATE_DICT instead"
        )


# -- save -----------------------------------------------------------------------------------------


@torch.no_grad()
def _pre_state_dict_hook(module: _FSDPState, *args: Any, **kwargs: Any) -> None:
    state = module
    if state.sharding_strategy != ShardingStrategy.NO_SHARD:
        _set_use_dtensor(state)
    with _effective_type(state, load=False):
        _lazy_init(state)
        config = state._state_dict_config
        if state._state_dict_type == FULL:
            _enter_unshard(state, False, config.rank0_only, config.offload_to_cpu)
        elif state._state_dict_type == SHARDED:
            # Offloading happens after the ShardedTensor is built, never in the unshard.
            _enter_unshard(state, False, False, False)
        else:
            _check_local_supported(state)


@torch.no_grad()
def _post_state_dict_hook(
    module: _FSDPState,
    state_dict: dict[str, Any],
    prefix: str,
    *args: Any,
) -> dict[str, Any]:
    state = module
    with _effective_type(state, load=False):
        _replace_by_prefix(state_dict, prefix + FSDP_PREFIX, prefix)
        if state._state_dict_type == LOCAL:
            _local_post_state_dict(state, state_dict, prefix)
        else:
            _unshard_post_state_dict(state, state_dict, prefix)
    return state_dict


def _unshard_post_state_dict(state, state_dict: dict[str, Any], prefix: str) -> None:
    """FULL/SHARDED: convert each parameter entry, leave the unshard, then fix the buffers."""
    config = state._state_dict_config
    full = state._state_dict_type == FULL
    offload = config.offload_to_cpu
    drop = full and config.rank0_only and state.rank != 0
    try:
        for fqn, _ in _param_fqns(state):
            key = prefix + fqn
            if key not in state_dict and not drop:  # a state_dict hook took it out (R86)
                raise AssertionError(
                    f"FSDP assumes {key} is in the state_dict but the state_dict only has "
                    f"{list(state_dict)}"
                )
            if drop:
                state_dict.pop(key, None)
            elif full:
                # A copy, never a view of the gathered tensor (which is freed on exit).
                value = state_dict[key].detach()
                state_dict[key] = value.to("cpu", copy=True) if offload else value.clone()
            else:
                state_dict[key] = _shard_for_save(state, state_dict[key], offload)
        if drop:
            state_dict.pop(prefix + FLAT_PARAM, None)
    finally:
        _exit_unshard(state)
    buffer_dtype = state.mixed_precision.buffer_dtype if state.mixed_precision else None
    for fqn, _, _ in state._owned_buffers:
        key = prefix + fqn
        if key not in state_dict:  # non-persistent
            continue
        if drop:
            state_dict.pop(key)
            continue
        value = state_dict[key]
        if offload:
            value = value.to("cpu")
        if buffer_dtype is not None and fqn not in state._ignored_buffer_names:
            # Saved in the dtype the buffer had before lazy init cast it (each its own clone).
            value = value.to(state._buffer_name_to_orig_dtype[fqn]).clone()
        state_dict[key] = value


def _shard_for_save(state, full: torch.Tensor, offload: bool) -> Any:
    """SHARDED value of one full parameter: this rank's ``torch.chunk`` along dim 0, offsets
    ``ceil(d0 / world_size) * rank``; a ``DTensor`` with ``(Shard(0),)`` when built with a mesh."""
    ws, rank = state.world_size, state.rank
    chunks = full.chunk(ws, dim=0)
    step = math.ceil(full.size(0) / ws)
    empty = full.new_empty((0, *full.shape[1:]))
    local = (chunks[rank] if rank < len(chunks) else empty).clone()
    if offload:
        local = local.cpu()
    if state._state_dict_config._use_dtensor:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import Shard as DShard

        return DTensor.from_local(
            local,
            state._device_mesh,
            [DShard(0)],
            shape=full.shape,
            stride=full.stride(),
        )
    device = local.device
    shards_md = []
    for r, chunk in enumerate(chunks):
        global_rank = dist.get_global_rank(state.process_group, r)
        placement = f"rank:{global_rank}/{_placement_device(device, global_rank)}"
        offsets = [r * step] + [0] * (full.dim() - 1)
        shards_md.append(ShardMetadata(offsets, list(chunk.size()), placement))
    local_shards = []
    if rank < len(chunks):
        local_shards = [Shard(local, shards_md[rank])]
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_md,
        size=full.size(),
        tensor_properties=TensorProperties(dtype=full.dtype, layout=full.layout),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards,
        sharded_tensor_metadata=metadata,
        process_group=state.process_group,
    )


def _placement_device(device: torch.device, global_rank: int) -> str:
    """Device part of a shard placement: ``cpu``, or ``<type>:<rank mod local device count>``."""
    if device.type == "cpu":
        return "cpu"
    count = torch.get_device_module(device.type).device_count()
    return f"{device.type}:{global_rank % max(count, 1)}"


def _local_post_state_dict(state, state_dict: dict[str, Any], prefix: str) -> None:
    """LOCAL: the flat shard without its padding, as a 1-D ShardedTensor of the unpadded numel
    at offset ``C * rank`` (no copy; pure-padding ranks hold no local shard). A flat parameter of
    no elements (every managed parameter has numel 0) is one empty shard on rank 0: a
    ShardedTensor needs a shard somewhere."""
    handle = state._handle
    if handle is None:
        return
    fp = handle.flat_param
    valid = fp.numel() - fp._shard_numel_padded
    shards = []
    no_elements = fp._unpadded_unsharded_size.numel() == 0
    if valid > 0 or (no_elements and state.rank == 0):
        shards = [
            Shard.from_tensor_and_offsets(
                fp[:valid].view(valid), [fp.numel() * state.rank], state.rank
            )
        ]
    st = init_from_local_shards(
        shards, fp._unpadded_unsharded_size.numel(), process_group=state.process_group
    )
    state_dict[prefix + FLAT_PARAM] = st.cpu() if state._state_dict_config.offload_to_cpu else st


# -- load -----------------------------------------------------------------------------------------


@torch.no_grad()
def _pre_load_state_dict_hook(
    module: _FSDPState,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    *args: Any,
) -> None:
    state = module
    if state.sharding_strategy != ShardingStrategy.NO_SHARD:
        _set_use_dtensor(state)
    _lazy_init(state)
    if state._is_root:
        # Missing/unexpected keys are only checked when load_state_dict was called on this
        # FSDP module itself (the hooks are always told strict=True by nn.Module).
        _validate_load_input(state, state_dict, prefix, bool(state._load_strict))
    with _effective_type(state, load=True):
        _replace_by_prefix(state_dict, prefix, prefix + FSDP_PREFIX)
        if state._state_dict_type == FULL:
            _enter_unshard(state, True, False, False)
        elif state._state_dict_type == LOCAL:
            _check_local_supported(state)
            _local_pre_load(state, state_dict, prefix + FSDP_PREFIX)
        else:
            _sharded_pre_load(state, state_dict, prefix + FSDP_PREFIX)
            _enter_unshard(state, True, False, False)


def _local_pre_load(state, state_dict: dict[str, Any], wrapped_prefix: str) -> None:
    """Replace the LOCAL ShardedTensor by this rank's padded shard (what ``_flat_param`` holds)."""
    key = wrapped_prefix + FLAT_PARAM
    if state._handle is None or key not in state_dict:
        return
    fp = state._handle.flat_param
    shards = state_dict[key].local_shards()
    if not shards:  # a pure-padding rank: nothing of the flat parameter lives here
        state_dict[key] = fp.detach()
        return
    local = shards[0].tensor.reshape(-1).to(fp.device)
    state_dict[key] = F.pad(local, [0, fp.numel() - local.numel()])


def _sharded_pre_load(state, state_dict: dict[str, Any], wrapped_prefix: str) -> None:
    """Turn each SHARDED value into the full parameter: pad the local chunk to
    ``ceil(d0 / world_size)`` rows, all-gather, keep the first ``d0`` rows. A rank holds at most
    one local shard of each value (the root's load checks refuse others first; a load through a
    non-root unit meets this refusal instead)."""
    for fqn, _ in _param_fqns(state):
        key = wrapped_prefix + fqn
        if key not in state_dict:
            _warn(f"Did not find param with FQN {key}, skipping it.")
            continue
        value = state_dict[key]
        if state._state_dict_config._use_dtensor:
            state_dict[key] = value.full_tensor().to(state.compute_device)
            continue
        shape = value.size()
        if shape.numel() == 0:  # nothing to gather (the shape is the same on every rank)
            state_dict[key] = torch.empty(shape, dtype=value.dtype, device=state.compute_device)
            continue
        chunk_numel = math.ceil(shape[0] / state.world_size) * shape.numel() // shape[0]
        shards = value.local_shards()
        if len(shards) > 1:
            raise RuntimeError(
                f"SHARDED_STATE_DICT load: {key} holds {len(shards)} local shards on rank "
                f"{state.rank}; a rank must hold at most one (reshard the checkpoint first)"
            )
        if shards:
            local = shards[0].tensor.reshape(-1).to(state.compute_device)
            local = F.pad(local, [0, chunk_numel - local.numel()])
        else:
            local = torch.zeros(chunk_numel, dtype=value.dtype, device=state.compute_device)
        gathered = local.new_empty(chunk_numel * state.world_size)
        all_gather_single(gathered, local, state.process_group)
        state_dict[key] = gathered[: shape.numel()].view(shape)


@torch.no_grad()
def _post_load_state_dict_hook(module: _FSDPState, incompatible_keys: Any) -> None:
    state = module
    with _effective_type(state, load=True):
        if state._state_dict_type != LOCAL:
            _exit_unshard(state)
    missing, unexpected = incompatible_keys
    missing[:] = [clean_tensor_name(k) for k in missing]
    unexpected[:] = [clean_tensor_name(k) for k in unexpected]


def _register_all_state_dict_hooks(state: _FSDPState) -> None:
    """Pre/post save and pre/post load hooks, registered on the FSDP module itself."""
    state._unshard_stack = None
    state.register_state_dict_pre_hook(_pre_state_dict_hook)
    state._register_state_dict_hook(_post_state_dict_hook)
    state._register_load_state_dict_pre_hook(_pre_load_state_dict_hook, with_module=True)
    state.register_load_state_dict_post_hook(_post_load_state_dict_hook)
