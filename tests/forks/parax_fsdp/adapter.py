"""Parax's conformance adapter (entry point ``parax-fsdp``), written from docs/adapters.md alone.

It declares what Parax implements (per-parameter dim-0 DTensor shards, mixed precision, wrap
plans, training, the ``dtensor`` state dict) and nothing of upstream's API (no ``ns``). Its
``shard`` asserts that the harness keeps its side of the contract: an option that docs/adapters.md
ties to a capability Parax does not declare must never reach it (it would be the harness's bug,
not Parax's: see ``base.OPTION_CAPABILITIES``); options Parax does not know are refused with
``NotSupported`` and its own text.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from conformance.adapters import Implementation, NotSupported, ShardView, base
from parax_fsdp import fsdp

MP_FIELDS = {"param_dtype", "reduce_dtype", "buffer_dtype"}


class ParaxAdapter(Implementation):
    name = "parax-fsdp"
    capabilities = frozenset(
        {
            base.PER_PARAM_DIM0,
            base.DTENSOR_PARAMS,
            base.MIXED_PRECISION,
            base.AUTO_WRAP,
            base.TRAINING,
            base.DTENSOR_STATE_DICT,
        }
    )

    @property
    def version(self) -> str:
        return f"parax 0.1 on torch {torch.__version__}"

    def shard(self, module: nn.Module, ctx, *, plan=None, **options) -> nn.Module:
        undeclared = base.undeclared_for_shard(self.capabilities, plan, options)
        assert not undeclared, f"the harness passed {undeclared} to shard() undeclared"
        unknown = set(options) - {"mixed_precision", "mesh"}
        if unknown:
            raise NotSupported(f"parax has no shard option(s) {sorted(unknown)}")
        mp = dict(options.get("mixed_precision") or {})
        if set(mp) - MP_FIELDS:
            raise NotSupported(
                f"parax has no mixed-precision field(s) {sorted(set(mp) - MP_FIELDS)}"
            )
        mp.pop("buffer_dtype", None)  # FSDP2-style: buffers are left alone
        mesh = options.get("mesh") or ctx.mesh
        entries = base.plan_entries(plan)
        taken: set[int] = set()
        owned = []
        for fqn, kwargs in entries:  # children first: each unit takes what no inner unit took
            if set(kwargs) - {"ignored_params"}:
                raise NotSupported(f"parax has no per-unit argument(s) {sorted(kwargs)}")
            taken |= {id(p) for p in kwargs.get("ignored_params", ())}
            unit = module.get_submodule(fqn)
            owned.append((unit, fsdp.owned_parameters(unit, taken)))
        for unit, params in owned:
            fsdp.shard_unit(unit, mesh, params, mp.get("param_dtype"), mp.get("reduce_dtype"))
        return module

    def local_shards(self, module: nn.Module) -> dict[str, ShardView]:
        views = {}
        for name, param in module.named_parameters():
            name = self.clean_fqn(name)
            if not isinstance(param, DTensor):
                raise AssertionError(f"{name} is {type(param).__name__}, not a DTensor")
            _, offsets = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            views[name] = ShardView(name, tuple(param.shape), param.to_local(), offsets[0])
        return views

    def clean_fqn(self, name: str) -> str:
        return fsdp.clean_name(super().clean_fqn(name))

    # kinds: "dtensor" / "dcp-sharded" (the sharded DTensor parameters themselves, under clean
    # keys) and "dcp-full" (plain full tensors; with cpu_offload only rank 0 holds the dict)
    def state_dict(self, module: nn.Module, kind: str = "full", **config) -> dict:
        offload = self._config(kind, config)
        sd = {self.clean_fqn(k): v for k, v in module.state_dict().items()}
        if kind != "dcp-full":
            return sd
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v.detach() for k, v in sd.items()}
        if offload:
            return {k: v.cpu() for k, v in full.items()} if dist.get_rank() == 0 else {}
        return full

    def load_state_dict(self, module, state_dict, kind="full", *, strict=True, **config):
        self._config(kind, config)
        current = module.state_dict()
        names = {self.clean_fqn(k): k for k in current}
        mapped = {}
        for key, value in state_dict.items():
            name = names.get(key, key)
            target = current.get(name)
            if kind == "dcp-full" and isinstance(target, DTensor) and value.shape == target.shape:
                value = distribute_tensor(value.to(target.device), target.device_mesh, [Shard(0)])
            mapped[name] = value
        result = module.load_state_dict(mapped, strict=strict)
        return type(result)(
            [self.clean_fqn(k) for k in result.missing_keys],
            [self.clean_fqn(k) for k in result.unexpected_keys],
        )

    @staticmethod
    def _config(kind: str, config: dict) -> bool:
        if kind not in ("dtensor", "dcp-sharded", "dcp-full"):
            raise NotSupported(f"parax has no {kind} state dict")
        allowed = set() if kind == "dtensor" else {"cpu_offload"}
        if set(config) - allowed:
            raise NotSupported(f"parax's {kind} state dict has no option(s) {sorted(config)}")
        return bool(config.get("cpu_offload"))
