"""``FSDPParamGroup``: the parameters of one ``fully_shard`` call, communicated together.

[Note: the life of a group in one iteration]
``pre_forward`` unshards (one all-gather and copy-out) and registers the unsharded parameters;
``post_forward`` reshards per ``reshard_after_forward`` (``True``: ``SHARDED``; ``False``: stays
``UNSHARDED``; an int: ``SHARDED_POST_FORWARD`` on a smaller group). In backward ``pre_backward``
unshards again if needed, and ``post_backward`` (run when autograd reaches the module's inputs,
or at the latest by the root's end-of-backward callback) reshards and reduce-scatters the
unsharded gradients into the sharded parameters' ``.grad``. Every collective runs synchronously
on the current stream: upstream's stream overlap and prefetching change timing only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_collectives import (
    AllGatherResult,
    foreach_all_gather,
    foreach_all_gather_copy_out,
    foreach_reduce,
)
from ._fsdp_common import FSDPMeshInfo, TrainingState
from ._fsdp_extensions import check_extensions
from ._fsdp_param import FSDPParam, ParamModuleInfo, ShardedState
from ._grad_tensors import collect_grad_tensors, replace_grad_tensors


def _outside_functorch(method: Callable) -> Callable:
    """``method`` run with the functorch transforms off (see [Note: outside functorch transforms])."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch._C._are_functorch_transforms_active():
            return method(*args, **kwargs)
        with torch._C._DisableFuncTorch():
            return method(*args, **kwargs)

    return run


