"""Fuzz examples: the plain description drawn in the driver and the model every rank builds from it.

An *example* is a dict of plain values (it pickles, and ``repr`` of it is valid Python):

``seed``        int; every rank seeds with it, so all ranks (and the oracle) build equal values
``width``       features of the float input ``x`` (B, width); a second input ``t`` (B,) holds tokens
``tree``        the root node: ``{"kind": "seq", "children": [...]}``; a node is a ``seq`` or a leaf
                ``linear`` (``out``, ``bias``), ``embedding`` (``num``), ``conv`` (``channels``,
                ``k``), ``layernorm``, ``batchnorm`` (eval mode: per-sample, so data-parallel
                parity holds) or ``param`` (a custom parameter of ``shape``, any dim may be 0, and
                an optional ``buffer``: ``"persistent"`` / ``"non-persistent"``)
``ties``        ``[[src, dst], ...]`` leaf paths: ``dst.weight`` becomes ``src.weight``
``wrap``        module paths sharded as their own units (the root always is one)
``unit_options``  path -> per-unit ``shard`` kwargs (``reshard_after_forward``)
``options``     ``shard`` options for every unit: ``mixed_precision`` (dtype names), ``use_orig_params``
``placements``  parameter FQN -> the dim ``shard_placement_fn`` shards it on (absent: dim 0)
``steps``       optimizer steps of the training checks
``rank0_only``  FULL state dicts with ``rank0_only=True`` (FSDP1)
``assign``      FSDP2 DTensor state dicts load with ``load_state_dict(..., assign=True)``
``mesh``        ``[replicate, shard]``: every unit is sharded on that 2-D (HSDP) mesh
``divide_factors``  unit path -> ``set_gradient_divide_factor`` value (FSDP2)
``unit_knobs``  unit path -> FSDP1 runtime kwargs of that unit (every unit of the plan has one):
                ``sharding_strategy`` / ``backward_prefetch`` (member names of upstream's enums,
                or None: no prefetch), ``forward_prefetch``, ``limit_all_gathers`` (one value for
                every unit); see :func:`knob_kwargs`
``accumulate``  FSDP1 micro-batches run under ``no_sync()`` before each synced one (0: none)
``fsdp1_mesh``  ``[replicate, shard]``: every FSDP1 unit is a hybrid one (``unit_knobs``) on the
                2-D mesh of that shape, passed as its ``device_mesh``

Module paths are ``nn.Sequential``-style (``"0.1"``); the root's path is ``""``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

LEAF_KINDS = ("linear", "embedding", "conv", "layernorm", "batchnorm", "param")
B = 2  # samples per rank per step
LR = 0.05


class Seq(nn.Module):
    def __init__(self, children):
        super().__init__()
        for i, child in enumerate(children):
            self.add_module(str(i), child)

    def forward(self, x, t):
        for child in self.children():
            x = child(x, t)
        return x


class LinearLeaf(nn.Linear):
    def forward(self, x, t):
        return torch.tanh(super().forward(x))


class EmbeddingLeaf(nn.Embedding):
    def forward(self, x, t):
        return x + super().forward(t % self.num_embeddings).to(x.dtype)


class ConvLeaf(nn.Conv1d):
    """Conv1d(1 -> channels) over the features, summed over the channels: keeps the width."""

    def forward(self, x, t):
        return x + 0.5 * super().forward(x.unsqueeze(1)).sum(1)


class LayerNormLeaf(nn.LayerNorm):
    def forward(self, x, t):
        return super().forward(x)


class BatchNormLeaf(nn.BatchNorm1d):
    """Always normalizes with the running statistics (eval mode), so that a sample's output does
    not depend on the rest of the batch."""

    def forward(self, x, t):
        stats = [s.to(x.dtype) for s in (self.running_mean, self.running_var)]  # mixed precision
        return F.batch_norm(x, *stats, self.weight, self.bias, training=False, eps=self.eps)


class ParamLeaf(nn.Module):
    """A custom parameter of any shape (dims may be 0), mixed into the features through a weighted
    sum so that every element gets its own gradient; optionally a buffer added to the features."""

    def __init__(self, shape, width: int, buffer: str | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(tuple(shape)))
        if buffer is not None:
            self.register_buffer("buf", torch.empty(width), persistent=buffer == "persistent")

    def forward(self, x, t):
        w = self.weight
        coef = torch.linspace(-1.0, 1.0, w.numel(), device=w.device, dtype=w.dtype).reshape(w.shape)
        x = x * (1 + 0.5 * torch.tanh((w * coef).sum()))
        return x + self.buf.to(x.dtype) if hasattr(self, "buf") else x


def _leaf(node: dict, width: int) -> tuple[nn.Module, int]:
    kind = node["kind"]
    if kind == "linear":
        return LinearLeaf(width, node["out"], bias=node["bias"]), node["out"]
    if kind == "embedding":
        return EmbeddingLeaf(node["num"], width), width
    if kind == "conv":
        k = node["k"]
        return ConvLeaf(1, node["channels"], k, padding=k // 2, bias=node["bias"]), width
    if kind == "layernorm":  # a large eps: a 1- or 2-wide LayerNorm would amplify rounding ~300x
        return LayerNormLeaf(width, eps=0.1), width
    if kind == "batchnorm":
        return BatchNormLeaf(width), width
    if kind == "param":
        return ParamLeaf(node["shape"], width, node.get("buffer")), width
    raise ValueError(f"fuzz example: unknown node kind {kind!r} (use seq or one of {LEAF_KINDS})")


def _node(node: dict, width: int) -> tuple[nn.Module, int]:
    if node["kind"] != "seq":
        return _leaf(node, width)
    children = []
    for child in node["children"]:
        module, width = _node(child, width)
        children.append(module)
    return Seq(children), width


def build(example: dict, salt: int = 0) -> nn.Module:
    """The example's model on the CPU, with values from ``example["seed"]`` and ``salt`` (another
    salt: the same model with other values). Every rank builds the same one."""
    with torch.device("cpu"):
        model, out_width = _node(example["tree"], example["width"])
    model.out_width = out_width
    for src, dst in example.get("ties", ()):
        model.get_submodule(dst).weight = model.get_submodule(src).weight
    g = torch.Generator().manual_seed(1000 * example["seed"] + salt)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if not b.is_floating_point():
                continue
            fresh = torch.rand(b.shape, generator=g)
            b.copy_(fresh + 0.5 if name.endswith("running_var") else 0.2 * fresh - 0.1)
    return model


def module_paths(model: nn.Module) -> list[str]:
    """Every non-root module path of ``model``, shared modules once."""
    return [name for name, _ in model.named_modules() if name]


def plan(example: dict, plain: bool = False) -> list[tuple[str, dict]]:
    """The wrap plan: wrapped modules deepest first, the root last; per-unit options unless
    ``plain``."""
    units = sorted(example.get("wrap", ()), key=lambda p: (-p.count("."), p))
    extra = {} if plain else example.get("unit_options", {})
    return [(p, dict(extra.get(p, {}))) for p in units] + [("", dict(extra.get("", {})))]


# unit_knobs entries that name a member of one of upstream's enums (``ns.<enum>.<name>``)
KNOB_ENUMS = {"sharding_strategy": "ShardingStrategy", "backward_prefetch": "BackwardPrefetch"}


def knob_kwargs(example: dict, unit: str, ns) -> dict:
    """The FSDP1 kwargs of ``unit`` from ``example["unit_knobs"]``, enum members taken from the
    implementation's namespace ``ns``."""
    out = {}
    for key, value in example.get("unit_knobs", {}).get(unit, {}).items():
        if key in KNOB_ENUMS and value is not None:
            value = getattr(getattr(ns, KNOB_ENUMS[key]), value)
        out[key] = value
    return out


