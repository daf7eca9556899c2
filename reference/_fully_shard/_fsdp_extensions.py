"""All-gather extensions: tensor subclasses that choose what FSDP all-gathers (spec P14).

[Note: all-gather extensions]
If the sharded parameter's *local* tensor has ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``
(methods of a tensor subclass, or patched onto the instance), FSDP gathers whatever the pre hook
returns instead of the padded shard and builds the unsharded parameter with the post hook:

* ``fsdp_pre_all_gather(mesh)`` (legacy) or ``fsdp_pre_all_gather(mesh, outer_size,
  outer_stride, module, mp_policy)`` returns ``(all_gather_inputs, metadata)``. ``mesh`` is the
  1-D shard mesh, ``outer_size``/``outer_stride`` the original global size and contiguous stride.
  For an unevenly sharded parameter the 5-argument form must return inputs of the padded shard
  size, so that every rank contributes equally.
* ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` returns ``(unsharded, inner_tensors)``
  the first time; later unshards pass ``out=<the existing unsharded parameter>`` to refill in
  place. ``inner_tensors`` are freed on reshard like the all-gather outputs.

Defining only one of the two hooks is an error.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ._fsdp_common import alloc_storage

if TYPE_CHECKING:
    from ._fsdp_param import FSDPParam


class ExtensionsData(NamedTuple):
    """What the pre hook returned besides the inputs, kept until the post hook runs."""

    all_gather_metadata: Any
    all_gather_input_sizes: list[torch.Size]  # ND, one per all-gather input


def check_extensions(local: torch.Tensor) -> None:
    """Raise if ``local`` (a sharded parameter's local tensor) defines only one of the hooks."""
    if hasattr(local, "fsdp_pre_all_gather") != hasattr(local, "fsdp_post_all_gather"):
        raise AssertionError(
            "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined "
            f"if using all-gather extensions: {local}"
        )


def pre_all_gather(fsdp_param: FSDPParam, local: torch.Tensor) -> list[torch.Tensor]:
    """Call the pre hook in the form it declares and return the 1-D all-gather inputs."""
    signature = inspect.signature(local.fsdp_pre_all_gather)
    mesh = fsdp_param.mesh_info.mesh
    mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]]  # the shard dim
    if len(signature.parameters) == 1:
        inputs, metadata = local.fsdp_pre_all_gather(mesh)
    elif len(signature.parameters) == 5:
        size, stride = fsdp_param._orig_size, fsdp_param._contiguous_orig_stride
        module, mp_policy = fsdp_param._module_info.module, fsdp_param.mp_policy
        inputs, metadata = local.fsdp_pre_all_gather(mesh, size, stride, module, mp_policy)
        padded = fsdp_param.padded_sharded_param_size
        if local.size() != padded and any(t.size() != padded for t in inputs):
            raise AssertionError(
                f"When a parameter is unevenly sharded by FSDP (orig size={size}, FSDP world "
                f"size={fsdp_param.mesh_info.mesh.size()}), fsdp_pre_all_gather must return "
                f"all-gather inputs with the padded sharded size {padded} but got "
                f"{[t.size() for t in inputs]}"
            )
    else:
        raise AssertionError(
            f"Invalid fsdp_pre_all_gather: {signature}\n"
            "Expects fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size, "
            "outer_stride: tuple[int, ...], module: nn.Module, mp_policy: MixedPrecisionPolicy)"
        )
    fsdp_param._extensions_data = ExtensionsData(metadata, [t.size() for t in inputs])
    return [t.view(-1) for t in inputs]


def post_all_gather(fsdp_param: FSDPParam, local: torch.Tensor) -> torch.Tensor | None:
    """Run the post hook: build the unsharded tensor (first time) or refill it (``out=``)."""
    metadata, sizes = fsdp_param._extensions_data
    outputs = tuple(t.view(-1, *s[1:]) for t, s in zip(fsdp_param.all_gather_outputs, sizes))
    dtype = fsdp_param.param_dtype or fsdp_param.orig_dtype
    if hasattr(fsdp_param, "_unsharded_param"):
        for tensor in fsdp_param._unsharded_inner_tensors:
            alloc_storage(tensor)
        local.fsdp_post_all_gather(outputs, metadata, dtype, out=fsdp_param._unsharded_param)
        return None
    unsharded, fsdp_param._unsharded_inner_tensors = local.fsdp_post_all_gather(
        outputs, metadata, dtype
    )
    return unsharded
