"""The adapter interface every implementation under test provides.

A vendor writes one subclass of :class:`Implementation` (or reuses :class:`FullyShardAdapter` /
:class:`FlatParamAdapter` when its fork keeps upstream's API) and points the harness at it with
``--impl package.module:attr``. See docs/adapters.md.

[Note: capabilities]
An implementation *declares* what it supports as a set of capability names (the constants below).
A check that needs a capability the implementation does not declare is reported NotSupported with
the capability's name: never failed, never passed. Declaring a capability you do not implement
turns those checks red, which is the point.

Optional API surfaces are capabilities too: ``fsdp1-runtime`` (:data:`FSDP1_RUNTIME`) says the
FSDP1 root offers ``clip_grad_norm_`` and ``summon_full_params`` with upstream's options; a fork
without them leaves it out and those checks report NotSupported.

[Note: inherited deviations]
What differs between implementations is declared data, never a branch on a name. Upstream torch
has known deviations (bugs and limitations, each pinned by a hand-written check): they are listed
in ``conformance/expectations/<name>[.<device>].txt`` and, for the fuzz area, as
:class:`conformance.fuzz.Drop` s and :data:`conformance.fuzz.strategies.STEERS` naming the
*deviation set* they belong to (``"torch-fsdp2"``). An adapter's ``inherits`` names the
implementation whose deviation sets it takes, resolved transitively
(:func:`conformance.adapters.registry.lineage`): a fork of upstream FSDP2 under its own name sets
``inherits = "torch-fsdp2"`` and gets torch-fsdp2's expectation entries (per device too) and its
fuzz drops and steers, on top of its own. The built-in upstream adapters are the roots
(``torch-fsdp2``, ``torch-fsdp1``); the references inherit nothing.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

# ---------------------------------------------------------------------------------- capabilities
PER_PARAM_DIM0 = "per-param-dim0"  # each parameter sharded on dim 0 (FSDP2 layout)
FLAT_PARAM = "flat-param"  # parameters of a wrapped module flattened into one padded 1-D buffer
PADDED_STORAGE = "padded-storage"  # the padded local buffer can be inspected (padding must be zero)
DTENSOR_PARAMS = "dtensor-params"  # sharded parameters are registered as DTensors
SHARD_PLACEMENT_FN = "shard-placement-fn"  # Shard(d) for d != 0 via shard_placement_fn
RESHARD_AFTER_FORWARD = "reshard-after-forward"  # bool / int reshard_after_forward
MIXED_PRECISION = "mixed-precision"
CPU_OFFLOAD = "cpu-offload"
HSDP = "hsdp"  # 2-D (replicate x shard) mesh
EXTENSIONS = "all-gather-extensions"  # fsdp_pre_all_gather / fsdp_post_all_gather
TENSOR_PARALLEL = "tensor-parallel"  # DTensor (TP) parameters composed with FSDP
FULL_STATE_DICT = "full-state-dict"
SHARDED_STATE_DICT = "sharded-state-dict"
LOCAL_STATE_DICT = "local-state-dict"
DTENSOR_STATE_DICT = "dtensor-state-dict"  # state_dict() values are the sharded DTensors
AUTO_WRAP = "auto-wrap"  # applies a wrap plan (reference.wrap policies)
TRAINING = "training"  # forward/backward/optimizer steps
# API-level capabilities: the adapter's ``ns`` attribute is a module exposing upstream's public API
# with upstream's semantics, so checks of API behaviour (states, methods, errors) can call it directly.
FSDP2_API = (
    "fsdp2-api"  # ns.fully_shard, ns.FSDPModule, ns.MixedPrecisionPolicy, ns.CPUOffloadPolicy
)
FSDP1_API = "fsdp1-api"  # ns.FullyShardedDataParallel, ns.StateDictType, the configs, ns.wrap
# FSDP1's runtime APIs beyond the state dicts, called on the sharded model itself (SPEC part R):
# the root's ``clip_grad_norm_(max_norm, norm_type)`` and ``FullyShardedDataParallel.
# summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)``.
FSDP1_RUNTIME = "fsdp1-runtime"
# Upstream knobs beyond the adapter interface (checks call them directly; see PROMISES):
HSDP_ALL_REDUCE = "hsdp-all-reduce-knob"  # FSDPModule.set_requires_all_reduce on an HSDP mesh
DCP_HELPERS = "dcp-helpers"  # torch.distributed.checkpoint.state_dict get/set_* on the model
FSDP1_OPTIM_STATE_DICT = "fsdp1-optim-state-dict"  # FSDP.optim_state_dict / _to_load
FSDP1_HYBRID_SHARD = "fsdp1-hybrid-shard"  # HYBRID_SHARD / _HYBRID_SHARD_ZERO2
FSDP1_GRAD_SCALER = "fsdp1-grad-scaler"  # ns.sharded_grad_scaler.ShardedGradScaler
FSDP2_FORWARD_METHOD = "fsdp2-forward-method"  # register_fsdp_forward_method
FSDP2_CUSTOM_COMMS = "fsdp2-custom-comms"  # set_custom_all_gather / set_custom_reduce_scatter
FSDP2_DP_MESH_DIMS = "fsdp2-dp-mesh-dims"  # fully_shard(dp_mesh_dims=DataParallelMeshDims(...))
FSDP1_EXEC_ORDER_CHECK = "fsdp1-exec-order-check"  # DebugLevel.DETAIL validates the forward order
FSDP1_PREFETCH = "fsdp1-prefetch"  # forward_prefetch / BACKWARD_PRE gather the next unit ahead
FSDP1_MODULE_TO = "fsdp1-module-to"  # model.to(dtype) on an FSDP1 model (use_orig_params=True)
FSDP1_FULL_PREC_IN_EVAL = "fsdp1-full-prec-in-eval"  # env FSDP_USE_FULL_PREC_IN_EVAL=1 (FSDP1)
FSDP2_PER_PARAM_MESH = "fsdp2-per-param-mesh"  # shard_placement_fn -> ShardPlacementResult
FSDP2_FUNCTORCH = "fsdp2-functorch"  # torch.func transforms (jvp) through a fully_shard model
FSDP1_CPU_OFFLOAD = "fsdp1-cpu-offload"  # FSDP1 CPUOffload(offload_params=True) at construction
FSDP1_FAKE_COLLECTIVES = "fsdp1-fake-collectives"  # env FSDP_USE_FAKE_ALL_GATHER / _REDUCE
FSDP2_PUBLIC_MODULE = "fsdp2-public-module"  # public FSDP2 names report ns as __module__
FSDP2_SYMM_MEM = "fsdp2-symm-mem"  # FSDPModule.set_symm_mem_for_comm
FSDP2_NEW_INIT_SWITCH = (
    "fsdp2-new-init-switch"  # ns._fully_shard._fully_shard.disable_fsdp_module_new_init
)
FSDP1_TENSOR_PARALLEL = "fsdp1-tensor-parallel"  # FSDP1 over DTensor (tensor-parallel) parameters
FSDP1_NO_SYNC_ORIG_GRADS = "fsdp1-no-sync-orig-grads"  # original .grad inside no_sync()
FSDP1_UNSAFE_SETATTR = "fsdp1-unsafe-setattr"  # env FSDP_USE_UNSAFE_SETATTR=1 (FSDP1)
FSDP1_LOCAL_ORIG_PARAMS = "fsdp1-local-orig-params"  # LOCAL_STATE_DICT with use_orig_params=True
FSDP1_DYNAMO = "fsdp1-dynamo"  # managed modules marked for torch.compile (use_orig_params)

ALL_CAPABILITIES = frozenset(
    v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str)
)

# What declaring each capability promises (the "Capabilities" table of docs/adapters.md is generated from
# this and from the checks that need each one: ``python -m conformance.capabilities --write``).
PROMISES = {
    PER_PARAM_DIM0: "every parameter is sharded on its own along dim 0: rank r holds rows "
    "[r*ceil(d0/ws), (r+1)*ceil(d0/ws)) (FSDP2's layout); `local_shards` returns them",
    FLAT_PARAM: "each unit's parameters are flattened in registration order into one 1-D flat "
    "parameter padded to a multiple of ws; rank r holds elements [r*ceil(N/ws), ...) (FSDP1's "
    "layout); `flat_shards`, `flat_grads` and `local_shards` expose it",
    PADDED_STORAGE: "`ShardView.padded` is the rank's padded local storage; its padding is zero",
    DTENSOR_PARAMS: "sharded parameters are registered as DTensors on the mesh (`full_tensor()` "
    "gathers them)",
    SHARD_PLACEMENT_FN: "`shard(shard_placement_fn=fn)`: `fn(param)` returns `Shard(d)` (any "
    "d) or None (dim 0), as upstream's `fully_shard`",
    RESHARD_AFTER_FORWARD: "`shard(reshard_after_forward=...)` (True, False or an int) and the same per "
    "unit in a plan, with upstream's post-forward states",
    MIXED_PRECISION: "`shard(mixed_precision=dict(param_dtype=, reduce_dtype=, buffer_dtype=))`: "
    "compute in param_dtype, reduce gradients in reduce_dtype, keep fp32 shards",
    CPU_OFFLOAD: "`shard(cpu_offload=True)`: the sharded parameters (and their gradients) live "
    "on the CPU; training is unchanged",
    HSDP: "`shard(mesh=<2-D DeviceMesh (replicate, shard)>)`: shard within a row, replicate "
    "across rows",
    EXTENSIONS: "tensor subclasses' `fsdp_pre_all_gather` / `fsdp_post_all_gather` are called "
    "around the all-gather, as upstream FSDP2 does",
    TENSOR_PARALLEL: "parameters that are already DTensors (tensor parallel on a 2-D mesh) are "
    "sharded on the data-parallel dim and train as upstream's FSDP2 + TP",
    FULL_STATE_DICT: "`state_dict(m, 'full', rank0_only=, offload_to_cpu=)` / "
    "`load_state_dict(..., 'full')`: full plain tensors under clean keys (FSDP1 FULL_STATE_DICT)",
    SHARDED_STATE_DICT: "`state_dict(m, 'sharded', offload_to_cpu=)` and its load: per "
    "parameter a ShardedTensor or DTensor of this rank's dim-0 chunk (FSDP1 SHARDED_STATE_DICT)",
    LOCAL_STATE_DICT: "`state_dict(m, 'local')` and its load: per unit `<prefix>._flat_param`, a "
    "1-D ShardedTensor of the unpadded flat shard (FSDP1 LOCAL_STATE_DICT)",
    DTENSOR_STATE_DICT: "kinds 'dtensor' (`module.state_dict()`: the sharded DTensors), "
    "'dcp-full' and 'dcp-sharded' (torch.distributed.checkpoint.state_dict helpers, "
    "`cpu_offload=`) and their loads",
    AUTO_WRAP: "`shard(plan=[(module_fqn, kwargs), ...])` shards each planned module as its own "
    "unit, children first, with that unit's kwargs",
    TRAINING: "forward, backward and optimizer steps of the sharded model equal the unsharded "
    "model's on the global batch (gradients averaged over the ranks)",
    FSDP2_API: "the adapter's `ns` is a module with upstream's `fully_shard`, `FSDPModule` "
    "(unshard, reshard, set_* methods), `MixedPrecisionPolicy`, `CPUOffloadPolicy`, with "
    "upstream's semantics: checks call them directly",
    FSDP1_API: "the adapter's `ns` is a module with upstream's `FullyShardedDataParallel` "
    "(`state_dict_type`), `StateDictType`, the state-dict configs, `MixedPrecision`, "
    "`ShardingStrategy` and `ns.wrap` (policies; `build_wrap_plan` if it has one): checks call "
    "them directly",
    FSDP1_RUNTIME: "the FSDP1 root's `clip_grad_norm_(max_norm, norm_type)` and "
    "`FullyShardedDataParallel.summon_full_params(...)` with upstream's options",
    HSDP_ALL_REDUCE: "`FSDPModule.set_requires_all_reduce(bool, recurse=)` on an HSDP module: "
    "off, a backward reduce-scatters but keeps the partial result inside FSDP (no sharded "
    "`.grad`); the next backward with it on all-reduces that sum too. And "
    "`set_all_reduce_hook(hook)`: hook(reduced) runs on the unit's reduced gradient (after the "
    "HSDP all-reduce, else after the reduce-scatter) before it lands in `.grad`",
    DCP_HELPERS: "the sharded model (and an optimizer over its parameters) works with "
    "`torch.distributed.checkpoint.state_dict`'s `get_/set_model_state_dict`, "
    "`get_/set_optimizer_state_dict` and `get_/set_state_dict` under every `StateDictOptions` "
    "field (`full_state_dict`, `cpu_offload`, `broadcast_from_rank0`, `strict`): checks call them "
    "directly",
    FSDP1_OPTIM_STATE_DICT: "`FullyShardedDataParallel.optim_state_dict(model, optim)` and "
    "`optim_state_dict_to_load(model, optim, osd)` under `state_dict_type` with "
    "`FullOptimStateDictConfig(rank0_only=)` / `ShardedOptimStateDictConfig`: FQN-keyed state "
    "equal to the unsharded optimizer's",
    FSDP1_HYBRID_SHARD: "plan kwargs `sharding_strategy=HYBRID_SHARD` / `_HYBRID_SHARD_ZERO2` "
    "with `device_mesh=<2-D (replicate, shard) mesh>`: shard within a row, replicate across rows",
    FSDP1_GRAD_SCALER: "`<ns>.sharded_grad_scaler.ShardedGradScaler(device=, init_scale=, "
    "growth_factor=, backoff_factor=, growth_interval=)`: a GradScaler whose inf/nan check is "
    "all-reduced over the ranks, so a non-finite gradient shard on any rank skips the step on "
    "every rank",
    FSDP2_FORWARD_METHOD: "`ns.register_fsdp_forward_method(module, name)`: calling "
    "`module.<name>` unshards the unit around it as forward does (gradients reduced likewise)",
    FSDP2_NEW_INIT_SWITCH: "`ns._fully_shard._fully_shard.disable_fsdp_module_new_init()` is a "
    "context manager in which calling an FSDP class (`type(fsdp_module)(...)`) returns the "
    "original class's object without running its `__init__`; leaving it restores the setting",
    FSDP1_TENSOR_PARALLEL: "FSDP1 (`use_orig_params=True`, `device_mesh=` the data-parallel "
    "sub-mesh) over a module whose parameters are already DTensors on a tensor-parallel mesh: "
    "trains, saves and loads its state dicts and optimizer state dicts as upstream's FSDP1 + TP",
    FSDP1_UNSAFE_SETATTR: "with `FSDP_USE_UNSAFE_SETATTR=1` in the environment at construction, "
    "an FSDP1 unit points its original names at their views without calling the modules' "
    "`__setattr__` (without it, through `delattr`/`setattr`); nothing else changes",
    FSDP2_SYMM_MEM: "`FSDPModule.set_symm_mem_for_comm()` (symmetric-memory staging buffers) "
    "refuses a unit whose all-gather already uses another allocation strategy (AssertionError "
    "naming that comm's class)",
    FSDP2_CUSTOM_COMMS: "`FSDPModule.set_custom_all_gather(comm)` / `set_custom_reduce_scatter("
    "comm)`: the unit's all-gathers (reduce-scatters) call `comm(output, input, group, [op,] "
    "async_op=)` on buffers from `comm.allocate(size, dtype=, device=)`",
    FSDP2_DP_MESH_DIMS: "`ns.fully_shard(module, mesh=<full SPMD mesh>, dp_mesh_dims="
    "ns.DataParallelMeshDims(shard=, replicate=))` over parameters that are DTensors replicated "
    "on that mesh: sharded on the named shard dim, replicated (HSDP) on the named replicate dim",
    FSDP1_EXEC_ORDER_CHECK: "an FSDP1 root built while `torch.distributed.get_debug_level()` is "
    "DETAIL checks its units' training-forward order: a first forward whose order differs across "
    "ranks raises RuntimeError naming each rank's unit, a later one that departs from the first "
    "warns once per departing unit, in its first departing iteration only",
    FSDP1_PREFETCH: "plan kwargs `forward_prefetch=True`: from the second forward on, a unit's "
    "pre-forward also issues the all-gather of the unit that followed it in the first forward, "
    "right after its own; `backward_prefetch=BACKWARD_PRE`: a unit's pre-backward issues the "
    "all-gather of the unit that preceded it in that forward, right after its own",
    FSDP1_MODULE_TO: "`model.to(dtype)` on the wrapped FSDP1 model (`use_orig_params=True`) "
    "converts each unit's flat parameter and so every original parameter, which keep their names "
    "and train in that dtype",
    FSDP1_FULL_PREC_IN_EVAL: "with `FSDP_USE_FULL_PREC_IN_EVAL=1` in the environment at "
    "construction, an FSDP1 unit with `MixedPrecision` computes in full precision (parameters, "
    "buffers, output) while in `eval()` mode and in the low precision again after `train()`",
    FSDP2_PER_PARAM_MESH: "`<ns>._fully_shard._fsdp_common` has `ShardPlacementResult(placement=, "
    "mesh_info=)` and `FSDPMeshInfo(mesh, shard_mesh_dim=0)`; a `shard_placement_fn` returning one "
    "shards that parameter over that mesh, in a parameter group of its own per process group",
    FSDP2_FUNCTORCH: "a `fully_shard` model runs under `torch.func` transforms (`torch.func.jvp`): "
    "its hooks gather and free the parameters as in a plain forward, and tangents flow through",
    FSDP1_FAKE_COLLECTIVES: "with `FSDP_USE_FAKE_ALL_GATHER=1` or `FSDP_USE_FAKE_REDUCE=1` (either "
    "alone) in the environment at construction, a sharded FSDP1 unit skips its all-gathers or "
    "its gradient reduce-scatters (a profiling aid: the values are then undefined) yet runs "
    "forward and backward to completion with the usual shapes",
    FSDP2_PUBLIC_MODULE: "every public FSDP2 name `ns` exports (`fully_shard`, `FSDPModule`, the "
    "policies, ...) has `__module__` equal to `ns.__name__`, so introspection and pickling by "
    "reference name the public namespace, not the private module defining it",
    FSDP1_CPU_OFFLOAD: "`ns.FullyShardedDataParallel(module, cpu_offload=ns.CPUOffload("
    "offload_params=True))` builds units whose flat parameters (each rank's shard of the "
    "flattened original parameters) live on the CPU, whatever the compute device",
    FSDP1_NO_SYNC_ORIG_GRADS: "with `use_orig_params=True`, a backward inside `no_sync()` gives "
    "each original parameter a `.grad` of its full shape: the unreduced gradient of this rank's "
    "samples (accumulated over the `no_sync()` backwards), as upstream's FSDP1",
    FSDP1_LOCAL_ORIG_PARAMS: "`state_dict(m, 'local')` (LOCAL_STATE_DICT) also on units built "
    "with `use_orig_params=True`, the flat parameter following its original parameters' "
    "`requires_grad`",
    FSDP1_DYNAMO: "an FSDP1 unit marks the modules it manages (not its ignored modules) for "
    "`torch.compile`'s dynamo with its `use_orig_params`: compiling a managed module with "
    "`fullgraph=True` raises `torch._dynamo.exc.Unsupported` ('FSDP with use_orig_params=False') "
    "when that is False and traces it otherwise, as upstream's FSDP1",
}


UNDECLARED = "does not declare "


class NotSupported(Exception):
    """Raised (by a check or an adapter) when a needed capability is not declared/implemented.

    An adapter raises it with its own text (``NotSupported("option(s) ['x']")``), which the report
    shows as it is; the harness raises :meth:`undeclared` for capabilities the implementation does
    not declare. :func:`not_supported_reason` is the one wording of both."""

    @classmethod
    def undeclared(cls, *capabilities: str, any_of: bool = False) -> NotSupported:
        """The implementation declares none of ``capabilities`` (``any_of``: one would do)."""
        names = sorted(capabilities)
        return cls(UNDECLARED + (" or ".join(names) if any_of else ", ".join(names)))


def not_supported_reason(impl_name: str, detail: str) -> str:
    """How a not-supported case reads in every report: ``NotSupported: my-fork does not declare
    auto-wrap`` (a capability the harness found undeclared) or ``NotSupported: my-fork: <the
    adapter's own NotSupported text>`` (never reworded)."""
    if detail.startswith(UNDECLARED):
        return f"NotSupported: {impl_name} {detail}"
    return f"NotSupported: {impl_name}: {detail}"


