"""``FSDPParam``: one original parameter, its shard, and the ways between them.

[Note: FSDP tensors]
For each parameter FSDP keeps five related tensors (the names are used throughout):

* **original parameter**: the ``nn.Parameter`` on the module when ``fully_shard`` is called.
* **sharded parameter** (``sharded_param``): this rank's piece of the original, cut with
  ``torch.chunk`` along the shard dim (dim 0 unless ``shard_placement_fn`` says otherwise) and
  presented as an ``nn.Parameter`` wrapping a ``DTensor`` with the original's global size and
  stride. Its local tensor is a view into ``_sharded_param_data``, a 1-D buffer of the *padded*
  shard size (chunk 0's size) whose tail past this rank's data is zero.
* **all-gather inputs** (``all_gather_inputs``): what this rank contributes to the all-gather:
  the padded 1-D buffer, cast to ``param_dtype`` under mixed precision, or whatever an all-gather
  extension's ``fsdp_pre_all_gather`` returns.
* **all-gather outputs** (``all_gather_outputs``): 1-D tensors of ``world_size`` times the input
  numel, one per input, filled by the group's copy-out.
* **unsharded parameter** (``unsharded_param``): the full parameter used in forward/backward, an
  autograd leaf viewing the all-gather output with the original shape (or built by the
  extension's ``fsdp_post_all_gather``).

[Note: freeing by storage resize]
Autograd may save the unsharded parameter (or views of it) for backward, so FSDP never replaces
it: the ``nn.Parameter`` is created once and refilled in place on every unshard. Resharding frees
its memory with ``untyped_storage().resize_(0)`` on the all-gather outputs, which keeps every
alias valid; unsharding resizes the storage back before the copy-out writes into it.

[Note: parameter subclasses]
A parameter may be a tensor subclass that implements only a few ops (a quantized-training weight
with the all-gather extension hooks). FSDP asks of it no more than upstream does: ``new_zeros``,
``slice``/``view`` and ``copy_`` to build and re-pad its shard (``new_empty`` too upstream, for the
empty chunk of a rank with no rows), ``detach`` to wrap it; everything else goes through its hooks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum, auto

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from ._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_common import (
    FSDPMeshInfo,
    HSDPMeshInfo,
    _get_orig_param_uid,
    _to_dtype_if_needed,
    alloc_storage,
    free_storage,
)
from ._fsdp_extensions import check_extensions, post_all_gather, pre_all_gather
from ._fsdp_init import _resolve_shard_placement
from ._shard_math import contiguous_strides, padded_sharded_size, shard_offset, sharded_size


class ShardedState(Enum):
    """Which of a parameter's forms is registered on its module."""

    SHARDED = auto()
    """The sharded ``DTensor`` parameter: the only parameter memory held."""

    SHARDED_POST_FORWARD = auto()
    """After forward with an int ``reshard_after_forward``: a copy resharded over a smaller group
    (a ``DTensor`` on a 2-D mesh, ``(Replicate(), Shard(0))``), not meant for computation or
    in-place edits. It and the sharded parameter both hold memory."""

    UNSHARDED = auto()
    """The full unsharded parameter (a plain tensor), for forward/backward. It and the sharded
    parameter both hold memory."""


@dataclass
class ParamModuleInfo:
    """Where a parameter lives: ``module._parameters[param_name]``, plus the other owners of a
    parameter reached through several modules (shared module, tied weight), all swapped together."""

    module: nn.Module
    param_name: str
    shared_modules: list[nn.Module] = field(default_factory=list)
    shared_param_names: list[str] = field(default_factory=list)


