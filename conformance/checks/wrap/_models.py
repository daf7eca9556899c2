"""The model zoo of the wrap area: small models whose auto-wrap outcome is worked out by hand.

Every model is built from ``torch.manual_seed`` (set by the caller) and takes a small float batch
``(B, width)`` or a token batch ``(B, S)``; :data:`INPUTS` says which. Parameter counts that the
size-based cases depend on are written next to each model.
"""

from __future__ import annotations

import torch
from torch import nn


def nested_sequential() -> nn.Sequential:
    """``Seq(L, L, Seq(L, L))`` of ``Linear(5, 5)``: 30 elements per Linear, 60 in ``2``, 120 in all
    (upstream's ``NestedSequentialModel``)."""
    return nn.Sequential(
        nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    )


class Containers(nn.Module):
    """Parameters held in a ModuleList and a ModuleDict (containers without a forward).

    numels: ``mlist`` 60 (two Linear(5,5) of 30); ``mdict`` 170 = ``big`` Linear(10,10) 110 +
    ``a`` 30 + ``b`` 30; ``head`` Linear(10, 5) 55.
    """

    def __init__(self):
        super().__init__()
        self.mlist = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)])
        self.mdict = nn.ModuleDict(
            {"big": nn.Linear(10, 10), "a": nn.Linear(5, 5), "b": nn.Linear(5, 5)}
        )
        self.head = nn.Linear(10, 5)

    def forward(self, x):
        for layer in self.mlist:
            x = torch.tanh(layer(x))
        x = self.mdict["b"](torch.tanh(self.mdict["a"](x)))
        x = self.mdict["big"](torch.cat([x, x * x], dim=-1))
        return self.head(torch.tanh(x))


class AttentionNet(nn.Module):
    """``lin`` Linear(10, 10) (110 elements) then ``attn`` MultiheadAttention(10, 2) (440: in_proj
    330, out_proj 110)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 10)
        self.attn = nn.MultiheadAttention(10, 2, batch_first=True)

    def forward(self, x):  # x: (B, 10) -> sequences of length 2
        h = torch.tanh(self.lin(x)).reshape(x.shape[0], 2, 5).repeat(1, 1, 2)
        out, _ = self.attn(h, h, h, need_weights=False)
        return out.sum(dim=1)


class SharedParamsTransformer(nn.Module):
    """Written fresh after upstream's ``TransformerWithSharedParams``: token embedding tied to the
    output projection (``head.weight is embed.weight``), two encoder and two decoder layers, a
    batch norm. Dropout is 0 so that every run is deterministic."""

    VOCAB, DIM = 12, 8

    def __init__(self):
        super().__init__()
        d = self.DIM
        self.embed = nn.Embedding(self.VOCAB, d)
        self.encoder = nn.ModuleList(
            [
                nn.TransformerEncoderLayer(d, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
                for _ in range(2)
            ]
        )
        self.decoder = nn.ModuleList(
            [
                nn.TransformerDecoderLayer(d, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
                for _ in range(2)
            ]
        )
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, self.VOCAB)
        self.head.weight = self.embed.weight  # shared: registered under two names

    def forward(self, tokens):  # tokens: (B, S) int64
        x = self.embed(tokens)
        memory = x
        for layer in self.encoder:
            memory = layer(memory)
        y = x
        for layer in self.decoder:
            y = layer(y, memory)
        y = self.bn(y.transpose(1, 2)).transpose(1, 2)
        return self.head(y).mean(dim=1)


class NormNet(nn.Module):
    """``lin1`` Linear(4, 8), ``bn`` BatchNorm1d(8), ``lin2`` Linear(8, 4)."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.lin2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin2(torch.relu(self.bn(self.lin1(x))))


class LoraAdapter(nn.Module):
    """The trainable low-rank pair ``B(A(x))``."""

    def __init__(self, dim: int, rank: int = 2):
        super().__init__()
        self.A = nn.Linear(dim, rank, bias=False)
        self.B = nn.Linear(rank, dim, bias=False)

    def forward(self, x):
        return self.B(self.A(x))


class LoraAttention(nn.Module):
    """Frozen ``q_proj``/``v_proj`` (Linear(4, 4, bias=False), 16 elements each) plus a trainable
    ``lora`` adapter (A 8 + B 8 elements)."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.lora = LoraAdapter(dim)
        self.q_proj.weight.requires_grad_(False)
        self.v_proj.weight.requires_grad_(False)

    def forward(self, x):
        return self.v_proj(torch.tanh(self.q_proj(x))) + self.lora(x)


class LoraBlock(nn.Module):
    def __init__(self, dim: int = 4):
        super().__init__()
        self.attn = LoraAttention(dim)
        self.mlp = nn.Linear(dim, dim)  # trainable

    def forward(self, x):
        return self.mlp(torch.tanh(self.attn(x)))


class LoraModel(nn.Module):
    """``layers.0``/``layers.1``: LoraBlock; every unit the uniform policy forms is uniformly
    frozen or trainable, and the root keeps only trainable ``mlp`` parameters."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.layers = nn.ModuleList([LoraBlock(dim) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