class NamespaceUndeclared(NotSupported, AttributeError):
    """Reading ``ns`` from an adapter that has none: not supported for a check, and an
    AttributeError for ``getattr(impl, "ns", None)``."""


class _NoNamespace:
    """The class-level ``ns`` of :class:`Implementation`: a non-data descriptor, so an adapter's
    own ``self.ns = module`` wins."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        raise NamespaceUndeclared.undeclared(FSDP2_API, FSDP1_API, any_of=True)


@dataclass
class ShardView:
    """One original parameter as seen on one rank after sharding.

    ``local`` is the rank's *unpadded* piece in the layout's natural form:
    * per-parameter dim-0 layout: a tensor of shape ``(rows, *global_shape[1:])`` holding rows
      ``offset .. offset+rows`` of the original;
    * flat-parameter layout: a 1-D tensor holding elements ``offset .. offset+numel`` of the
      original parameter flattened.
    ``padded`` is the rank's padded local storage (1-D) when the implementation exposes it.
    """

    fqn: str
    global_shape: tuple[int, ...]
    local: torch.Tensor
    offset: int
    padded: torch.Tensor | None = None


class Implementation:
    """Base class of implementation adapters. Subclasses set the class attributes and override the
    operations they support; an operation they do not support raises :class:`NotSupported`."""

    name: ClassVar[str] = "unnamed"
    capabilities: ClassVar[frozenset[str]] = frozenset()
    description: ClassVar[str] = ""
    # The implementation whose known deviations this one takes (see [Note: inherited deviations]).
    inherits: ClassVar[str | None] = None
    # Device types this implementation runs on (``{"cuda"}``); None: any. Checked at start.
    devices: ClassVar[frozenset[str] | None] = None

    # ``ns``: upstream's API, for adapters that declare fsdp2-api / fsdp1-api (they set it);
    # read from any other adapter, it makes the case not supported (never an AttributeError).
    ns = _NoNamespace()

    def __init_subclass__(cls, **kwargs):
        """Every subclass's ``shard`` runs behind :func:`guard_shard`: an option or plan whose
        capability the implementation does not declare never reaches it."""
        super().__init_subclass__(**kwargs)
        if "shard" in cls.__dict__:
            cls.shard = guard_shard(cls.__dict__["shard"])

    @property
    def version(self) -> str:
        return "unknown"

    # -- applying sharding -------------------------------------------------------------------
    def shard(self, module: nn.Module, ctx, *, plan=None, **options) -> nn.Module:
        """Shard ``module`` over all ranks of ``ctx`` and return the module to run.

        ``plan`` is a :class:`reference.wrap.WrapPlan`-like value: an ordered list of
        ``(module_fqn, kwargs)``, children first; ``None`` means shard the root as one unit.
        ``options`` are harness-neutral: ``reshard_after_forward``, ``mixed_precision``
        (``dict(param_dtype=, reduce_dtype=, buffer_dtype=)``), ``cpu_offload`` (bool),
        ``shard_placement_fn``, ``mesh``, ``use_orig_params``.
        Unknown options must raise :class:`NotSupported`.
        """
        raise NotSupported("shard")

    # -- observing layout --------------------------------------------------------------------
    def local_shards(self, module: nn.Module) -> dict[str, ShardView]:
        """This rank's view of every original parameter, keyed by clean FQN (no wrapper prefixes)."""
        raise NotSupported("local_shards")

    def flat_shards(self, module: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
        """Flat-parameter layouts only: for each flat parameter, the FQNs flattened into it (in
        order) and this rank's padded 1-D shard."""
        raise NotSupported("flat_shards")

    def flat_grads(self, module: nn.Module) -> list[tuple[list[str], torch.Tensor | None]]:
        """Flat-parameter layouts only: as ``flat_shards``, with each flat parameter's gradient
        after backward (this rank's padded 1-D shard of the reduced gradient) or None."""
        raise NotSupported("flat_grads")

    # -- state dict ----------------------------------------------------------------------------
    def state_dict(self, module: nn.Module, kind: str = "full", **config) -> dict:
        """This rank's state dict of ``module`` of the given ``kind``; keys are clean FQNs.

        FSDP1-style kinds (capabilities ``full-state-dict`` / ``sharded-state-dict`` /
        ``local-state-dict``), config ``rank0_only`` (full only), ``offload_to_cpu``:
        * ``"full"``: full plain tensors (cloned); with ``rank0_only`` other ranks get ``{}``;
        * ``"sharded"``: per original parameter a ``ShardedTensor`` (or ``DTensor``) holding this
          rank's ``torch.chunk(p, ws, 0)[rank]``;
        * ``"local"``: per flat parameter ``<prefix>._flat_param``, a 1-D ``ShardedTensor`` of
          the unpadded flat shard.
        FSDP2-style kinds (capability ``dtensor-state-dict``), config ``cpu_offload`` (dcp only):
        * ``"dtensor"``: ``module.state_dict()``, whose values are the sharded DTensor parameters;
        * ``"dcp-full"`` / ``"dcp-sharded"``: ``torch.distributed.checkpoint.state_dict.
          get_model_state_dict`` with ``StateDictOptions(full_state_dict=..., cpu_offload=...)``
          (full + cpu_offload: only rank 0 holds the dict).
        Persistent buffers appear under clean names in every kind. Raise NotSupported for a kind
        or config you do not support. ``load_state_dict`` takes the same kinds and config plus
        ``strict`` and returns the missing/unexpected keys."""
        raise NotSupported(f"{kind} state dict")

    def load_state_dict(self, module: nn.Module, state_dict: dict, kind: str = "full", **config):
        raise NotSupported(f"load {kind} state dict")

    # -- names -------------------------------------------------------------------------------
    def clean_fqn(self, name: str) -> str:
        """The clean FQN of a name this implementation's wrappers produce: a module's name, a
        parameter's or buffer's name from ``named_modules`` / ``named_parameters`` /
        ``named_buffers`` of the sharded model, or a state-dict key. Clean means the name the
        same module, parameter or buffer has in the unwrapped model (``inner.weight``).

        Checks never strip prefixes themselves: they call this hook, so a fork whose wrapper
        inserts another attribute (``_my_wrapped.``) overrides it. The default drops torch's
        ``_fsdp_wrapped_module`` and ``_checkpoint_wrapped_module`` path components."""
        return strip_torch_wrappers(name)

    def patched(self):
        """A context manager the runner enters around every check of this implementation on
        every rank (default: nothing). The self-test's seeded faults patch their target here."""
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.version}>"