class FSDPParam:
    """One parameter under FSDP: shards it at construction and moves it between the states.

    Construction validates and shards but does not touch the module: the owning group registers
    the sharded parameter (:meth:`_attach_to_module`) once every parameter of the group is built,
    so that a bad parameter leaves the module as it was.
    """

    orig_dtype: torch.dtype  # set at lazy init, with the clamped dtypes below
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    fsdp_placement: Shard  # Shard(d) with d >= 0
    _tp_spec: DTensorSpec | None  # a tensor-parallel parameter's spec on the TP mesh
    _orig_size: torch.Size  # ND, the original parameter's global size (TP: its local size)
    sharded_size: torch.Size  # ND, this rank's chunk (0 along the shard dim if empty)
    contiguous_sharded_stride: tuple[int, ...]
    padded_sharded_param_size: torch.Size  # ND, chunk 0's size
    _sharded_param_data: torch.Tensor  # 1D, padded_sharded_param_size.numel() elements
    sharded_param: nn.Parameter  # ND, DTensor with the original global size and stride
    _sharded_post_forward_param_data: torch.Tensor | None  # 1D, 1/k of the all-gather output
    _sharded_post_forward_param: nn.Parameter | None  # ND, DTensor on the k-rank 2-D mesh
    _unsharded_param: nn.Parameter  # ND, original size; created by the first unshard
    unsharded_accumulated_grad: torch.Tensor | None  # ND, in reduce_dtype
    all_gather_outputs: list[torch.Tensor]  # 1D, world_size * input numel each

    def __init__(
        self,
        param: nn.Parameter,
        module_info: ParamModuleInfo,
        mesh_info: FSDPMeshInfo,
        post_forward_mesh_info: FSDPMeshInfo | None,
        device: torch.device,
        shard_placement_fn,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ):
        self._module_info = module_info
        self.mesh_info, self.post_forward_mesh_info = mesh_info, post_forward_mesh_info
        self.device, self.mp_policy = device, mp_policy
        self.offload_to_cpu = isinstance(offload_policy, CPUOffloadPolicy)
        self.pin_memory = self.offload_to_cpu and offload_policy.pin_memory
        self.all_gather_outputs, self._unsharded_inner_tensors = [], []
        self.unsharded_accumulated_grad = None
        self._sharded_post_forward_param_data = self._sharded_post_forward_param = None
        self._param_fqn: str | None = None  # set at the root's lazy init
        self._init_sharded_param(param, shard_placement_fn)
        check_extensions(self._sharded_local_tensor)

    # ---- construction -------------------------------------------------------------------
    @torch.no_grad()
    def _init_sharded_param(self, param: nn.Parameter, placement_fn) -> None:
        self.fsdp_placement = _resolve_shard_placement(param, placement_fn, self.mesh_info)
        dim = self.fsdp_placement.dim
        ws, rank = self.mesh_info.shard_mesh_size, self.mesh_info.shard_mesh_rank
        self._orig_param_uid = _get_orig_param_uid(param)
        self._tp_spec = param._spec if isinstance(param, DTensor) else None
        data = param._local_tensor if isinstance(param, DTensor) else param  # what FSDP shards
        self._orig_size = data.size()
        self._contiguous_orig_stride = contiguous_strides(self._orig_size)
        self._sharding_spec = self._init_sharding_spec(param)
        # The torch.chunk rule (see _shard_math): ceil(size / ws) per rank, the tail short or empty.
        self.sharded_size = torch.Size(sharded_size(data.shape, ws, rank, dim))
        self.contiguous_sharded_stride = contiguous_strides(self.sharded_size)
        self.padded_sharded_param_size = torch.Size(padded_sharded_size(data.shape, ws, dim))
        length = self.sharded_size[dim]
        start = shard_offset(data.shape, ws, rank, dim) if length else 0
        padded = _padded_copy(data.narrow(dim, start, length), self.padded_sharded_param_size, dim)
        if self.offload_to_cpu and not padded.is_meta:
            padded = padded.cpu()
            if self.pin_memory:
                padded = padded.pin_memory()  # raises on a build without an accelerator
        self._sharded_param_data = padded.view(-1)
        local = padded.narrow(dim, 0, length)  # contiguous: dims other than 0 divide evenly
        self.sharded_param = nn.Parameter(self.to_sharded_dtensor(local), param.requires_grad)
        self.sharded_state = ShardedState.SHARDED

    def _init_sharding_spec(self, param: nn.Parameter) -> DTensorSpec:
        """The sharded parameter's spec ([Note: meshes], [Note: tensor parallel]): ``(Shard(d),)``
        on the FSDP mesh, after ``Replicate()`` for HSDP; a TP ``DTensor``'s TP placements follow
        on the concatenated (dp, tp) mesh, and its FSDP placement is ``_StridedShard(d,
        split_factor=<TP shards on d>)`` when TP already shards dim ``d``. The global size and
        stride stay the original's."""
        dp_placements = (Replicate(),) if isinstance(self.mesh_info, HSDPMeshInfo) else ()
        if self._tp_spec is None:
            meta = TensorMeta(param.size(), param.stride(), param.dtype)
            placements = (*dp_placements, self.fsdp_placement)
            return DTensorSpec(self.mesh_info.mesh, placements, tensor_meta=meta)
        tp, dim = self._tp_spec, self.fsdp_placement.dim
        if tp.mesh.ndim != 1:
            raise NotImplementedError(f"FSDP supports 1-D tensor parallelism, not {tp.placements}")
        split_factor = tp.num_shards_map[dim]
        fsdp = _StridedShard(dim, split_factor=split_factor) if split_factor > 1 else Shard(dim)
        mesh = DeviceMesh._concatenate([self.mesh_info.mesh, tp.mesh])
        placements = (*dp_placements, fsdp, *tp.placements)
        return DTensorSpec(mesh, placements, tensor_meta=tp.tensor_meta)

    def _attach_to_module(self) -> None:
        """Register the sharded parameter on its module(s) and the post-load re-pad hook."""
        self._setattr_on_modules(self.sharded_param)
        self._module_info.module.register_load_state_dict_post_hook(
            lambda *args, **kwargs: self.reset_sharded_param()
        )

    def init_dtype_attrs(self, mp_policy: MixedPrecisionPolicy) -> None:
        """Clamp the policy to this parameter (spec P5): ``reduce_dtype`` equal to ``param_dtype``
        becomes ``None``; ``param_dtype`` equal to the original dtype, or on a non-floating
        parameter, becomes ``None``."""
        param_dtype, reduce_dtype = mp_policy.param_dtype, mp_policy.reduce_dtype
        self.orig_dtype = self.sharded_param.dtype
        if reduce_dtype == param_dtype:
            reduce_dtype = None
        if param_dtype == self.orig_dtype or not self.orig_dtype.is_floating_point:
            param_dtype = None
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def init_all_gather_outputs(
        self, numels: list[int], dtypes: list[torch.dtype], world_size: int, device: torch.device
    ) -> None:
        """Allocate the 1-D all-gather outputs on the first unshard; later ones regrow them.
        Outputs made under ``torch.inference_mode()`` are inference tensors, which may not be
        refilled outside it: the first unshard outside makes ordinary ones (and a new unsharded
        parameter viewing them)."""
        outputs = self.all_gather_outputs
        if outputs and outputs[0].is_inference() and not torch.is_inference_mode_enabled():
            self.all_gather_outputs = []
            self.__dict__.pop("_unsharded_param", None)
        if not self.all_gather_outputs:
            self.all_gather_outputs = [
                torch.empty(n * world_size, dtype=d, device=device) for n, d in zip(numels, dtypes)
            ]
        for tensor in self.all_gather_outputs:
            alloc_storage(tensor)

    def init_unsharded_param(self) -> None:
        """Create the unsharded parameter on the first unshard (later unshards refill it)."""
        local = self._sharded_local_tensor
        if hasattr(local, "fsdp_post_all_gather"):
            unsharded = post_all_gather(self, local)  # refills in place after the first time
            if unsharded is None:
                return
        elif hasattr(self, "_unsharded_param"):
            return  # a view of all_gather_outputs[0], already refilled by the copy-out
        else:
            unsharded = self.all_gather_outputs[0]
        unsharded = torch.as_strided(unsharded, self._orig_size, self._contiguous_orig_stride, 0)
        if (tp := self._tp_spec) is not None:  # compute on the TP mesh, in the all-gather's dtype
            meta = TensorMeta(tp.tensor_meta.shape, tp.tensor_meta.stride, unsharded.dtype)
            unsharded = DTensor(unsharded, replace(tp, tensor_meta=meta), requires_grad=False)
        self._unsharded_param = nn.Parameter(unsharded, self.sharded_param.requires_grad)

    # ---- state transitions --------------------------------------------------------------
    def to_sharded(self) -> None:
        """Register the sharded parameter and free the unsharded one."""
        self._setattr_on_modules(self.sharded_param)
        self.free_unsharded_param()
        self.sharded_state = ShardedState.SHARDED

    def to_sharded_post_forward(self) -> None:
        """Keep this rank's piece of the all-gather output for the smaller post-forward group.

        ``_sharded_post_forward_param_data`` is this rank's 1/k of the padded all-gather output
        (what the next all-gather over the k-rank group exchanges). The registered DTensor's local
        tensor follows the chunk rule over k ranks; with an uneven dim 0 (or a ``Shard(d != 0)``
        parameter, whose output holds no dim-0 padding) its rows need not be that piece, and then
        it is a separate copy.
        """
        self._assert_in_states(ShardedState.UNSHARDED)
        if self._tp_spec is not None:
            raise NotImplementedError(
                "Resharding to smaller mesh is not supported for DTensor parameters yet"
            )
        if len(self.all_gather_outputs) != 1:
            raise NotImplementedError("Resharding to a smaller mesh needs one all-gather output")
        info, output = self.post_forward_mesh_info, self.all_gather_outputs[0]
        k, j = info.shard_mesh_size, info.shard_mesh_rank
        numel = output.numel() // k
        self._sharded_post_forward_param_data = data = output.narrow(0, numel * j, numel).clone()
        size = torch.Size(sharded_size(self._orig_size, k, j, 0))
        dim0, row = self._orig_size[0], math.prod(self._orig_size[1:])
        start = min(shard_offset(self._orig_size, k, j), dim0) * row
        fits = start == numel * j and size.numel() <= numel  # never for Shard(d != 0)'s few rows
        local = data if fits else output.narrow(0, start, size.numel()).clone()
        local = local[: size.numel()].view(size)
        spec = DTensorSpec(info.mesh, (Replicate(), Shard(0)), self._sharding_spec.tensor_meta)
        self._sharded_post_forward_param = nn.Parameter(
            DTensor(local, spec, requires_grad=False), self.sharded_param.requires_grad
        )
        self._setattr_on_modules(self._sharded_post_forward_param)
        self.free_unsharded_param()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def to_unsharded(self) -> None:
        """Register the unsharded parameter (its data must already be all-gathered)."""
        if self._unsharded_param.requires_grad != self.sharded_param.requires_grad:
            self._unsharded_param.requires_grad_(
                self.sharded_param.requires_grad
            )  # not in a transform
        self._setattr_on_modules(self._unsharded_param)
        self._sharded_post_forward_param = self._sharded_post_forward_param_data = None
        self.sharded_state = ShardedState.UNSHARDED

    def _setattr_on_modules(self, param: nn.Parameter) -> None:
        info = self._module_info
        _setattr_param(info.module, info.param_name, param)
        for module, name in zip(info.shared_modules, info.shared_param_names):
            _setattr_param(module, name, param)

    def to_sharded_dtensor(self, tensor: torch.Tensor) -> DTensor:
        """Wrap a local tensor of ``sharded_size`` (a shard or a sharded grad) as a DTensor."""
        if tensor.shape != self.sharded_size:
            raise AssertionError(f"Expects size {self.sharded_size} but got {tensor.shape}")
        return DTensor(tensor, self._sharding_spec, requires_grad=tensor.requires_grad)

    # ---- gradients and memory -----------------------------------------------------------
    def to_accumulated_grad_if_needed(self) -> None:
        """Without reduction, move the unsharded grad to ``reduce_dtype`` for accumulation."""
        grad = self._unsharded_param.grad
        if self.reduce_dtype is not None and grad is not None and grad.dtype != self.reduce_dtype:
            self._unsharded_param.grad = None
            self.unsharded_accumulated_grad = grad.to(self.reduce_dtype)

    def accumulate_unsharded_grad_if_needed(self) -> None:
        if self.unsharded_accumulated_grad is not None and self.unsharded_param.grad is not None:
            self.unsharded_accumulated_grad += self.unsharded_param.grad
            self.unsharded_param.grad = None

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The tensor to reduce for an unsharded gradient: a TP parameter's ``DTensor`` gradient
        is redistributed to the parameter's TP placements and its local tensor taken."""
        if self._tp_spec is None:
            return grad
        if grad.placements != self._tp_spec.placements:
            grad = grad.redistribute(placements=self._tp_spec.placements)
        return grad._local_tensor

    def free_unsharded_param(self) -> None:
        for tensor in [*self.all_gather_outputs, *self._unsharded_inner_tensors]:
            free_storage(tensor)

    # ---- views ----------------------------------------------------------------------------
    @property
    def all_gather_inputs(self) -> list[torch.Tensor]:  # 1-D each
        """This rank's contribution to the all-gather, per the current state (see the Note)."""
        self._assert_in_states(ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD)
        local = self._sharded_local_tensor
        extension = hasattr(local, "fsdp_pre_all_gather")
        if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
            if extension:
                raise NotImplementedError
            return [_to_dtype_if_needed(self._sharded_post_forward_param_data, self.param_dtype)]
        if extension:
            return pre_all_gather(self, local.to(self.device) if self.offload_to_cpu else local)
        data = self._sharded_param_data
        if self.offload_to_cpu:
            data = data.to(self.device, non_blocking=True)
        return [_to_dtype_if_needed(data, self.param_dtype)]

    @property
    def unsharded_param(self) -> nn.Parameter:
        return self._unsharded_param

    @property
    def _sharded_local_tensor(self) -> torch.Tensor:
        return self.sharded_param._local_tensor

    def _assert_in_states(self, *states: ShardedState) -> None:
        if self.sharded_state not in states:
            raise AssertionError(f"Expects to be in one of {states}, not {self.sharded_state}")

    # ---- re-padding after the module's parameter was replaced -----------------------------
    def reset_sharded_param(self) -> None:
        """Re-derive the padded buffer after the registered DTensor was replaced or moved.

        Runs after ``load_state_dict`` (post hook), after ``nn.Module._apply`` (``to``,
        ``to_empty``, ...) and once at lazy init. The module's current parameter becomes
        ``sharded_param`` (``assign=True`` installs a new object). Unless its local tensor already
        lives in ``_sharded_param_data``, it is copied into a fresh zero-padded buffer of
        ``padded_sharded_param_size`` and the DTensor's local tensor becomes a narrow view of it
        (a local tensor of the padded size is used as it is). Meta tensors are left alone.
        """
        info = self._module_info
        new_param = getattr(info.module, info.param_name)
        if new_param is not self.sharded_param:
            if torch.__future__.get_swap_module_params_on_conversion():
                raise AssertionError(
                    f"Expects swap_tensors to preserve object but got {new_param} "
                    f"instead of {self.sharded_param}"
                )
            self.sharded_param = new_param
        self._sharding_spec, local = new_param._spec, new_param._local_tensor
        data = self._sharded_param_data
        if local.is_meta or (  # already a view of the padded buffer (a subclass may lack one)
            type(data) is torch.Tensor
            and 0 < data.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        ):
            return
        dim, padded = self.fsdp_placement.dim, local
        if local.size() != self.padded_sharded_param_size:
            if dim != 0:
                raise AssertionError(f"Shard({dim}) requires even sharding: {local.size()=}")
            padded = _padded_copy(local, self.padded_sharded_param_size, dim)
        if self.pin_memory and not padded.is_pinned():
            padded = padded.cpu().pin_memory()
        self._sharded_param_data = padded.view(-1)
        if padded is not local:
            self.sharded_param._local_tensor = padded.narrow(dim, 0, local.size(dim))

    def __repr__(self) -> str:
        return f"FSDPParam(fqn={self._param_fqn}, orig_size={self._orig_size})"


@torch.no_grad()
def _padded_copy(src: torch.Tensor, padded_size: torch.Size, dim: int) -> torch.Tensor:
    """A new tensor of ``padded_size`` holding ``src`` at the start of ``dim`` and zeros after it.

    A plain tensor is written once (only the tail is zeroed). A tensor subclass is asked only for
    the ops upstream uses on it (see the Note on parameter subclasses)."""
    length = src.size(dim)
    if type(src) is not torch.Tensor:
        out = src.new_zeros(padded_size)
        out.narrow(dim, 0, length).copy_(src)
        return out
    out = torch.empty(padded_size, dtype=src.dtype, device=src.device)
    out.narrow(dim, 0, length).copy_(src)
    out.narrow(dim, length, padded_size[dim] - length).zero_()
    return out


def _setattr_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register ``param`` as ``module.<name>``: through the module's own ``__setattr__`` if its
    class overrides it, else straight into ``_parameters`` (skipping ``nn.Module``'s checks)."""
    if type(module).__setattr__ is nn.Module.__setattr__:
        module._parameters[name] = param
    else:
        setattr(module, name, param)
