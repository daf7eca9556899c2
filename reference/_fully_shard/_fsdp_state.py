"""``FSDPState``: the per-module hooks that drive a parameter group through an iteration.

[Note: root and lazy init]
``fully_shard`` is applied bottom-up, so no call knows which module will be the root. The *root*
is the first FSDP module to run forward; then (*lazy init*) it walks its subtree, marks every
other state non-root, shares one ``FSDPStateContext`` among them, names parameters by FQN,
re-pads shards the user may have replaced and registers the state-dict hooks. A state already
lazily initialized by its own forward is an error, as is a grouped ``fully_shard([a, b])``
becoming the root. With ``reshard_after_forward=None`` the root keeps its parameters after
forward (backward needs them first) and every other module reshards.

Hook order for one module: forward pre-hook (root: lazy init; cast inputs to ``param_dtype``;
unshard) → ``forward`` → forward hook (reshard per ``reshard_after_forward``; register the
pre-backward hook on the outputs; cast outputs to ``output_dtype``) → in backward: pre-backward
(unshard; prefetch) → gradients → post-backward (reshard, reduce-scatter) → root's final callback (runs
post-backward for groups autograd never reached, then returns every state to ``IDLE``).

[Note: implicit backward prefetch]
Backward runs the units roughly in reverse forward order, so without explicit backward prefetching
(``set_modules_to_backward_prefetch``) a unit's pre-backward, right after its own unshard, starts
the all-gather of the unit whose post-forward ran just before its own in the forward being
differentiated: that gather is under way while this unit's gradients are computed. The shared
context records the order of the post-forwards of units with parameters run with grad enabled (a
unit run twice appears twice), each state its positions in it; a pre-backward takes its last
position. The root's final callback (and ``reset_iter_state``) clears the record.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed._composable_state import _get_module_state, _insert_module_state, _State
from torch.distributed.utils import _apply_to_tensors, _to_kwargs

from ._fsdp_api import MixedPrecisionPolicy
from ._fsdp_common import TrainingState, _cast_fp_tensor, _warn
from ._fsdp_param_group import FSDPParamGroup
from ._grad_tensors import collect_grad_tensors


def _get_module_fsdp_state(module: nn.Module) -> FSDPState | None:
    """The reference ``FSDPState`` of ``module``, found through torch's composable-API state map
    (see [Note: where a module's state lives] in ``_fully_shard.py``); ``None`` for any other."""
    state = _get_module_state(module)
    return state if isinstance(state, FSDPState) else None


class FSDPStateContext:
    """What every state under one root shares (the root's instance replaces the others)."""

    def __init__(self) -> None:
        self.all_states: list[FSDPState] = []  # root first, then pre-order
        self.iter_forward_root: FSDPState | None = None  # the state whose forward is running
        self.post_backward_final_callback_queued = False
        self.post_forward_order: list[FSDPState] = []  # [Note: implicit backward prefetch]
        # set_is_last_backward: upstream waits for its pending reductions at the end of the last
        # backward; every reduction here is finished when post-backward returns, so it is kept
        # for the API only.
        self.is_last_backward = True


class FSDPState(_State):
    """The hooks and bookkeeping of one ``fully_shard`` call over ``modules``.

    ``_fsdp_param_group`` is ``None`` when the modules manage no parameters (the state still
    takes part in root selection, input casting and lazy init)."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
    ) -> None:
        self._modules, self._device, self._mp_policy = modules, device, mp_policy
        self._auto_reshard_after_forward = auto_reshard_after_forward  # reshard_after_forward=None
        self._fsdp_param_group: FSDPParamGroup | None = None
        self._is_root: bool | None = None  # decided at lazy init
        self._state_ctx = FSDPStateContext()
        self._training_state = TrainingState.IDLE
        self._modules_to_run_forward: set[nn.Module] = set()  # grouped fully_shard only
        # [Note: explicit prefetching] set_modules_to_forward_prefetch / ..._backward_prefetch:
        # the states whose all-gather this state starts right after its own unshard in forward
        # (backward); each one's own pre-forward (pre-backward) then only waits for it.
        self._states_to_forward_prefetch: list[FSDPState] = []
        self._states_to_backward_prefetch: list[FSDPState] = []
        self._post_forward_indices: list[int] = []  # positions in post_forward_order
        for module in modules:
            _insert_module_state(module, self)  # a weak reference: the module holds the state
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
        root_module, ctx = self._modules[0], self._state_ctx
        for module_name, module in root_module.named_modules():
            if (state := _get_module_fsdp_state(module)) is None or state in ctx.all_states:
                continue
            if module is not root_module:
                if state._is_root is not None:
                    raise RuntimeError(
                        f"FSDP state has already been lazily initialized for {module_name}\n"
                        "FSDP requires running forward through the root module first"
                    )
                state._is_root = False
            ctx.all_states.append(state)
            state._state_ctx = ctx
        groups = [s._fsdp_param_group for s in ctx.all_states if s._fsdp_param_group is not None]
        if self._auto_reshard_after_forward and self._fsdp_param_group is not None:
            self._fsdp_param_group.post_forward_mesh_info = None  # the root keeps its params
        fsdp_params = {p.sharded_param: p for group in groups for p in group.fsdp_params}
        for name, param in root_module.named_parameters():  # FQNs, for messages
            if param in fsdp_params:
                fsdp_params[param]._param_fqn = name
        seen: set[int] = set()
        for fsdp_param in fsdp_params.values():
            if fsdp_param._orig_param_uid in seen:
                raise ValueError(
                    f"Parameter '{fsdp_param._param_fqn}' is shared with a parameter already "
                    "managed by another FSDP group. For shared/tied parameters, use "
                    "fully_shard([module_a, module_b]) to place them in the same FSDP group."
                )
            seen.add(fsdp_param._orig_param_uid)
        for group in groups:
            group.lazy_init()

    # ---- forward -------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        group = self._fsdp_param_group
        if self._training_state == TrainingState.PRE_BACKWARD:  # recomputation in backward
            if group is not None:
                group.unshard()
                group.wait_for_unshard()
            return self._cast_forward_inputs(args, kwargs)
        if self._training_state != TrainingState.FORWARD:  # the first module of the group
            self._training_state = TrainingState.FORWARD
            args, kwargs = self._root_pre_forward(args, kwargs)
        args, kwargs = self._cast_forward_inputs(args, kwargs)
        if group is not None:
            args, kwargs = group.pre_forward(module, args, kwargs)
        for state in self._states_to_forward_prefetch:
            if state._fsdp_param_group is not None:
                state._fsdp_param_group.unshard()
        return args, kwargs

    def _root_pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        if self._state_ctx.iter_forward_root is not None:
            return args, kwargs  # not the root of this forward
        self._state_ctx.iter_forward_root = self
        if self._device.type != "cpu" and (args or kwargs):
            args_tuple, kwargs_tuple = _to_kwargs(args, kwargs, self._device, False)
            args, kwargs = args_tuple[0], kwargs_tuple[0]
        return args, kwargs

    def _post_forward(self, module: nn.Module | None, input: Any, output: Any) -> Any:
        if self._training_state == TrainingState.PRE_BACKWARD:
            return self._cast_output_dtype(output)
        if self._fsdp_param_group is not None:
            output = self._fsdp_param_group.post_forward(module, input, output)
            if torch.is_grad_enabled():
                self._post_forward_indices.append(len(self._state_ctx.post_forward_order))
                self._state_ctx.post_forward_order.append(self)
        output = self._register_pre_backward_hook(output)
        self._training_state = TrainingState.IDLE
        if self._state_ctx.iter_forward_root is self:
            # Finish grouped states some of whose modules never ran forward in this pass.
            for state in reversed(self._state_ctx.all_states):
                if state is not self and state._modules_to_run_forward:
                    state._modules_to_run_forward.clear()
                    output = state._post_forward(None, None, output)
            self._state_ctx.iter_forward_root = None
        return self._cast_output_dtype(output)

    def _cast_forward_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        policy = self._mp_policy
        if not (policy.cast_forward_inputs and policy.param_dtype):
            return args, kwargs
        cast = functools.partial(_cast_fp_tensor, policy.param_dtype)
        return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)

    def _cast_output_dtype(self, output: Any) -> Any:
        if (dtype := self._mp_policy.output_dtype) is None:
            return output
        return _apply_to_tensors(functools.partial(_cast_fp_tensor, dtype), output)

    # ---- backward ------------------------------------------------------------------------------
    def _register_pre_backward_hook(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        for t in collect_grad_tensors(output):  # [Note: walking a forward output]
            if t._base is not None:
                names = ", ".join(type(m).__name__ for m in self._modules)
                _warn(
                    f"FSDP2-wrapped module ({names}) returned a view tensor; an in-place op on it "
                    "would drop the pre-backward hook. Use out-of-place ops or clone() it first."
                )
            t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self._training_state = TrainingState.PRE_BACKWARD
        if not self._state_ctx.post_backward_final_callback_queued:
            self._state_ctx.post_backward_final_callback_queued = True
            Variable._execution_engine.queue_callback(self._root_post_backward_final_callback)
        group = self._fsdp_param_group
        if group is not None and group._training_state != TrainingState.PRE_BACKWARD:
            group.pre_backward()
            if not self._states_to_backward_prefetch:
                self._prefetch_previous_in_forward()
        for state in self._states_to_backward_prefetch:
            if (group := state._fsdp_param_group) is not None and group.unshard_in_backward:
                group.unshard()
        return grad

    def _prefetch_previous_in_forward(self) -> None:
        """[Note: implicit backward prefetch]: unshard the unit whose post-forward ran just before
        this one's (none for the first, or for a second backward of the same forward)."""
        if not self._post_forward_indices:
            return
        index = self._post_forward_indices.pop()
        if index > 0:
            group = self._state_ctx.post_forward_order[index - 1]._fsdp_param_group
            if group.unshard_in_backward:
                group.unshard()

    def _reset_iter_state(self) -> None:
        """After a forward or backward that raised: every state under this root back to
        ``IDLE``, every group ``SHARDED`` with no pending all-gather, no forward root."""
        if self._is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        ctx = self._state_ctx
        ctx.post_forward_order.clear()
        for state in ctx.all_states or [self]:
            state._post_forward_indices.clear()
            state._modules_to_run_forward.clear()
            state._training_state = TrainingState.IDLE
            if state._fsdp_param_group is not None:
                state._fsdp_param_group.reset_iter_state()
        ctx.iter_forward_root = None
        ctx.post_backward_final_callback_queued = False

    def _root_post_backward_final_callback(self) -> None:
        ctx = self._state_ctx
        ctx.iter_forward_root = None
        ctx.post_forward_order.clear()
        for state in ctx.all_states:
            state._post_forward_indices.clear()
            state._modules_to_run_forward.clear()
            if (group := state._fsdp_param_group) is not None:
                if group._training_state != TrainingState.POST_BACKWARD:
                    group.post_backward()  # autograd never reached its inputs
                group.discard_pending_unshard()
                group._training_state = TrainingState.IDLE
            state._training_state = TrainingState.IDLE
        ctx.post_backward_final_callback_queued = False