class RenamedImplementation(Implementation):
    """Another implementation's adapter under a new name, for a subclass to change around each
    check through :meth:`patched` (the self-test's seeded faults, the mutation campaign's mutants).

    It declares what the inner implementation declares and inherits its known deviations
    (``inherits`` = the inner name, resolved on from there), delegates every operation of
    :class:`Implementation` to it (one added to the base class later is delegated too), and looks
    anything else a check reaches for (``ns``, ``FSDP``, ``fsdp_params`` ...) up on it."""

    def __init__(self, inner_spec: str, name: str, description: str = ""):
        from conformance.adapters.registry import load_implementation

        self.inner = load_implementation(inner_spec)
        self.name = name
        self.capabilities = self.inner.capabilities
        self.inherits = self.inner.name
        self.description = description

    @property
    def version(self) -> str:
        return self.inner.version

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name, _value in list(vars(Implementation).items()):
    if callable(_value) and not _name.startswith("_") and _name != "patched":
        setattr(RenamedImplementation, _name, _delegate(_name))


class NamespaceImplementation(Implementation):
    """An implementation that keeps upstream's public API in one module (``namespace``), such as
    ``torch.distributed.fsdp`` or ``reference``: checks of API behaviour reach it as ``self.ns``."""

    known_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        namespace: str = "torch.distributed.fsdp",
        name: str | None = None,
        version: str | None = None,
        inherits: str | None = None,
    ):
        import importlib

        self.namespace = namespace
        self.ns = importlib.import_module(namespace)
        if name is not None:
            self.name = name
        if inherits is not None:
            self.inherits = inherits
        self._version = version

    @property
    def version(self) -> str:
        return self._version or f"torch {torch.__version__}"

    def check_options(self, options: dict) -> None:
        """Raise :class:`NotSupported` for a ``shard`` option this adapter does not know."""
        unknown = set(options) - self.known_options
        if unknown:
            raise NotSupported(f"option(s) {sorted(unknown)}")