# model name -> (factory, input kind, width): "float" inputs are (B, width) float32,
# "tokens" inputs are (B, width) int64 in [0, VOCAB)
MODELS = {
    "nested": (nested_sequential, "float", 5),
    "containers": (Containers, "float", 5),
    "attention": (AttentionNet, "float", 10),
    "transformer": (SharedParamsTransformer, "tokens", 5),
    "norm": (NormNet, "float", 4),
    "lora": (LoraModel, "float", 4),
}


def make_model(name: str) -> nn.Module:
    return MODELS[name][0]()


def make_batch(name: str, batch: int, generator: torch.Generator) -> torch.Tensor:
    """A deterministic global batch for model ``name`` (same on every rank for one generator)."""
    _, kind, width = MODELS[name]
    if kind == "tokens":
        return torch.randint(0, SharedParamsTransformer.VOCAB, (batch, width), generator=generator)
    return torch.randn(batch, width, generator=generator)


# ------------------------------------------------------------------ W8, W11, W15, W16 models
class BatchNormNet(nn.Module):
    """``lin`` Linear(2, 2) and one norm layer of each kind (W8): ``bn1`` BatchNorm1d(2), ``bn2``
    BatchNorm2d(2), ``bn3`` BatchNorm3d(2), ``sync_bn`` SyncBatchNorm(2) (built, never run)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.bn1 = nn.BatchNorm1d(2)
        self.bn2 = nn.BatchNorm2d(2)
        self.bn3 = nn.BatchNorm3d(2)
        self.sync_bn = nn.SyncBatchNorm(2)


class BatchNormContainer(nn.Module):
    """``bn_container``: a :class:`BatchNormNet` (W8's container case)."""

    def __init__(self):
        super().__init__()
        self.bn_container = BatchNormNet()


class RecordingBatchNorm(nn.BatchNorm1d):
    """A BatchNorm1d that records the dtypes of its input and weight inside forward (W11), and
    takes a second, non-floating input (a bool ``mask`` the output is multiplied by): the
    override's input cast must hand it over unchanged (``mask_seen``: its dtype, or None)."""

    def __init__(self, features: int):
        super().__init__(features)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []
        self.mask_seen: list[torch.dtype | None] = []

    def forward(self, x, mask=None):
        self.seen.append((x.dtype, self.weight.dtype))
        self.mask_seen.append(None if mask is None else mask.dtype)
        out = super().forward(x)
        return out if mask is None else out * mask


class RecordingNormNet(NormNet):
    """:class:`NormNet` whose batch norm is a :class:`RecordingBatchNorm`, called with an
    all-True bool mask next to its input."""

    def __init__(self):
        super().__init__()
        self.bn = RecordingBatchNorm(8)

    def forward(self, x):
        h = self.lin1(x)
        mask = torch.ones(h.shape, dtype=torch.bool, device=h.device)
        return self.lin2(torch.relu(self.bn(h, mask)))


class ZeroArgNet(nn.Module):
    """``forward()`` takes no argument and returns ``(weight * 2).sum(0)`` (W15)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(1.0, 7.0).reshape(3, 2))

    def forward(self):
        return (self.weight * 2).sum(0)


def _lin5() -> nn.Linear:
    return nn.Linear(5, 5, bias=False)


class StatesModel(nn.Module):
    """W16's model: ``seq1`` Seq(L, L) with buffer ``seq1_buffer``, ``lin`` L, ``seq2``
    Seq(Seq(L), L) with buffer ``seq2.1.seq2_1_buffer``; L = Linear(5, 5, bias=False). ``share``:
    "parent-child" ties ``seq2.0.0.weight`` to ``lin.weight``, "siblings" to ``seq1.0.weight``;
    "module-and-child" ties nothing and registers ``seq2.0.0.weight`` on ``seq2.0`` too, as
    ``seq2.0.tied`` (its first name in ``named_parameters()``)."""

    def __init__(self, share: str):
        super().__init__()
        self.seq1 = nn.Sequential(_lin5(), _lin5())
        self.seq1.register_buffer("seq1_buffer", torch.zeros(2))
        self.lin = _lin5()
        self.seq2 = nn.Sequential(nn.Sequential(_lin5()), _lin5())
        self.seq2[1].register_buffer("seq2_1_buffer", torch.zeros(3))
        if share == "module-and-child":
            self.seq2[0].register_parameter("tied", self.seq2[0][0].weight)
        else:
            tie = self.lin if share == "parent-child" else self.seq1[0]
            self.seq2[0][0].weight = tie.weight
