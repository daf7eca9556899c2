"""FSDP1 runtime: lazy init, forward, and the unshard context used by summon and the state dicts.

[Note: training states]
  ``IDLE``               parameters sharded; the only state in which summon/state-dict may start.
  ``FORWARD_BACKWARD``   inside ``forward`` of this module (its views point at the gathered tensor),
                         and in a backward from the first gradient that reaches the module (one of
                         its outputs', or, for a module whose parameters need no gradient, its
                         inputs') until that backward ends (see :func:`_enter_backward`).
  ``SUMMON_FULL_PARAMS`` inside :func:`_unshard_fsdp_state_params`: every original name is an
                         ``nn.Parameter`` with its full shape, a view into the gathered flat tensor.

[Note: a parent reading a wrapped child's parameter]  Some modules read a child's parameter
without calling the child (``nn.MultiheadAttention`` passes ``out_proj.weight`` to a functional
call). Upstream keeps the original names readable between unshards only as views into the flat
parameter's storage, which hold the full values at world size 1 (NO_SHARD) and not otherwise. The
reference instead gathers on access: while some FSDP forward runs, reading a managed parameter
name of an idle FSDP module's wrapped module (``FSDP.__getattr__``) returns its full view into a
fresh :meth:`~FlatParamHandle.unshard_for_compute`, so the gradient is reduce-scattered onto the
flat parameter as for the child's own forward. Every rank reads the same names in the same order,
so the all-gathers match; each read gathers once.

[Note: forward and backward]  The all-gather and the reduce-scatter form one autograd function
(``_flat_param._UnshardForCompute``): forward gathers the padded flat tensor, the module runs on
views of it, and the gradient of that tensor is reduce-scattered (averaged) onto the sharded flat
parameter. After forward the original names are resharded; under FULL_SHARD the gathered
storage is freed too. When the first gradient reaches an output of the module (pre-backward), the
storage is gathered again in place and the views come back; when the flat parameter's gradient
is accumulated (post-backward), they go away. SHARD_GRAD_OP keeps the gathered storage from
forward to backward. Left out: prefetching and side streams (overlap only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum, auto
from typing import Any

import torch
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves, tree_map_only

from reference._fsdp1._common_utils import _fsdp_modules, _FSDPState, _warn, clean_tensor_name
from reference._fsdp1._flat_param import FLAT_PARAM

# FSDP1 forwards now running (any tree): while > 0, a parent may read a child's parameter.
_running_forwards = 0


class TrainingState(Enum):
    """See [Note: training states]."""

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


def _lazy_init(state: _FSDPState) -> None:
    """First use of an FSDP tree (forward, state dict, load, summon) from ``state``.

    Casts each FSDP module's own buffers to its ``buffer_dtype`` (ignored buffers never), once.
    The original buffer dtypes were recorded at construction and are what state dicts save.
    A unit that has run a forward as the root of its own tree is refused as a non-root of a new
    one (upstream's rule; one that trained as a non-root may be wrapped again).
    """
    if state._lazy_init_done:
        return
    values = {fsdp._use_orig_params for fsdp in _fsdp_modules(state)}
    if len(values) > 1:  # the units of one tree share their handling of the original parameters
        raise ValueError(f"Expects one homogeneous value for _use_orig_params but got {values}")
    for fsdp in _fsdp_modules(state):
        if fsdp is not state and fsdp._ran_as_root:
            raise AssertionError(
                "Non-root FSDP instance's `_is_root` should not have been set yet or should have "
                "been set to `False`: a unit that ran a forward as a root cannot become a non-root"
            )
    for prefix, fsdp in state.named_modules():
        if isinstance(fsdp, _FSDPState) and fsdp._handle is not None:
            at = f"{prefix}." if prefix else ""
            fsdp._handle._root_fqns = [
                clean_tensor_name(at + f) for f in fsdp._handle.flat_param._fqns
            ]
    for fsdp in _fsdp_modules(state):
        if fsdp._lazy_init_done:
            continue
        fsdp._lazy_init_done = True
        dtype = fsdp.mixed_precision.buffer_dtype if fsdp.mixed_precision else None
        if dtype is None:
            continue
        for _, owner, name in fsdp._owned_buffers:
            buf = owner._buffers[name]
            if buf is not None and buf.is_floating_point():
                owner._buffers[name] = buf.to(dtype)


def _cast_forward_inputs(dtype: torch.dtype, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Floating-point tensors among the inputs cast to ``dtype``; everything else untouched."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if torch.is_floating_point(t) else t

    return tree_map_only(torch.Tensor, cast, args), tree_map_only(torch.Tensor, cast, kwargs)


def _forward(state: _FSDPState, *args: Any, **kwargs: Any) -> Any:
    """Gather this module's flat parameter, run the wrapped module on its views, reshard.

    The root lazily initialises the tree; every module casts its inputs when
    ``cast_forward_inputs``, and the root also when ``cast_root_forward_inputs``.
    """
    _lazy_init(state)
    state._ran_as_root = state._ran_as_root or state._is_root
    mp = state.mixed_precision
    if mp is not None and mp.param_dtype is not None:
        cast = mp.cast_forward_inputs or (state._is_root and mp.cast_root_forward_inputs)
        if cast:
            args, kwargs = _cast_forward_inputs(mp.param_dtype, args, kwargs)
    handle = state._handle
    if handle is None:
        return _run_wrapped(state, args, kwargs)
    if state.training_state == TrainingState.SUMMON_FULL_PARAMS:  # a backward may recompute it
        raise RuntimeError(
            f"FSDP forward called in state {state.training_state.name}; forward is only allowed "
            "when no summon_full_params / state_dict unshard is active on this module"
        )
    if handle._use_orig_params:  # R75: it needs a gradient iff some original parameter does
        handle.flat_param.requires_grad_(any(p.requires_grad for p in handle._orig_params))
    handle.prepare_orig_grads_for_forward()
    handle.writeback_replaced_data()
    padded = handle.unshard_for_compute()
    handle.use_unsharded_views(padded, as_params=False)
    state.training_state = TrainingState.FORWARD_BACKWARD
    try:
        output = _run_wrapped(state, args, kwargs)
    finally:
        handle.reshard()
        state.training_state = TrainingState.IDLE
    if torch.is_grad_enabled():
        if handle.flat_param.requires_grad:
            handle.post_forward(padded)
        else:  # frozen: no gradient of its own, but its backward still computes its inputs'
            _register_inputs_backward_hook(state, args, kwargs)
        _register_pre_backward_hooks(state, handle, output)
    return output


def _run_wrapped(state: _FSDPState, args: Any, kwargs: Any) -> Any:
    global _running_forwards
    _running_forwards += 1
    try:
        return state._fsdp_wrapped_module(*args, **kwargs)
    finally:
        _running_forwards -= 1


def _read_orig_param(state: _FSDPState, name: str) -> torch.Tensor | None:
    """The full view of ``state`` 's managed parameter ``name`` of its wrapped module, gathered
    for a parent that reads it (see [Note: a parent reading a wrapped child's parameter]); ``None``
    when no forward runs, ``state`` is not idle or ``name`` is not such a parameter."""
    handle = state._handle
    if handle is None or not _running_forwards or state.training_state != TrainingState.IDLE:
        return None
    module = handle._fully_sharded_module
    index = next((i for m, _, n, i in handle._all_names() if m is module and n == name), None)
    if index is None:
        return None
    handle.prepare_orig_grads_for_forward()
    return handle.unflatten(handle.unshard_for_compute())[index]


def _enter_backward(state: _FSDPState) -> None:
    """A gradient reached ``state`` 's module in a backward: it is busy (``FORWARD_BACKWARD``)
    until that backward ends, so ``summon_full_params`` refuses it meanwhile (R113). A backward
    reaching a module inside ``summon_full_params`` is refused (R90)."""
    if state.training_state == TrainingState.FORWARD_BACKWARD:
        return
    state._assert_idle()
    state.training_state = TrainingState.FORWARD_BACKWARD

    def backward_done() -> None:
        state.training_state = TrainingState.IDLE

    Variable._execution_engine.queue_callback(backward_done)


def _register_inputs_backward_hook(state: _FSDPState, args: Any, kwargs: Any) -> None:
    """A module whose parameters need no gradient enters the backward once the gradients of its
    inputs that need one are computed (no output hook runs when its output gets no gradient)."""
    inputs = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t) and t.requires_grad]
    if inputs:
        register_multi_grad_hook(inputs, lambda grads: _enter_backward(state))


def _register_pre_backward_hooks(state: _FSDPState, handle: Any, output: Any) -> None:
    """When a gradient w.r.t. an output arrives, enter the backward and call
    ``handle.pre_backward`` (nothing to gather for a frozen module: it kept its gathered tensor)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        _enter_backward(state)
        handle.pre_backward()
        return grad

    def register(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            t.register_hook(hook)
        return t

    tree_map_only(torch.Tensor, register, output)


def _validate_unshard_params_args(
    state: _FSDPState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> None:
    """Argument combinations upstream rejects (same exception types and texts)."""
    if with_grads and (offload_to_cpu or not state._use_orig_params):
        raise NotImplementedError(
            f"with_grads={with_grads}, use_orig_params={state._use_orig_params}, "
            f"offload_to_cpu={offload_to_cpu} is not supported yet"
        )
    if offload_to_cpu and state._handle and not state._handle.uses_sharded_strategy:
        raise NotImplementedError("offload_to_cpu=True and NO_SHARD is not supported yet")
    if writeback and rank0_only:
        raise NotImplementedError("writeback=True and rank0_only=True is not supported yet")


def _hide_flat_param(state: _FSDPState) -> None:
    if state._handle is not None:
        state._handle._fully_sharded_module._parameters.pop(FLAT_PARAM, None)


def _show_flat_param(state: _FSDPState) -> None:
    if state._handle is not None and not state._use_orig_params:
        state._handle._fully_sharded_module._parameters[FLAT_PARAM] = state._handle.flat_param


@contextlib.contextmanager
def _unshard_fsdp_state_params(
    state: _FSDPState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool = False,
) -> Iterator[None]:
    """Expose ``state`` 's own original parameters unsharded (not its nested FSDP modules').

    Every rank takes part in the all-gather. With ``rank0_only`` the other ranks drop the result
    at once and keep their sharded layout. With ``offload_to_cpu`` the exposed views live in a CPU
    copy (a no-op on a CPU compute device: the gathered tensor is already there). On exit,
    ``writeback`` copies this rank's range of the (possibly modified) full tensor into the shard.
    ``with_grads`` (use_orig_params only) also gathers the flat gradient and gives each original
    parameter its full ``.grad`` (a rank without a gradient contributes zeros). Original
    parameters whose ``.data`` the user replaced are written into the flat parameter first.
    """
    handle = state._handle
    if handle is None:
        yield
        return
    if offload_to_cpu and not rank0_only:
        _warn(
            "offload_to_cpu=True and rank0_only=False may result in the unsharded parameters "
            "being copied to CPU memory by every rank, which risks CPU OOM; prefer "
            "offload_to_cpu=True with rank0_only=True."
        )
    if state.training_state != TrainingState.IDLE:
        raise RuntimeError(
            f"Cannot unshard parameters of an FSDP module in state {state.training_state.name}; "
            "summon_full_params/state_dict must not be nested or run inside forward"
        )
    handle.writeback_replaced_data()  # what the user replaced shows inside, as in forward (R80)
    padded = handle.unshard_full_precision()
    if rank0_only and handle.rank != 0:
        if with_grads:  # rank 0's gradient gather needs this rank too; the result is dropped
            handle.gather_unsharded_grad()
        state.training_state = TrainingState.SUMMON_FULL_PARAMS
        try:
            yield
        finally:
            state.training_state = TrainingState.IDLE
        return
    if offload_to_cpu:
        padded = padded.cpu()
    _hide_flat_param(state)
    handle.use_unsharded_views(padded, as_params=True)
    if with_grads:
        handle.use_unsharded_grad_views()
    state.training_state = TrainingState.SUMMON_FULL_PARAMS
    try:
        yield
    finally:
        if writeback:
            handle.writeback(padded)
        handle.reshard()
        if with_grads:
            handle._use_sharded_grad_views()
        _show_flat_param(state)
        state.training_state = TrainingState.IDLE


@contextlib.contextmanager
def _unshard_params(
    module: torch.nn.Module,
    recurse: bool,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    """``summon_full_params``: unshard every FSDP module under ``module`` (or only ``module``).

    Refused before anything changes (upstream's AssertionError): a module inside forward/backward,
    or one already inside ``summon_full_params`` (nesting works only over disjoint modules, e.g.
    ``recurse=False`` on a parent, then an inner unit), and ``with_grads`` while a gradient
    accumulated under ``no_sync()`` waits for its reduction (it is no shard to gather)."""
    own = [module] if isinstance(module, _FSDPState) else []
    states = _fsdp_modules(module) if recurse else own
    for state in states:
        _validate_unshard_params_args(state, writeback, rank0_only, offload_to_cpu, with_grads)
        if state.training_state == TrainingState.FORWARD_BACKWARD:
            raise AssertionError("Cannot manually unshard parameters during forward/backward")
        if state.training_state == TrainingState.SUMMON_FULL_PARAMS:
            raise AssertionError(
                "Cannot manually unshard parameters when already unsharding parameters"
            )
        if with_grads and state._handle and state._handle._unsynced_grad is not None:
            raise AssertionError(
                "summon_full_params(with_grads=True) cannot show gradients accumulated under "
                "no_sync(): they are unsharded and unreduced, not this rank's shard; run a "
                "backward outside no_sync() first"
            )
    for state in states:
        _lazy_init(state)
    with contextlib.ExitStack() as stack:
        for state in states:
            stack.enter_context(
                _unshard_fsdp_state_params(state, writeback, rank0_only, offload_to_cpu, with_grads)
            )
        yield