def plan_entries(plan) -> list[tuple[str, dict]]:
    """``(module_fqn, kwargs)`` pairs of a wrap plan, children first; ``None`` = the root alone."""
    if plan is None:
        return [("", {})]
    return [
        (e.module_fqn, dict(e.kwargs)) if hasattr(e, "module_fqn") else (e[0], dict(e[1]))
        for e in getattr(plan, "entries", plan)
    ]  # WrapPlanEntry objects or (fqn, kwargs)


# ------------------------------------------------------------------- the shard() contract
# The capability each ``shard`` option (and each per-unit kwarg of a plan entry) needs: a check
# passes it only when the implementation declares that capability (docs/adapters.md, the table
# under "shard"). ``mesh`` needs ``hsdp`` only when it is 2-D; a plan needs ``auto-wrap`` as soon as
# it holds a unit other than the root alone. A value of None counts as not passed.
OPTION_CAPABILITIES = {
    "reshard_after_forward": RESHARD_AFTER_FORWARD,
    "mixed_precision": MIXED_PRECISION,
    "cpu_offload": CPU_OFFLOAD,
    "shard_placement_fn": SHARD_PLACEMENT_FN,
    "use_orig_params": FLAT_PARAM,
    "ignored_modules": FLAT_PARAM,
}
# A plan entry's kwargs are upstream's own arguments (checked under auto-wrap and the API
# capabilities); only the two the capability table promises per unit are checked on their own.
PLAN_KWARG_CAPABILITIES = {
    "reshard_after_forward": RESHARD_AFTER_FORWARD,
    "mixed_precision": MIXED_PRECISION,
}


