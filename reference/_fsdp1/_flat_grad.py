"""Gradient handling of FSDP1's flat parameter (mixed into :class:`FlatParamHandle`).

Rules:
  reduction       after a synced backward the padded unsharded gradient (in the reduce dtype) is
                  summed over the ranks and divided by the world size; a sharded strategy keeps
                  this rank's chunk (reduce-scatter), NO_SHARD keeps all of it (all-reduce).
  no_sync()       backwards outside synchronisation add their padded unsharded gradients up; the
                  next synced backward reduces that sum plus its own gradient, once.
  dtypes          the flat gradient accumulates in the parameter dtype; with
                  ``keep_low_precision_grads`` the optimizer sees it in low precision (the compute
                  dtype after a reduce-scatter, the reduce dtype under NO_SHARD).
  gradient views  with ``use_orig_params=True`` each original ``.grad`` is a view into the flat
                  gradient: the part of the parameter in this rank's shard (None where that part
                  is empty), or, inside ``summon_full_params(with_grads=True)``, the full-shape
                  view into the gathered gradient. Clearing every original ``.grad``
                  (``zero_grad``) drops the flat gradient too.
  cleared grads   an original ``.grad`` the user set to None (not all of them) is a zero part
                  of the flat gradient once the flat gradient is next used (forward, summon);
                  that parameter's sharded view stays None until a backward gives it a
                  gradient again: leaving ``summon_full_params(with_grads=True)``, which shows
                  it as full zeros, gives it back None.
  no_sync grads   a backward inside ``no_sync()`` leaves each rank its own unreduced,
                  unsharded gradient, which is no shard: ``summon_full_params(with_grads=True)``
                  refuses it (AssertionError, before any collective) until a synced backward.
  optimizer in    with ``use_orig_params=True``, an original parameter carrying optimizers from
  backward        ``torch.distributed.optim._apply_optimizer_in_backward`` (its
                  ``_in_backward_optimizers``) has them stepped on its sharded gradient as soon as
                  the unit's gradient is reduced, and that gradient is then cleared (None).

The mixin reads the handle's attributes (``flat_param``, ``process_group``, ``world_size``,
``uses_sharded_strategy``, the dtypes, ``_orig_params``) and its ``_gather`` / ``unflatten``; it
imports nothing from :mod:`reference._fsdp1._flat_param`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from reference._fsdp1._collectives import reduce_scatter_single


class FlatGradHandling:
    """The gradient half of :class:`reference._fsdp1._flat_param.FlatParamHandle`."""

    @torch.no_grad()  # also under backward(create_graph=True): a comm hook records nothing
    def _reduce_grad(self, grad_padded: torch.Tensor) -> torch.Tensor:
        """Sum the unsharded gradient over ranks in the reduce dtype, keep this rank's part and
        divide by the world size; a registered comm hook (``comm_hook``) does the communication
        and any division instead."""
        grad = grad_padded.to(self._reduce_dtype).contiguous()
        if self.comm_hook is not None:  # the hook communicates (and divides, if it wants to)
            hook, hook_state = self.comm_hook
            if self.uses_sharded_strategy:
                out = grad.new_empty(grad.numel() // self.world_size)
                hook(hook_state, grad, out)
            else:
                out = grad.clone() if grad is grad_padded else grad
                hook(hook_state, out)
            return out if self._keep_low_precision_grads else out.to(self.flat_param.dtype)
        if self.uses_sharded_strategy:
            out = grad.new_empty(grad.numel() // self.world_size)
            reduce_scatter_single(out, grad, self.process_group)
        else:
            out = grad.clone() if grad is grad_padded else grad
            dist.all_reduce(out, group=self.process_group)
        out.div_(self.world_size)
        return out if self._keep_low_precision_grads else out.to(self.flat_param.dtype)

    def _add_unsynced_grad(self, grad_padded: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """``grad_padded`` plus the gradient accumulated under no_sync(); kept for later with
        ``keep``, else handed over (and forgotten) for reduction."""
        total = grad_padded if self._unsynced_grad is None else self._unsynced_grad + grad_padded
        self._unsynced_grad = total if keep else None
        return total

    @torch.no_grad()
    def _grad_to_full_precision(self) -> None:
        """Before a backward adds to it, a low-precision flat gradient (kept from the previous
        step by ``keep_low_precision_grads``) goes back to the parameter dtype."""
        grad = self.flat_param.grad
        if grad is not None and grad.dtype != self.flat_param.dtype:
            grad.data = grad.to(self.flat_param.dtype)

    def _grad_to_optimizer_precision(self) -> None:
        """After the reduction: with ``keep_low_precision_grads`` the optimizer sees the low
        precision: the compute dtype after a reduce-scatter, the reduce dtype where nothing is
        sharded (NO_SHARD never casts back)."""
        grad = self.flat_param.grad
        if self._keep_low_precision_grads and grad is not None:
            low = self._compute_dtype if self.uses_sharded_strategy else self._reduce_dtype
            grad.data = grad.to(low)

    @torch.no_grad()
    def writeback_grad(self) -> None:
        """summon_full_params(with_grads=True, writeback=True) exits: this rank's range of the
        gathered gradient (changed in place by the user or not) goes back into the flat
        gradient."""
        padded, grad = getattr(self, "_summoned_grad", None), self.flat_param.grad
        if padded is None or grad is None or padded.data_ptr() == grad.data_ptr():
            return
        if not self.uses_sharded_strategy:
            grad.copy_(padded[: grad.numel()])
        else:
            n = self._end - self._start
            grad[:n].copy_(padded[self._start : self._end])

    def _use_sharded_grad_views(self) -> None:
        """Each original ``.grad`` becomes its part of this rank's flat gradient (None without
        elements here, or when cleared by the user since the last backward)."""
        self._summoned_grad = None
        grad = self.flat_param.grad
        parts = [None] * len(self._orig_params) if grad is None else self._grad_parts(grad)
        for i, (p, part) in enumerate(zip(self._orig_params, parts)):
            if part is None or i in self._cleared_grads:
                p.grad = None
            else:
                _set_grad(p, part)

    def _step_optimizers_in_backward(self) -> None:
        """See "optimizer in backward" above: runs after :meth:`_use_sharded_grad_views`; a
        parameter without elements on this rank (no ``.grad``) is not stepped here."""
        stepped = False
        for p in self._orig_params:
            optimizers = getattr(p, "_in_backward_optimizers", ())
            if p.grad is None or not optimizers:
                continue
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            stepped = True
        if stepped and all(p.grad is None for p in self._orig_params):
            self.flat_param.grad = None

    @torch.no_grad()
    def use_unsharded_grad_views(self) -> None:
        """Each original parameter's ``.grad`` becomes its full-shape view into the gathered flat
        gradient (zeros stand in for a missing local gradient, e.g. every ``.grad`` of this rank
        cleared by the user, so every rank joins the gather; None when no rank has one)."""
        padded = self.gather_unsharded_grad()
        if padded is None:  # no gradient anywhere yet: every .grad stays None
            for p in self._orig_params:
                p.grad = None
            return
        self._summoned_grad = padded if self.flat_param.grad is not None else None  # writeback
        for p, g in zip(self._orig_params, self.unflatten(padded)):
            p.grad = g

    @torch.no_grad()
    def gather_unsharded_grad(self) -> torch.Tensor | None:
        """The collectives of ``use_unsharded_grad_views``, which every rank joins (also one that
        shows nothing, under ``rank0_only``): the gathered padded flat gradient, or None when no
        rank has one. With ``use_orig_params`` the original ``.grad`` s are written into the flat
        gradient first, as before a forward: a gradient the user assigned is shown in full."""
        self.prepare_orig_grads_for_forward()
        if all(p.grad is None for p in self._orig_params):  # cleared by the user: none here
            self.flat_param.grad = None
        grad = self.flat_param.grad
        if not _any_rank_has(grad, self):
            return None
        local = grad if grad is not None else torch.zeros_like(self.flat_param)
        return self._gather(local.detach(), local.dtype)

    @torch.no_grad()
    def prepare_orig_grads_for_forward(self) -> None:
        """use_orig_params=True: the original ``.grad`` s are what the next backward accumulates
        onto. Every one None (``zero_grad``): the flat gradient is dropped. Otherwise a None one
        zeroes its part of the flat gradient and one the user assigned (a tensor that is not a
        view into the flat gradient) to a parameter with elements here is copied into its part (a
        zero flat gradient is made when there is none). An assigned gradient with another number
        of elements than its part cannot be copied: RuntimeError "Cannot writeback when the
        gradient shape changes"."""
        if not self._use_orig_params:
            return
        self._cleared_grads = {i for i, p in enumerate(self._orig_params) if p.grad is None}
        if all(p.grad is None for p in self._orig_params):
            self.flat_param.grad = None
            return
        grad = self.flat_param.grad
        storage = None if grad is None else grad.untyped_storage().data_ptr()
        here = [
            not self.uses_sharded_strategy or i.in_shard for i in self.flat_param._shard_param_infos
        ]
        assigned = [  # one assigned to a parameter without elements here carries nothing (R88)
            held and p.grad is not None and p.grad.untyped_storage().data_ptr() != storage
            for p, held in zip(self._orig_params, here)
        ]
        if grad is None:
            if not any(assigned):
                return
            grad = self.flat_param.grad = torch.zeros_like(self.flat_param)
        parts = self._grad_parts(grad)
        for fqn, p, part, new in zip(self.flat_param._fqns, self._orig_params, parts, assigned):
            if new and part is not None and p.grad.numel() != part.numel():
                raise RuntimeError(
                    f"Cannot writeback when the gradient shape changes: {fqn} expects "
                    f"{part.numel()} elements but got {tuple(p.grad.shape)}"
                )
        for p, part, new in zip(self._orig_params, parts, assigned):
            if part is None:
                continue
            if p.grad is None:
                part.zero_()
            elif new:
                part.copy_(p.grad.reshape(part.shape))

    def _grad_parts(self, grad: torch.Tensor) -> list[torch.Tensor | None]:
        """Each original parameter's part of the flat gradient ``grad`` (its full-shape view
        under NO_SHARD, its 1-D part of this rank's shard otherwise; None without elements)."""
        if not self.uses_sharded_strategy:
            return list(self.unflatten(grad))
        return [
            grad[i.offset_in_shard : i.offset_in_shard + i.numel_in_shard] if i.in_shard else None
            for i in self.flat_param._shard_param_infos
        ]


def _any_rank_has(grad: torch.Tensor | None, handle) -> bool:
    """Whether some rank of the handle's group holds a flat gradient (NO_SHARD: this rank)."""
    if not handle.uses_sharded_strategy:
        return grad is not None
    flag = torch.tensor([float(grad is not None)], device=handle.flat_param.device)
    dist.all_reduce(flag, group=handle.process_group)
    return bool(flag.item())


def _set_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad = grad``, also for a low-precision ``grad`` of an fp32 ``param``
    (``keep_low_precision_grads``): torch refuses a ``.grad`` of another dtype on assignment, so
    that gradient goes in through ``.data`` of a placeholder of the parameter's shape."""
    if grad.dtype == param.dtype:
        param.grad = grad
        return
    if param.grad is None or param.grad.shape != param.shape:
        param.grad = torch.empty_like(param)
    param.grad.data = grad
