"""``FSDPParamGroup``: the parameters of one ``fully_shard`` call, communicated together.

[Note: the life of a group in one iteration]
``pre_forward`` unshards (one all-gather + copy-out) and registers the unsharded parameters;
``post_forward`` reshards according to ``reshard_after_forward`` (``True`` → ``SHARDED``,
``False`` → stays ``UNSHARDED``, an int → ``SHARDED_POST_FORWARD`` on a smaller group). In
backward, the state's pre-backward hook (on the forward outputs) calls ``pre_backward``, which
unshards again if needed; ``post_backward`` runs when autograd has produced the gradients of the
module's inputs (an autograd function wrapped around the forward inputs) or, at the latest, from
the root's end-of-backward callback. It reshards and reduce-scatters the unsharded gradients into
the sharded parameters' ``.grad`` (one reduce-scatter per group; HSDP adds one all-reduce).
This reference runs every collective synchronously on the current stream: the CUDA-stream
overlap machinery and prefetching of upstream are left out because they change timing only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_collectives import (
    AllGatherResult,
    foreach_all_gather,
    foreach_all_gather_copy_out,
    foreach_reduce,
)
from ._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, TrainingState, is_bw
from ._fsdp_param import FSDPParam, ParamModuleInfo, ShardedState, alloc_storage

_NO_COLLECTIVE = "world size 1: all-gather inputs are copied, no collective runs"


class FSDPParamGroup:
    """One all-gather and one reduce-scatter's worth of :class:`FSDPParam` s."""

    _orig_dtype: torch.dtype | None  # uniform original dtype of the trainable params
    _reduce_dtype: torch.dtype | None  # uniform clamped reduce dtype of the trainable params

    def __init__(
        self,
        params: list[nn.Parameter],
        modules: tuple[nn.Module, ...],
        mesh_info: FSDPMeshInfo,
        post_forward_mesh_info: FSDPMeshInfo | None,
        device: torch.device,
        shard_placement_fn: Callable[[nn.Parameter], Any] | None,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ):
        self.modules = modules
        infos = _get_param_module_infos(params, modules)
        self.fsdp_params = [
            FSDPParam(
                param, info, mesh_info, post_forward_mesh_info, device,
                shard_placement_fn, mp_policy, offload_policy,
            )
            for param, info in zip(params, infos)
        ]  # fmt: skip
        for fsdp_param in self.fsdp_params:  # every param validated: now touch the modules
            fsdp_param._attach_to_module()
        self.mesh_info = mesh_info
        self.post_forward_mesh_info = post_forward_mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self._training_state = TrainingState.IDLE
        self._sharded_state = ShardedState.SHARDED
        self._module_fqn: str | None = None  # set at the root's lazy init
        self._reset_sharded_params = False
        self._module_to_pre_save_state_dict_hook_handle: dict[nn.Module, Any] = {}
        self._module_to_pre_load_state_dict_hook_handle: dict[nn.Module, Any] = {}
        self._all_gather_result: AllGatherResult | str | None = None
        self._partial_reduce_output: torch.Tensor | None = None  # HSDP without all-reduce
        # Knobs set through FSDPModule methods.
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None
        self.unshard_async_op = False

    # ---- initialization ----------------------------------------------------------------------
    def _init_mp_dtypes(self) -> None:
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_dtype_attrs(self.mp_policy)
        trainable = [p for p in self.fsdp_params if p.sharded_param.requires_grad]
        orig_dtypes = {p.orig_dtype for p in trainable}
        reduce_dtypes = {p.reduce_dtype for p in trainable}
        if trainable and len(orig_dtypes) != 1:
            raise AssertionError(
                f"FSDP expects uniform original parameter dtype but got {orig_dtypes}"
            )
        if trainable and len(reduce_dtypes) != 1:
            raise AssertionError(f"FSDP expects uniform reduce dtype but got {reduce_dtypes}")
        self._orig_dtype = next(iter(orig_dtypes)) if trainable else None
        self._reduce_dtype = next(iter(reduce_dtypes)) if trainable else None

    def lazy_init(self) -> None:
        """Re-pad shards the user may have replaced since ``fully_shard``; validate; hooks."""
        if self.is_sharded and not self._reset_sharded_params:
            for fsdp_param in self.fsdp_params:
                fsdp_param.reset_sharded_param()
                fsdp_param._init_extensions()  # extensions may be patched on after init
            self._reset_sharded_params = True
        self._validate_no_meta_params()
        self._validate_cpu_offload_params()
        self._init_mp_dtypes()
        self._register_state_dict_hooks()

    # ---- unshard / reshard -----------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather (no-op if unsharded or already pending)."""
        if self._all_gather_result is not None or self.is_unsharded:
            return
        group = self._all_gather_process_group
        if group.size() == 1:
            self._all_gather_result = _NO_COLLECTIVE
            return
        self._all_gather_result = foreach_all_gather(self.fsdp_params, group, async_op, self.device)

    def wait_for_unshard(self) -> None:
        """Finish a pending unshard: copy-out, build/refill unsharded params, register them."""
        result, self._all_gather_result = self._all_gather_result, None
        if result is None:
            return
        if result is _NO_COLLECTIVE:
            # One rank: every all-gather output is a copy of its input (an extension may
            # have several inputs per parameter; each gets its own output).
            for fsdp_param in self.fsdp_params:
                inputs = fsdp_param.all_gather_inputs
                fsdp_param.init_all_gather_outputs(
                    [t.numel() for t in inputs], [t.dtype for t in inputs], 1, self.device
                )
                for inp, out in zip(inputs, fsdp_param.all_gather_outputs):
                    alloc_storage(out)
                    with (
                        torch.no_grad(),
                        torch.autograd._unsafe_preserve_version_counter(out),
                    ):
                        out.copy_(inp.reshape(-1))
        else:
            foreach_all_gather_copy_out(result, self.fsdp_params, self._all_gather_process_group)
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_unsharded_param()
        self._to_unsharded()

    def reshard(self) -> None:
        """Free the unsharded params; in forward, honour ``reshard_after_forward``."""
        if self._training_state == TrainingState.FORWARD:
            if not self._reshard_after_forward:
                return
            if self._use_post_forward_mesh:
                self._to_sharded_post_forward()
                return
        self._to_sharded()

    # ---- hooks -------------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        entering_forward = self._training_state != TrainingState.FORWARD
        self._training_state = TrainingState.FORWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        if entering_forward:
            args, kwargs = self._register_post_backward_hook(args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, input: Any, output: Any) -> Any:
        if not is_bw():  # a forward re-run inside backward (checkpointing) keeps params
            self.reshard()
        self._training_state = TrainingState.IDLE
        return output

    def pre_backward(self, *unused: Any) -> None:
        if self._training_state == TrainingState.PRE_BACKWARD:
            return
        self._training_state = TrainingState.PRE_BACKWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()

    def post_backward(self, *unused: Any) -> None:
        """Reshard, then reduce-scatter the gradients produced since the last reduction."""
        self._training_state = TrainingState.POST_BACKWARD
        for fsdp_param in self.fsdp_params:
            fsdp_param.accumulate_unsharded_grad_if_needed()
        if not self.reduce_grads:  # gradient accumulation without communication
            if self.reshard_after_backward:
                self.reshard()
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_accumulated_grad_if_needed()
            return
        with_grad: list[FSDPParam] = []
        grads: list[torch.Tensor] = []
        for fsdp_param in self.fsdp_params:
            if not hasattr(fsdp_param, "_unsharded_param"):
                continue  # never unsharded, so no gradient
            if fsdp_param.unsharded_accumulated_grad is not None:
                grads.append(fsdp_param.unsharded_accumulated_grad)
                fsdp_param.unsharded_accumulated_grad = None
            elif fsdp_param.unsharded_param.grad is not None:
                grads.append(fsdp_param.unsharded_grad_data)
                fsdp_param.unsharded_param.grad = None
            else:
                continue
            with_grad.append(fsdp_param)
        if self.reshard_after_backward:
            self.reshard()
        if not with_grad:
            return
        self._partial_reduce_output = foreach_reduce(
            with_grad,
            grads,
            self._reduce_scatter_process_group,
            self._orig_dtype,
            self._reduce_dtype,
            self.device,
            self.gradient_divide_factor,
            self._all_reduce_process_group if self._is_hsdp else None,
            self.all_reduce_grads,
            self._partial_reduce_output,
        )

    def finalize_backward(self) -> None:
        result, self._all_gather_result = self._all_gather_result, None
        if isinstance(result, AllGatherResult) and result.all_gather_work is not None:
            result.all_gather_work.wait()  # an unshard nobody waited for

    # ---- state helpers ---------------------------------------------------------------------
    def _to_sharded(self) -> None:
        if not self.is_sharded:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_sharded()
            self._sharded_state = ShardedState.SHARDED

    def _to_sharded_post_forward(self) -> None:
        if not self.is_sharded_post_forward:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_sharded_post_forward()
            self._sharded_state = ShardedState.SHARDED_POST_FORWARD

    def _to_unsharded(self) -> None:
        if not self.is_unsharded:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_unsharded()
            self._sharded_state = ShardedState.UNSHARDED

    @property
    def is_sharded(self) -> bool:
        return self._sharded_state == ShardedState.SHARDED

    @property
    def is_sharded_post_forward(self) -> bool:
        return self._sharded_state == ShardedState.SHARDED_POST_FORWARD

    @property
    def is_unsharded(self) -> bool:
        return self._sharded_state == ShardedState.UNSHARDED

    @contextlib.contextmanager
    def use_training_state(self, training_state: TrainingState):
        old, self._training_state = self._training_state, training_state
        try:
            yield
        finally:
            self._training_state = old

    def _register_post_backward_hook(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Route the inputs that need grad through an identity whose backward = post_backward."""
        if not torch.is_grad_enabled():
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        outs = RegisterPostBackwardFunction.apply(self, *(flat[i] for i in idx))
        for i, out in zip(idx, outs):
            flat[i] = out
        return tree_unflatten(flat, spec)

    def _register_state_dict_hooks(self) -> None:
        """Reshard before ``state_dict()`` and ``load_state_dict()`` on modules with params."""
        if self._module_to_pre_save_state_dict_hook_handle:
            return  # already registered

        def to_sharded_hook(*args: Any, **kwargs: Any) -> None:
            self._to_sharded()

        for module in {fsdp_param._module_info.module for fsdp_param in self.fsdp_params}:
            self._module_to_pre_save_state_dict_hook_handle[module] = (
                module.register_state_dict_pre_hook(to_sharded_hook)
            )
            self._module_to_pre_load_state_dict_hook_handle[module] = (
                module._register_load_state_dict_pre_hook(to_sharded_hook)
            )

    # ---- mesh helpers ----------------------------------------------------------------------
    @property
    def _reshard_after_forward(self) -> bool:
        return self.post_forward_mesh_info is not None

    @property
    def _use_post_forward_mesh(self) -> bool:
        return self._reshard_after_forward and self.mesh_info != self.post_forward_mesh_info

    @property
    def _is_hsdp(self) -> bool:
        return isinstance(self.mesh_info, HSDPMeshInfo)

    @property
    def _all_gather_process_group(self) -> dist.ProcessGroup:
        info = self.post_forward_mesh_info if self.is_sharded_post_forward else self.mesh_info
        return info.shard_process_group

    @property
    def _reduce_scatter_process_group(self) -> dist.ProcessGroup:
        return self.mesh_info.shard_process_group

    @property
    def _all_reduce_process_group(self) -> dist.ProcessGroup:
        return self.mesh_info.replicate_process_group

    def _validate_no_meta_params(self) -> None:
        on_meta = [p._param_fqn for p in self.fsdp_params if p.sharded_param.device.type == "meta"]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {on_meta}\n"
                "For example, call module.to_empty(device) to materialize to device and "
                "call module.reset_parameters() on each module to initialize values."
            )

    def _validate_cpu_offload_params(self) -> None:
        if not isinstance(self.offload_policy, CPUOffloadPolicy):
            return
        off_cpu = [p for p in self.fsdp_params if p.sharded_param.device.type != "cpu"]
        if off_cpu:
            raise RuntimeError(
                "FSDP parameters should be materialized on CPU when enabling CPU offloading. "
                'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
                "Found following parameters on non-CPU device: "
                f"{[(p._param_fqn, p.sharded_param.device) for p in off_cpu]}\n"
            )

    def __repr__(self) -> str:
        return f"FSDPParamGroup(fqn={self._module_fqn})"


def _get_param_module_infos(
    params: list[nn.Parameter], modules: tuple[nn.Module, ...]
) -> list[ParamModuleInfo]:
    """Find each param's first owner, recording every further (module, name) alias as shared."""
    wanted = set(params)
    infos: dict[nn.Parameter, ParamModuleInfo] = {}
    for module in modules:
        for _, submodule in module.named_modules(remove_duplicate=False):
            for name, param in submodule._parameters.items():
                if param is None or param not in wanted:
                    continue
                if param not in infos:
                    infos[param] = ParamModuleInfo(submodule, name)
                else:
                    infos[param].shared_modules.append(submodule)
                    infos[param].shared_param_names.append(name)
    if len(infos) != len(params):
        raise AssertionError(f"Some parameters are not in the module tree of {modules}")
    return [infos[param] for param in params]


class RegisterPostBackwardFunction(torch.autograd.Function):
    """Identity on the forward inputs; its backward runs the group's ``post_backward``."""

    @staticmethod
    def forward(param_group: FSDPParamGroup, *inputs: torch.Tensor):
        return inputs

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Any) -> None:
        ctx.param_group = inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.param_group.post_backward()
        return (None, *grads)
