"""Validation of a state dict before an FSDP1 root loads any of it.

Rule: ``load_state_dict`` on an FSDP tree either loads everything or changes nothing. The root's
pre-load hook calls :func:`_validate_load_input` before the first tensor is copied; it collects
every problem and raises one ``RuntimeError`` that names each key and what to change:

* a key the model expects is absent and ``strict=True`` (and, with ``strict=True``, a key the model
  does not have);
* a parameter or buffer of the wrong shape (dtypes may differ: loading casts);
* a value of the wrong kind for the state-dict type in effect: FULL wants plain tensors, SHARDED
  wants ``ShardedTensor`` (``DTensor`` with a device mesh) of the parameter's full shape whose
  local shard is this rank's ``torch.chunk``, LOCAL wants a 1-D ``ShardedTensor`` of the flat
  parameter's unpadded numel whose local shard is this rank's unpadded range.

(Upstream copies tensors as ``nn.Module.load_state_dict`` walks the tree and reports problems at the
end, after earlier entries were written; this check is the reference's addition.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from reference._fsdp1._common_utils import _FSDPState, clean_tensor_name
from reference._fsdp1._flat_param import FlatParameter
from reference.api import ShardingStrategy, StateDictType


def _effective_type(fsdp: _FSDPState) -> StateDictType:
    if fsdp.sharding_strategy == ShardingStrategy.NO_SHARD:
        return StateDictType.FULL_STATE_DICT
    return fsdp._state_dict_type


def _expected_entries(root: _FSDPState, prefix: str) -> dict[str, tuple]:
    """Key -> ``(kind, shape, fsdp)`` for every tensor the tree expects; ``kind`` is "param"
    (FSDP-managed original parameter), "flat" (LOCAL flat parameter) or "plain" (buffer or
    parameter of an ignored module)."""
    expected: dict[str, tuple] = {}
    managed_ids: set[int] = set()
    for mod_name, fsdp in root.named_modules():
        if not isinstance(fsdp, _FSDPState):
            continue
        base = prefix + (clean_tensor_name(mod_name + ".") if mod_name else "")
        handle = fsdp._handle
        for fqn, owner, name in fsdp._owned_buffers:
            if name not in owner._non_persistent_buffers_set:
                expected[base + fqn] = (
                    "plain",
                    tuple(owner._buffers[name].shape),
                    fsdp,
                )
        if handle is None:
            continue
        fp = handle.flat_param
        managed_ids.add(id(fp))
        managed_ids.update(id(p) for p in handle._orig_params)
        if _effective_type(fsdp) == StateDictType.LOCAL_STATE_DICT:
            expected[base + "_flat_param"] = (
                "flat",
                (fp._unpadded_unsharded_size[0],),
                fsdp,
            )
            continue
        for _, module_name, name, index in handle._all_names():
            fqn = clean_tensor_name(f"{module_name}.{name}" if module_name else name)
            expected[base + fqn] = ("param", tuple(fp._shapes[index]), fsdp)
    # Every other parameter (ignored ones) and every persistent buffer is loaded as it is.
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        base = prefix + (clean_tensor_name(mod_name + ".") if mod_name else "")
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in managed_ids and not isinstance(p, FlatParameter):
                expected[base + name] = ("plain", tuple(p.shape), None)
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                expected[base + name] = ("plain", tuple(b.shape), None)
    return expected


def _problem(key: str, kind: str, shape: tuple, fsdp: Any, value: Any) -> str | None:
    """What is wrong with ``value`` for ``key`` (``None`` when it is acceptable)."""
    if not isinstance(value, torch.Tensor):
        return f"key '{key}': expected a tensor but got {type(value).__name__}"
    is_st = isinstance(value, ShardedTensor)
    is_dt = type(value).__name__ == "DTensor"
    got = tuple(value.size()) if not is_dt else tuple(value.shape)
    sd_type = _effective_type(fsdp) if fsdp is not None else StateDictType.FULL_STATE_DICT
    name = sd_type.name
    if kind == "plain" or sd_type == StateDictType.FULL_STATE_DICT:
        if is_st or is_dt:
            return (
                f"key '{key}': got a {type(value).__name__} but {name} expects a plain tensor; "
                "load it under the state-dict type it was saved with, or gather it to a full "
                "tensor first"
            )
        if got != shape:
            return f"key '{key}': expected shape {shape} but got {got}; fix the checkpoint/model"
        return None
    if kind == "param" and fsdp._device_mesh is not None:
        if not is_dt:
            return f"key '{key}': {name} with a device_mesh expects a DTensor, got {type(value)}"
        if got != shape:
            return f"key '{key}': expected global shape {shape} but got {got}"
        return None
    if not is_st:
        return (
            f"key '{key}': {name} expects a ShardedTensor but got {type(value).__name__}; load "
            "a full tensor under FULL_STATE_DICT, or save this checkpoint with "
            f"FSDP.state_dict_type(model, StateDictType.{name})"
        )
    if got != shape:
        return f"key '{key}': expected global shape {shape} but got {got}; fix the checkpoint"
    shards = value.local_shards()
    want = _expected_local_numel(kind, shape, fsdp)
    have = shards[0].tensor.numel() if shards else 0
    if len(shards) > 1 or have != want:
        return (
            f"key '{key}': this rank (rank {fsdp.rank} of {fsdp.world_size}) should hold a local "
            f"shard of {want} elements but holds {have} in {len(shards)} shard(s); the checkpoint "
            "was saved with another world size, reshard it first"
        )
    return None


def _expected_local_numel(kind: str, shape: tuple, fsdp: Any) -> int:
    if kind == "flat":
        fp = fsdp._handle.flat_param
        return fp.numel() - fp._shard_numel_padded
    rows = shape[0]
    step = math.ceil(rows / fsdp.world_size)
    mine = max(0, min(step, rows - step * fsdp.rank))
    return mine * math.prod(shape[1:])


def _validate_load_input(
    root: _FSDPState,
    state_dict: dict[str, Any],
    prefix: str,
    strict: bool,
) -> None:
    """Raise ``RuntimeError`` listing every problem of ``state_dict`` for the tree of ``root``."""
    expected = _expected_entries(root, prefix)
    problems = []
    for key, (kind, shape, fsdp) in expected.items():
        if key not in state_dict:
            if strict:
                problems.append(
                    f"missing key '{key}': add it to the state dict or load with strict=False"
                )
            continue
        problem = _problem(key, kind, shape, fsdp, state_dict[key])
        if problem:
            problems.append(problem)
    if strict:
        for key in state_dict:
            if key.startswith(prefix) and key not in expected and not key.endswith("_extra_state"):
                problems.append(f"unexpected key '{key}': remove it or load with strict=False")
    if problems:
        raise RuntimeError(
            "FSDP load_state_dict rejected the state dict before changing any parameter:\n  "
            + "\n  ".join(problems)
        )