class FSDPParamGroup:
    """One all-gather and one reduce-scatter's worth of :class:`FSDPParam` s.

    The knobs ``reduce_grads``, ``reshard_after_backward`` and ``gradient_divide_factor`` are set
    through :class:`FSDPModule`'s methods; ``post_forward_mesh_info`` is ``None`` when parameters
    stay unsharded after forward."""

    def __init__(
        self,
        params: list[nn.Parameter],
        modules: tuple[nn.Module, ...],
        mesh_info: FSDPMeshInfo,
        post_forward_mesh_info: FSDPMeshInfo | None,
        device: torch.device,
        shard_placement_fn,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ):
        self.mesh_info, self.device = mesh_info, device
        self.post_forward_mesh_info = post_forward_mesh_info
        self.mp_policy, self.offload_policy = mp_policy, offload_policy
        self.fsdp_params = [
            FSDPParam(param, info, mesh_info, post_forward_mesh_info, device,
                      shard_placement_fn, mp_policy, offload_policy)
            for param, info in zip(params, _get_param_module_infos(params, modules))
        ]  # fmt: skip
        for fsdp_param in self.fsdp_params:  # every param validated: now touch the modules
            fsdp_param._attach_to_module()
        self._training_state = TrainingState.IDLE
        self._sharded_state = ShardedState.SHARDED
        self._initialized = False
        self._all_gather_result: AllGatherResult | None = None
        self.reduce_grads = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None
        self.reduce_scatter_unused_params = False  # unused parameters: reduce zeros, not skip
        # [Note: knobs the reference honours trivially]
        # Upstream tunes its stream overlap with these; every collective here runs synchronously
        # on the current stream, so they are stored (and validated by FSDPModule) but change
        # nothing: how many reduce-scatter input buffers may be in flight, and whether staging
        # buffers come from the process group's allocator.
        self.reduce_scatter_max_input_buffers = 1
        self.allocate_memory_from_process_group = False
        # A SUM collective plus a separate division instead of AVG / PREMUL_SUM (same result).
        self.force_sum_reduction_for_comms = False
        # False: the parameters are not all-gathered again in backward (the user promises that
        # no gradient computation needs their values, e.g. an embedding's weight).
        self.unshard_in_backward = True
        # set_separate_reduce_scatter_group: a process group of its own over the same ranks.
        self.reduce_scatter_process_group = None

    def lazy_init(self) -> None:
        """Once, before the first unshard: re-pad shards the user may have replaced since
        ``fully_shard``, validate them, resolve dtypes, register the state-dict hooks."""
        if self._initialized:
            return
        for fsdp_param in self.fsdp_params:
            fsdp_param.reset_sharded_param()
            check_extensions(fsdp_param._sharded_local_tensor)  # hooks may be patched on late
        self._validate_params()
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_dtype_attrs(self.mp_policy)
        trainable = [p for p in self.fsdp_params if p.sharded_param.requires_grad]
        for attr in ("orig_dtype", "reduce_dtype"):
            if len(dtypes := {getattr(p, attr) for p in trainable}) > 1:
                kind = "original parameter" if attr == "orig_dtype" else "reduce"
                raise AssertionError(f"FSDP expects uniform {kind} dtype but got {dtypes}")
        self._orig_dtype = trainable[0].orig_dtype if trainable else None
        self._reduce_dtype = trainable[0].reduce_dtype if trainable else None

        def to_sharded(*args: Any, **kwargs: Any) -> None:  # state_dict() sees the shards
            self.to_state(ShardedState.SHARDED)

        for module in {fsdp_param._module_info.module for fsdp_param in self.fsdp_params}:
            module.register_state_dict_pre_hook(to_sharded)
            module._register_load_state_dict_pre_hook(to_sharded)
        self._initialized = True

    # ---- unshard / reshard -----------------------------------------------------------------
    # [Note: outside functorch transforms]
    # A unit may run inside ``torch.func.jvp`` / ``vmap`` / ``grad``. The all-gather, the copy-out
    # and the (re)registration of parameters work on FSDP's own buffers, not on the values being
    # transformed, so they run with the transforms switched off; the forward itself, which reads
    # the registered parameters, stays transformed.
    @_outside_functorch
    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather (no-op if unsharded or already pending)."""
        if self._all_gather_result is not None or self._sharded_state == ShardedState.UNSHARDED:
            return
        self._all_gather_result = foreach_all_gather(
            self.fsdp_params, self._all_gather_process_group, async_op, self.device
        )

    @_outside_functorch
    def wait_for_unshard(self) -> None:
        """Finish a pending unshard: copy-out, build/refill unsharded params, register them."""
        result, self._all_gather_result = self._all_gather_result, None
        if result is None:
            return
        foreach_all_gather_copy_out(result, self.fsdp_params, self._all_gather_process_group)
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_unsharded_param()
        self.to_state(ShardedState.UNSHARDED)

    @_outside_functorch
    def reshard(self) -> None:
        """Free the unsharded params; in forward, honour ``reshard_after_forward``."""
        if self._training_state == TrainingState.FORWARD:
            if self.post_forward_mesh_info is None:
                return
            if self.post_forward_mesh_info is not self.mesh_info:
                return self.to_state(ShardedState.SHARDED_POST_FORWARD)
        self.to_state(ShardedState.SHARDED)

    def to_state(self, state: ShardedState) -> None:
        """Move every parameter to ``state`` (``to_sharded`` / ``to_unsharded`` / ...)."""
        if self._sharded_state == state:
            return
        transition = {
            ShardedState.SHARDED: FSDPParam.to_sharded,
            ShardedState.SHARDED_POST_FORWARD: FSDPParam.to_sharded_post_forward,
            ShardedState.UNSHARDED: FSDPParam.to_unsharded,
        }[state]
        for fsdp_param in self.fsdp_params:
            transition(fsdp_param)
        self._sharded_state = state

    # ---- hooks -------------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        entering_forward = self._training_state != TrainingState.FORWARD
        self._training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()
        if entering_forward:
            args, kwargs = self._register_post_backward_hook(args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, input: Any, output: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self.reshard()
        self._training_state = TrainingState.IDLE
        return output

    def pre_backward(self, *unused: Any) -> None:
        if self._training_state != TrainingState.PRE_BACKWARD:
            self._training_state = TrainingState.PRE_BACKWARD
            if self.unshard_in_backward:
                self.unshard()
            self.wait_for_unshard()

    def discard_pending_unshard(self) -> None:
        """Finish and drop an all-gather nobody waited for (a prefetch whose unit did not run):
        its data predates the optimizer step, so the next unshard must gather again."""
        if (result := self._all_gather_result) is not None and result.all_gather_work is not None:
            result.all_gather_work.wait()
        self._all_gather_result = None

    def reset_iter_state(self) -> None:
        """Drop a pending all-gather and return to ``SHARDED`` / ``IDLE`` (after a failed
        forward or backward; see ``FSDPModule.reset_iter_state``)."""
        self.discard_pending_unshard()
        self._training_state = TrainingState.IDLE
        self.to_state(ShardedState.SHARDED)

    def post_backward(self, *unused: Any) -> None:
        """Reshard, then reduce-scatter the gradients produced since the last reduction.

        With ``reduce_grads`` off (gradient accumulation), the unsharded gradients stay on the
        unsharded parameters (in ``reduce_dtype`` if set) and are summed over backwards."""
        self._training_state = TrainingState.POST_BACKWARD
        for fsdp_param in self.fsdp_params:
            fsdp_param.accumulate_unsharded_grad_if_needed()
        if not self.reduce_grads:
            if self.reshard_after_backward:
                self.reshard()
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_accumulated_grad_if_needed()
            return
        with_grad, grads = [], []
        for fsdp_param in self.fsdp_params:
            if not hasattr(fsdp_param, "_unsharded_param"):
                continue  # never unsharded, so no gradient
            if (grad := fsdp_param.unsharded_accumulated_grad) is not None:
                fsdp_param.unsharded_accumulated_grad = None
            elif (grad := fsdp_param.unsharded_param.grad) is not None:
                fsdp_param.unsharded_param.grad = None
            elif self.reduce_scatter_unused_params and fsdp_param.sharded_param.requires_grad:
                grad = torch.zeros_like(fsdp_param.unsharded_param)  # unused: a zero gradient
            else:
                continue  # unused: .grad stays None, so optimizers skip the parameter
            with_grad.append(fsdp_param)
            grads.append(fsdp_param.local_grad(grad))
        if self.reshard_after_backward:
            self.reshard()
        if with_grad:  # HSDP also all-reduces over the replicate group
            foreach_reduce(
                with_grad, grads,
                self.reduce_scatter_process_group or self.mesh_info.shard_process_group,
                self._orig_dtype, self._reduce_dtype, self.device, self.gradient_divide_factor,
                getattr(self.mesh_info, "replicate_process_group", None),
                self.force_sum_reduction_for_comms,
            )  # fmt: skip

    def _register_post_backward_hook(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Route the inputs that need grad (walked as [Note: walking a forward output] says)
        through an identity whose backward = post_backward."""
        if not torch.is_grad_enabled():
            return args, kwargs
        found = collect_grad_tensors((args, kwargs))
        if not found:
            return args, kwargs
        routed = RegisterPostBackwardFunction.apply(self, *found)
        return replace_grad_tensors((args, kwargs), iter(routed))

    @property
    def _all_gather_process_group(self):
        post_forward = self._sharded_state == ShardedState.SHARDED_POST_FORWARD
        return (self.post_forward_mesh_info if post_forward else self.mesh_info).shard_process_group

    def _validate_params(self) -> None:
        """Parameters must be materialized (not meta), and on CPU when offloading."""
        devices = [(p._param_fqn, p.sharded_param.device) for p in self.fsdp_params]
        if on_meta := [fqn for fqn, device in devices if device.type == "meta"]:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {on_meta}\n"
                "For example, call module.to_empty(device) to materialize to device and "
                "call module.reset_parameters() on each module to initialize values."
            )
        off_cpu = [(fqn, device) for fqn, device in devices if device.type != "cpu"]
        if isinstance(self.offload_policy, CPUOffloadPolicy) and off_cpu:
            raise RuntimeError(
                "FSDP parameters should be materialized on CPU when enabling CPU offloading. "
                'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
                "Found following parameters on non-CPU device: "
                f"{off_cpu}\n"
            )


def _get_param_module_infos(
    params: list[nn.Parameter], modules: tuple[nn.Module, ...]
) -> list[ParamModuleInfo]:
    """Find each param's first owner, recording every further (module, name) alias as shared."""
    wanted, infos = set(params), {}
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
    """Identity on the forward inputs; its backward runs the group's ``post_backward``. Under
    ``torch.func`` transforms it is batched as the identity (vmap) and passes tangents through
    (jvp: forward mode has no backward to hook)."""

    generate_vmap_rule = True

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

    @staticmethod
    def jvp(ctx, group_tangent: Any, *tangents: torch.Tensor):
        return tangents