def shard_requirements(plan, options: dict) -> dict[str, str]:
    """What a ``shard(plan=plan, **options)`` call needs: ``{option or plan part: capability}``."""
    needs = {k: c for k, c in OPTION_CAPABILITIES.items() if options.get(k) is not None}
    mesh = options.get("mesh")
    if mesh is not None and getattr(mesh, "ndim", 1) > 1:
        needs["mesh (2-D)"] = HSDP
    if plan is not None:
        entries = plan_entries(plan)
        if [fqn for fqn, _ in entries] != [""]:
            needs["plan"] = AUTO_WRAP
        for fqn, kwargs in entries:
            for k, v in kwargs.items():
                if v is not None and k in PLAN_KWARG_CAPABILITIES:
                    needs[f"plan[{fqn!r}].{k}"] = PLAN_KWARG_CAPABILITIES[k]
    return needs


def undeclared_for_shard(capabilities, plan, options: dict) -> dict[str, str]:
    """The part of :func:`shard_requirements` that ``capabilities`` do not declare."""
    return {k: c for k, c in shard_requirements(plan, options).items() if c not in capabilities}


def guard_shard(fn):
    """``fn`` (an adapter's ``shard``) behind the capability check: raise
    :meth:`NotSupported.undeclared` before calling it when the plan or an option needs a
    capability the implementation does not declare (see :data:`OPTION_CAPABILITIES`)."""
    if getattr(fn, "guarded", False):
        return fn

    @functools.wraps(fn)
    def shard(self, module, ctx, *, plan=None, **options):
        missing = undeclared_for_shard(self.capabilities, plan, options)
        if missing:
            raise NotSupported.undeclared(*set(missing.values()))
        return fn(self, module, ctx, plan=plan, **options)

    shard.guarded = True
    return shard


TORCH_WRAPPERS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def strip_torch_wrappers(name: str) -> str:
    """``name`` without the path components torch's wrappers insert (:data:`TORCH_WRAPPERS`):
    the default of :meth:`Implementation.clean_fqn`."""
    return ".".join(part for part in name.split(".") if part not in TORCH_WRAPPERS)
