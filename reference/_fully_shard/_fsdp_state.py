"""``FSDPState``: the per-module hooks that drive the parameter groups through an iteration.

[Note: root and lazy init]
``fully_shard`` is applied bottom-up, so no call knows which module will be the root. The *root*
is the first FSDP module to run forward; at that moment (*lazy init*) it walks its subtree, marks
every other state non-root, shares one ``FSDPStateContext`` among them, records parameter and
module FQNs, re-pads shards the user may have replaced, and registers the state-dict hooks.
A state that was already lazily initialized by running forward on its own is an error, as is a
grouped ``fully_shard([a, b])`` becoming the root. With ``reshard_after_forward=None`` the root
keeps its parameters after forward (backward needs them first) and every other module reshards.

Hook order for one module: forward pre-hook (root: lazy init; cast inputs to ``param_dtype``;
unshard) → ``forward`` → forward hook (reshard per ``reshard_after_forward``; register the
pre-backward hook on the outputs; cast outputs to ``output_dtype``) → in backward: pre-backward
(unshard) → gradients → post-backward (reshard, reduce-scatter) → root's final callback (runs
post-backward for groups autograd never reached, then returns every state to ``IDLE``).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.utils import _apply_to_tensors, _to_kwargs
from torch.utils._pytree import tree_leaves

from ._fsdp_api import MixedPrecisionPolicy
from ._fsdp_common import TrainingState, _cast_fp_tensor
from ._fsdp_param_group import FSDPParamGroup

_module_to_state: weakref.WeakKeyDictionary[nn.Module, FSDPState] = weakref.WeakKeyDictionary()


class FSDPStateContext:
    """What every state under one root shares (the root's instance replaces the others)."""

    def __init__(self) -> None:
        self.all_states: list[FSDPState] = []  # root first, then pre-order
        self.iter_forward_root: FSDPState | None = None  # the state whose forward is running
        self.post_backward_final_callback_queued = False
        self.is_last_backward = True


class FSDPState:
    """The hooks and bookkeeping of one ``fully_shard`` call."""

    def __init__(self) -> None:
        self._fsdp_param_groups: list[FSDPParamGroup] = []
        self._is_root: bool | None = None  # decided at lazy init
        self._state_ctx = FSDPStateContext()
        self._training_state = TrainingState.IDLE
        self._modules_to_run_forward: set[nn.Module] = set()  # grouped fully_shard only
        self._auto_reshard_after_forward: bool | None = True

    @property
    def _fsdp_param_group(self) -> FSDPParamGroup | None:
        """The single parameter group, or ``None`` when the modules manage no parameters."""
        return self._fsdp_param_groups[0] if self._fsdp_param_groups else None

    def init(
        self,
        modules: tuple[nn.Module, ...],
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
    ) -> None:
        for module in modules:
            _module_to_state[module] = self
        self._modules = modules
        self._device = device
        self._mp_policy = mp_policy
        self._auto_reshard_after_forward = auto_reshard_after_forward
        if len(modules) == 1:
            modules[0].register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            modules[0].register_forward_hook(self._post_forward, prepend=False)
            return

        # Grouped: the pre-hook runs before each module; the full post-forward runs after the
        # last module of the group to run forward (earlier ones only cast their output).
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict):
            if not self._modules_to_run_forward:
                self._modules_to_run_forward.update(modules)
            return self._pre_forward(module, args, kwargs)

        def post_hook(module: nn.Module, input: Any, output: Any):
            if module in self._modules_to_run_forward:
                self._modules_to_run_forward.remove(module)
                if not self._modules_to_run_forward:
                    return self._post_forward(module, input, output)
            return self._cast_output_dtype(output)

        for module in modules:
            module.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(post_hook, prepend=False, always_call=True)

    # ---- lazy init -----------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self._is_root is not None:
            return  # already initialized
        self._is_root = True
        if len(self._modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {self._modules}")
        root_module = self._modules[0]
        visited: set[FSDPState] = set()
        for module_name, module in root_module.named_modules():
            if (state := _get_module_fsdp_state(module)) is None:
                continue
            if module is not root_module:
                if state not in visited and state._is_root is not None:
                    raise RuntimeError(
                        "FSDP state has already been lazily initialized for "
                        f"{module_name}\nFSDP requires running forward through the root "
                        "module first"
                    )
                state._is_root = False
            if state not in visited:
                self._state_ctx.all_states.append(state)
                visited.add(state)
        if self._auto_reshard_after_forward:  # None: the root keeps its params after forward
            for group in self._fsdp_param_groups:
                group.post_forward_mesh_info = None
        self._init_fqns()
        for state in self._state_ctx.all_states:
            state._state_ctx = self._state_ctx
        self._validate_no_duplicate_params()
        for state in self._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.lazy_init()

    def _init_fqns(self) -> None:
        root_module = self._modules[0]
        param_to_fsdp_param, module_to_group = {}, {}
        for state in self._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    param_to_fsdp_param[fsdp_param.sharded_param] = fsdp_param
                for module in group.modules:
                    module_to_group.setdefault(module, []).append(group)
        for name, param in root_module.named_parameters():
            if param in param_to_fsdp_param:
                param_to_fsdp_param[param]._param_fqn = name
        for name, module in root_module.named_modules():
            for group in module_to_group.get(module, []):
                fqn = group._module_fqn
                group._module_fqn = name if fqn is None else f"{fqn}, {name}"

    def _validate_no_duplicate_params(self) -> None:
        seen: set[int] = set()
        for state in self._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    if fsdp_param._orig_param_uid in seen:
                        raise ValueError(
                            f"Parameter '{fsdp_param._param_fqn}' is shared with a parameter "
                            "already managed by another FSDP group. For shared/tied "
                            "parameters, use fully_shard([module_a, module_b]) to place them "
                            "in the same FSDP group."
                        )
                    seen.add(fsdp_param._orig_param_uid)

    # ---- forward -------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._training_state == TrainingState.PRE_BACKWARD:  # recomputation in backward
            for group in self._fsdp_param_groups:
                group.unshard()
                group.wait_for_unshard()
            return self._cast_forward_inputs(args, kwargs)
        first_in_pass = self._training_state != TrainingState.FORWARD
        self._training_state = TrainingState.FORWARD
        if first_in_pass:
            args, kwargs = self._root_pre_forward(module, args, kwargs)
        args, kwargs = self._cast_forward_inputs(args, kwargs)
        for group in self._fsdp_param_groups:
            args, kwargs = group.pre_forward(module, args, kwargs)
        return args, kwargs

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        self._lazy_init()
        if self._state_ctx.iter_forward_root is not None:
            return args, kwargs  # not the root of this forward
        self._state_ctx.iter_forward_root = self
        if self._device.type != "cpu" and (args or kwargs):
            args_tuple, kwargs_tuple = _to_kwargs(args, kwargs, self._device, False)
            args, kwargs = args_tuple[0], kwargs_tuple[0]
        return args, kwargs

    def _post_forward(self, module: nn.Module, input: Any, output: Any) -> Any:
        if self._training_state == TrainingState.PRE_BACKWARD:
            return self._cast_output_dtype(output)
        for group in self._fsdp_param_groups:
            output = group.post_forward(module, input, output)
        output = self._register_pre_backward_hook(output)
        self._training_state = TrainingState.IDLE
        if self._state_ctx.iter_forward_root is self:
            output = self._force_complete_incomplete_states(output)
            self._state_ctx.iter_forward_root = None
        return self._cast_output_dtype(output)

    def _force_complete_incomplete_states(self, output: Any) -> Any:
        """Finish grouped states some of whose modules never ran forward in this pass."""
        for state in reversed(self._state_ctx.all_states):
            if state is self or not state._modules_to_run_forward:
                continue
            for group in state._fsdp_param_groups:
                output = group.post_forward(None, None, output)
            output = state._register_pre_backward_hook(output)
            state._training_state = TrainingState.IDLE
            output = state._cast_output_dtype(output)
            state._modules_to_run_forward.clear()
        return output

    def _cast_forward_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        policy = self._mp_policy
        if not (policy.cast_forward_inputs and policy.param_dtype):
            return args, kwargs
        cast = functools.partial(_cast_fp_tensor, policy.param_dtype)
        return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)

    def _cast_output_dtype(self, output: Any) -> Any:
        if self._mp_policy.output_dtype is None:
            return output
        return _apply_to_tensors(
            functools.partial(_cast_fp_tensor, self._mp_policy.output_dtype), output
        )

    # ---- backward ------------------------------------------------------------------------------
    def _register_pre_backward_hook(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        for t in tree_leaves(output):
            if not (isinstance(t, torch.Tensor) and t.requires_grad):
                continue
            if t._base is not None:
                warnings.warn(
                    f"FSDP2-wrapped module ({', '.join(type(m).__name__ for m in self._modules)}"
                    ") returned a view tensor; an in-place op on it would drop the pre-backward "
                    "hook. Use out-of-place ops or clone() the output first.",
                    UserWarning,
                    stacklevel=2,
                )
            t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self._training_state = TrainingState.PRE_BACKWARD
        if not self._state_ctx.post_backward_final_callback_queued:
            self._state_ctx.post_backward_final_callback_queued = True
            Variable._execution_engine.queue_callback(self._root_post_backward_final_callback)
        for group in self._fsdp_param_groups:
            group.pre_backward()
        return grad

    def _root_post_backward_final_callback(self) -> None:
        ctx = self._state_ctx
        ctx.iter_forward_root = None
        for state in ctx.all_states:
            state._modules_to_run_forward.clear()
            for group in reversed(state._fsdp_param_groups):
                if group._training_state != TrainingState.POST_BACKWARD:
                    group.post_backward()  # autograd never reached its inputs
                group._training_state = TrainingState.IDLE
            state._training_state = TrainingState.IDLE
            if ctx.is_last_backward:
                for group in state._fsdp_param_groups:
                    group.finalize_backward()
        ctx.post_backward_final_callback_queued = False


def _get_module_fsdp_state(module: nn.Module) -> FSDPState | None:
    return _module_to_state.get(module)