def shard_group_sizes(example: dict, units: list[str], world_size: int) -> dict[str, int]:
    """unit path -> the size of the group its flat parameter is sharded over (R19): 1 under
    NO_SHARD (and at world size 1), the shard dim of ``fsdp1_mesh`` under a hybrid strategy, the
    world size otherwise. A unit the example has no knobs for (a batch norm that mixed precision
    made a unit of its own, W11) is built with the root's."""
    knobs = example.get("unit_knobs", {})
    sizes = {"NO_SHARD": 1}
    if example.get("fsdp1_mesh"):
        sizes |= dict.fromkeys(("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"), example["fsdp1_mesh"][1])
    return {
        u: sizes.get(knobs.get(u, knobs.get("", {})).get("sharding_strategy"), world_size)
        for u in units
    }


def shard_options(example: dict, model: nn.Module) -> dict:
    """``shard`` options of the example; ``placements`` become a ``shard_placement_fn``."""
    from torch.distributed.tensor import Shard

    options = dict(example.get("options", {}))
    mp = options.get("mixed_precision")
    if mp:
        options["mixed_precision"] = {k: getattr(torch, v) if v else None for k, v in mp.items()}
    if example.get("placements"):
        dims = {
            id(p): example["placements"][n]
            for n, p in model.named_parameters()
            if n in example["placements"]
        }
        options["shard_placement_fn"] = lambda p: Shard(dims[id(p)]) if id(p) in dims else None
    return options


def managed(model: nn.Module, units: list[str]) -> dict[str, list[str]]:
    """unit path -> the parameter FQNs it manages: those under it and under no deeper unit (each
    parameter once, under its first name)."""
    owner = {}
    for fqn, _ in model.named_parameters():
        module_path = fqn.rpartition(".")[0]
        candidates = [
            u for u in units if u == "" or module_path == u or module_path.startswith(u + ".")
        ]
        owner[fqn] = max(candidates, key=lambda u: (u.count(".") + 1 if u else 0, len(u)))
    return {u: [f for f, o in owner.items() if o == u] for u in units}


# ------------------------------------------------------------------------------ data and losses
def batch(example: dict, world_size: int, step: int, device, out_width: int):
    """The global batch of step ``step`` (identical on every rank): inputs, tokens, targets."""
    g = torch.Generator().manual_seed(7919 * example["seed"] + step)
    n = world_size * B
    x = torch.randn(n, example["width"], generator=g)
    t = torch.randint(0, 1000, (n,), generator=g)
    y = torch.randn(n, out_width, generator=g)
    return x.to(device), t.to(device), y.to(device)


def per_sample_loss(out, y):
    return F.mse_loss(out.float(), y, reduction="none").mean(dim=1)


def numel(shape) -> int:
    return math.prod(shape)
