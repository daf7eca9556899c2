"""Test-only tensor subclasses for the all-gather extension protocol (area "extensions", P14).

[Note: PairTensor]
A wrapper tensor subclass holding two tensors of its shape: ``a`` (the values) and ``b`` (a
companion that starts as ``-a``). Every aten op runs on both (so chunking, padding, copying and
viewing keep ``b == -a`` everywhere, zeros included), which is all FSDP needs to shard it.
It all-gathers through the extension hooks: ``fsdp_pre_all_gather`` hands FSDP *two* plain
inputs ``(a, b)``; ``fsdp_post_all_gather`` receives both gathered tensors and returns a plain
unsharded tensor (a view of the gathered ``a``, trimmed to the global size) plus both gathered
tensors to free; on later all-gathers FSDP passes ``out=`` (the unsharded parameter made from the
first result), whose storage the new all-gather has refilled.
``Pair1`` has the legacy 1-argument pre hook ``(mesh)``; ``Pair5`` the 5-argument one
``(mesh, outer_size, outer_stride, module, mp_policy)``, which pads its inputs to the padded shard
size when the local shard is shorter (uneven dim 0); ``Flat5`` returns its one input flattened
to 1-D (allowed for an even dim 0 only).
Every hook call is appended to :data:`LOG` (clones of what it saw) for the checks to inspect.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from conformance.checks._shared.rows import chunk_size

LOG: list[dict] = []


class PairTensor(torch.Tensor):
    """Two same-shaped tensors behaving as one (see the module Note)."""

    @staticmethod
    def __new__(cls, a: torch.Tensor, b: torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
        return torch.Tensor._make_wrapper_subclass(
            cls,
            a.shape,
            strides=a.stride(),
            storage_offset=a.storage_offset(),
            dtype=a.dtype,
            device=a.device,
            requires_grad=False,
        )

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a = a
        self.b = b

    def __repr__(self):
        return f"{type(self).__name__}(a={self.a}, b={self.b})"

    def __tensor_flatten__(self):
        return ["a", "b"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["a"], inner["b"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out_a = func(
            *tree_map_only(PairTensor, lambda t: t.a, args),
            **tree_map_only(PairTensor, lambda t: t.a, kwargs),
        )
        out_b = func(
            *tree_map_only(PairTensor, lambda t: t.b, args),
            **tree_map_only(PairTensor, lambda t: t.b, kwargs),
        )
        if func._schema.is_mutable:  # in place / out=: return the mutated wrapper
            first = args[0] if args and isinstance(args[0], PairTensor) else kwargs.get("out")
            if isinstance(first, PairTensor):
                return first
        flat_a, spec = tree_flatten(out_a)
        flat_b, _ = tree_flatten(out_b)
        wrapped = [cls(x, y) if isinstance(x, torch.Tensor) else x for x, y in zip(flat_a, flat_b)]
        return tree_unflatten(wrapped, spec)

    # -- all-gather extension: post hook shared by both signatures ---------------------------
    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        gathered_a, *rest = all_gather_outputs  # (a, b), or (a,) for Single5
        assert len(rest) == (0 if metadata.get("single") else 1), (
            f"post hook got {len(all_gather_outputs)} all-gather outputs"
        )
        rows = metadata["rows"] if metadata.get("rows") is not None else gathered_a.shape[0]
        unsharded_a = gathered_a[:rows]
        LOG.append(
            {
                "hook": "post",
                "out": out,
                "a": unsharded_a.clone(),
                "b": rest[0][:rows].clone() if rest else None,
                "param_dtype": param_dtype,
            }
        )
        if out is not None:
            if out.data_ptr() != unsharded_a.data_ptr():  # not a view of the refilled output
                out.data.copy_(unsharded_a)
            return None
        return unsharded_a, (gathered_a, *rest)


class Pair1(PairTensor):
    """PairTensor with the legacy 1-argument pre hook (even dim 0 only)."""

    def fsdp_pre_all_gather(self, mesh):
        LOG.append({"hook": "pre1", "mesh": mesh, "local_shape": tuple(self.shape)})
        return (self.a, self.b), {"rows": None}


class Pair5(PairTensor):
    """PairTensor with the 5-argument pre hook; pads to the padded shard size when needed."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        LOG.append(
            {
                "hook": "pre5",
                "mesh": mesh,
                "outer_size": tuple(outer_size),
                "outer_stride": tuple(outer_stride),
                "module": module,
                "mp_policy": mp_policy,
                "local_shape": tuple(self.shape),
            }
        )
        padded_rows = chunk_size(outer_size[0], mesh.size())
        a, b = self.a, self.b
        if a.shape[0] != padded_rows:
            pa = a.new_zeros((padded_rows, *a.shape[1:]))
            pb = b.new_zeros((padded_rows, *b.shape[1:]))
            pa[: a.shape[0]].copy_(a)
            pb[: b.shape[0]].copy_(b)
            a, b = pa, pb
        return (a, b), {"rows": outer_size[0]}


class Single5(Pair5):
    """Pair5 that all-gathers only ``a`` (one all-gather input)."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        (a, _b), metadata = super().fsdp_pre_all_gather(
            mesh, outer_size, outer_stride, module, mp_policy
        )
        return (a,), {**metadata, "single": True}


class Flat5(Single5):
    """Single5 whose pre hook hands FSDP its input flattened to 1-D: a size other than the shard's,
    which FSDP takes as it is when dim 0 is even (the post hook folds it back to rows)."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        (a,), metadata = super().fsdp_pre_all_gather(
            mesh, outer_size, outer_stride, module, mp_policy
        )
        return (a.reshape(-1),), {**metadata, "row_shape": tuple(outer_size[1:])}

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        rows = tuple(t.view(-1, *metadata["row_shape"]) for t in all_gather_outputs)
        return super().fsdp_post_all_gather(rows, metadata, param_dtype, out=out)


# -- broken extensions: the error contracts (P14) ----------------------------------------------
class _NoPostHook:
    """Mixin hiding the inherited post hook (``hasattr`` is False), so only the pre hook exists."""

    @property
    def fsdp_post_all_gather(self):
        raise AttributeError("fsdp_post_all_gather")


class PreOnly(_NoPostHook, Pair1):
    """Defines ``fsdp_pre_all_gather`` but not ``fsdp_post_all_gather``."""


class PostOnly(PairTensor):
    """Defines ``fsdp_post_all_gather`` but not ``fsdp_pre_all_gather``."""


class Pre2(PairTensor):
    """A pre hook of 2 arguments: neither the 1- nor the 5-argument form."""

    def fsdp_pre_all_gather(self, mesh, module):
        return (self.a, self.b), {"rows": None}


class Pre4(PairTensor):
    """A pre hook of 4 arguments (the 5-argument form without ``mp_policy``)."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module):
        return (self.a, self.b), {"rows": None}
