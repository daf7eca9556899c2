"""Multi-rank tests of the reference FSDP1 against torch's FSDP1 (the oracle), on gloo/CPU.

Each ``run_on_ranks`` call runs many sub-cases; a failing assertion names the sub-case and rank.
Rules checked (ids from the spec): S1 keys, S2 FULL clones, S3 rank0_only, S4 offload (the
reference must work on CPU, upstream does not: pytorch#188989), S5 SHARDED chunks and offsets,
S6 DTensor with a device mesh, S7 LOCAL flat shard without padding, S8 NO_SHARD / world size 1,
S9/S10 state_dict_type, S11 clean incompatible keys, S12 buffers under mixed precision, S14
ignored modules, S17 use_orig_params, training parity, and bad input leaving parameters unchanged.
"""

from __future__ import annotations

import math
import traceback
import warnings

import pytest
import torch
from torch import nn

from tests._spawn import run_on_ranks

CPU = torch.device("cpu")


# -- models (built identically for the reference and for torch) ----------------------------------


class Model(nn.Module):
    """Upstream's test model: ``outer(inner(x) + inner(x))`` with a buffer and a non-persistent
    buffer on ``inner``'s parent."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)
        self.register_buffer("buffer", torch.randn(5, 5))
        self.register_buffer("non_persistent", torch.randn(5, 5), persistent=False)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))


def _nested(fsdp, seed, **kw):
    torch.manual_seed(seed)
    seq = nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False))
    return fsdp(nn.Sequential(fsdp(seq[0], **kw), seq[1]), **kw), (4, 10)


def _odd(fsdp, seed, **kw):
    """Shapes (7,3), (7,), (1,7), (1,): chunks of unequal size and ranks with no chunk."""
    torch.manual_seed(seed)
    seq = nn.Sequential(nn.Linear(3, 7), nn.Linear(7, 1))
    return fsdp(nn.Sequential(seq[0], fsdp(seq[1], **kw)), **kw), (4, 3)


def _model(fsdp, seed, **kw):
    torch.manual_seed(seed)
    m = Model()
    m.inner = fsdp(m.inner, **kw)
    return fsdp(m, **kw), (4, 4)


def _impls():
    warnings.simplefilter("ignore")  # deprecation noise from both implementations
    import torch.distributed.fsdp as tfsdp

    import reference as ref

    def theirs(module, **kw):
        return tfsdp.FullyShardedDataParallel(module, device_id=CPU, **kw)

    return (ref, ref.FullyShardedDataParallel), (tfsdp, theirs)


def _full_sd(api, fsdp_cls, model):
    with fsdp_cls.state_dict_type(model, api.StateDictType.FULL_STATE_DICT):
        return model.state_dict()


def _st_view(value):
    """What identifies a ShardedTensor on this rank: metadata and local shard values."""
    shards = value.local_shards()
    local = (shards[0].metadata.shard_offsets, shards[0].tensor) if shards else None
    return value.metadata().shards_metadata, value.size(), local


def _clone_sd(sd):
    """A copy sharing no storage with the model (LOCAL values are views, upstream too)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    out = {}
    for key, value in sd.items():
        if isinstance(value, ShardedTensor):
            shards = [Shard(s.tensor.clone(), s.metadata) for s in value.local_shards()]
            out[key] = ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, value.metadata(), process_group=value._process_group
            )
        else:
            out[key] = value.clone()
    return out


def _assert_same_sd(ours, theirs, where):
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    assert list(ours) == list(theirs), f"{where}: keys {list(ours)} != torch {list(theirs)}"
    for key, expected in theirs.items():
        got = ours[key]
        if isinstance(expected, ShardedTensor):
            assert isinstance(got, ShardedTensor), f"{where}: {key} is {type(got)}"
            (md_g, size_g, loc_g), (md_e, size_e, loc_e) = _st_view(got), _st_view(expected)
            assert md_g == md_e and size_g == size_e, f"{where}: {key} metadata differs"
            assert (loc_g is None) == (loc_e is None), f"{where}: {key} local shard presence"
            if loc_e is not None:
                assert loc_g[0] == loc_e[0], f"{where}: {key} offsets {loc_g[0]} != {loc_e[0]}"
                assert torch.equal(loc_g[1], loc_e[1]), f"{where}: {key} local values differ"
        else:
            assert got.dtype == expected.dtype, f"{where}: {key} dtype {got.dtype}"
            assert torch.allclose(got, expected, atol=1e-6), f"{where}: {key} values differ"


# -- body 1: layouts, values and round trips for every type ---------------------------------------


def _body_layouts(rank, ws):
    (ref, RF), (tfsdp, TF) = _impls()
    types = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
    for build in (_nested, _odd, _model):
        for use_orig in (False, True):
            where = f"rank {rank} {build.__name__} use_orig_params={use_orig}"
            ours, in_shape = build(RF, 0, use_orig_params=use_orig)
            theirs, _ = build(TF, 0, use_orig_params=use_orig)
            names = [(n, p.shape) for n, p in ours.named_parameters()]
            assert names == [(n, p.shape) for n, p in theirs.named_parameters()], where
            # Training parity: two SGD steps on rank-dependent data.
            for model in (ours, theirs):
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(2):
                    torch.manual_seed(100 + 10 * rank + step)
                    model(torch.randn(in_shape)).sum().backward()
                    opt.step()
                    opt.zero_grad()
            for tname in types:
                if use_orig and tname == "LOCAL_STATE_DICT":
                    continue  # undefined upstream (S17)
                with RF.state_dict_type(ours, getattr(ref.StateDictType, tname)):
                    sd_ours = ours.state_dict()
                with tfsdp.FullyShardedDataParallel.state_dict_type(
                    theirs, getattr(tfsdp.StateDictType, tname)
                ):
                    sd_theirs = theirs.state_dict()
                _assert_same_sd(sd_ours, sd_theirs, f"{where} {tname}")
                sd_ours = _clone_sd(sd_ours)
                assert not any("_fsdp_wrapped_module" in k for k in sd_ours), where
                # Round trip: scribble over the parameters, load, compare with the saved FULL.
                saved_full = _full_sd(ref, RF, ours)
                with torch.no_grad(), RF.summon_full_params(ours):
                    for p in ours.parameters():
                        p.fill_(1.75)
                with RF.state_dict_type(ours, getattr(ref.StateDictType, tname)):
                    result = ours.load_state_dict(sd_ours)
                assert not result.missing_keys and not result.unexpected_keys, where
                _assert_same_sd(_full_sd(ref, RF, ours), saved_full, f"{where} reload {tname}")
            # The torch SHARDED dict loads into the reference as well.
            with tfsdp.FullyShardedDataParallel.state_dict_type(
                theirs, tfsdp.StateDictType.SHARDED_STATE_DICT
            ):
                sd_theirs = theirs.state_dict()
            with RF.state_dict_type(ours, ref.StateDictType.SHARDED_STATE_DICT):
                ours.load_state_dict(sd_theirs)
            _assert_same_sd(
                _full_sd(ref, RF, ours),
                _full_sd(tfsdp, tfsdp.FullyShardedDataParallel, theirs),
                where,
            )
    _check_full_details(rank, ws, ref, RF)
    _check_sharded_rule(rank, ws, ref, RF)


def _check_full_details(rank, ws, ref, RF):
    ours, _ = _nested(RF, 1)
    full = _full_sd(ref, RF, ours)
    # S2: detached clones, not views of the flat parameter.
    flat_ptrs = {m._flat_param.data_ptr() for m in RF.fsdp_modules(ours)}
    for key, value in full.items():
        assert value.shape == (10, 10) and value._base is None, key
        assert value.data_ptr() not in flat_ptrs and not value.requires_grad, key
    # S3: rank0_only gives every entry on rank 0 and {} elsewhere for an FSDP root.
    cfg = ref.FullStateDictConfig(rank0_only=True)
    with RF.state_dict_type(ours, ref.StateDictType.FULL_STATE_DICT, cfg):
        r0 = ours.state_dict()
    if rank == 0:
        assert list(r0) == list(full) and all(torch.equal(r0[k], full[k]) for k in full)
    else:
        assert r0 == {}, f"rank {rank}: rank0_only returned {list(r0)}"
    # S4: offload_to_cpu works on a CPU compute device (upstream raises here: pytorch#188989).
    cfg = ref.FullStateDictConfig(offload_to_cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with RF.state_dict_type(ours, ref.StateDictType.FULL_STATE_DICT, cfg):
            off = ours.state_dict()
    assert all(v.device.type == "cpu" and torch.equal(v, full[k]) for k, v in off.items())
    for tname, cfg in (
        ("SHARDED_STATE_DICT", ref.ShardedStateDictConfig(offload_to_cpu=True)),
        ("LOCAL_STATE_DICT", ref.LocalStateDictConfig(offload_to_cpu=True)),
    ):
        with RF.state_dict_type(ours, getattr(ref.StateDictType, tname), cfg):
            sd = ours.state_dict()
        assert all(s.tensor.device.type == "cpu" for v in sd.values() for s in v.local_shards())
    # summon_full_params: writeback=False drops changes, writeback=True keeps them on every rank.
    with torch.no_grad(), RF.summon_full_params(ours, writeback=False):
        ours.module[1].weight.fill_(3.0)
    assert torch.equal(_full_sd(ref, RF, ours)["1.weight"], full["1.weight"])
    with torch.no_grad(), RF.summon_full_params(ours):
        ours.module[1].weight.fill_(3.0)
    assert torch.equal(_full_sd(ref, RF, ours)["1.weight"], torch.full((10, 10), 3.0))
    try:
        with RF.summon_full_params(ours, rank0_only=True, writeback=True):
            raise AssertionError("rank0_only with writeback was accepted")
    except NotImplementedError as e:
        assert "writeback=True and rank0_only=True is not supported yet" in str(e)
    ours.load_state_dict(full)
    # S9: the context restores the previous type. S10: a config of the wrong type raises.
    with RF.state_dict_type(ours, ref.StateDictType.LOCAL_STATE_DICT):
        pass
    assert all(
        m._state_dict_type == ref.StateDictType.FULL_STATE_DICT for m in RF.fsdp_modules(ours)
    )
    try:
        with RF.state_dict_type(
            ours, ref.StateDictType.FULL_STATE_DICT, ref.LocalStateDictConfig()
        ):
            raise AssertionError("mismatched config was accepted")
    except RuntimeError as e:
        assert "Expected state_dict_config of type" in str(e) and "LocalStateDictConfig" in str(e)
    # S11: missing/unexpected keys reported without wrapper prefixes.
    broken = dict(full)
    broken.pop("0.weight")
    broken["unexpected"] = torch.zeros(1)
    result = ours.load_state_dict(broken, strict=False)
    assert result.missing_keys == ["0.weight"], result
    assert result.unexpected_keys == ["unexpected"], result


def _check_sharded_rule(rank, ws, ref, RF):
    """S5/S7 from the rule alone: chunk ``ceil(d0/ws)`` rows at offset ``ceil(d0/ws)*rank``."""
    ours, _ = _odd(RF, 2)
    full = _full_sd(ref, RF, ours)
    with RF.state_dict_type(ours, ref.StateDictType.SHARDED_STATE_DICT):
        sharded = ours.state_dict()
    for key, value in full.items():
        step = math.ceil(value.shape[0] / ws)
        rows = value[step * rank : step * (rank + 1)]
        shards = sharded[key].local_shards()
        if rows.shape[0] == 0:
            assert shards == [], f"rank {rank}: {key} should have no local shard"
            continue
        assert shards[0].metadata.shard_offsets[0] == step * rank, key
        assert torch.equal(shards[0].tensor, rows), key
    with RF.state_dict_type(ours, ref.StateDictType.LOCAL_STATE_DICT):
        local = ours.state_dict()
    # The root flattens Linear(3, 7) (21 + 7 elements), the child Linear(7, 1) (7 + 1).
    for key, numel in (("_flat_param", 28), ("1._flat_param", 8)):
        step = math.ceil(numel / ws)
        mine = max(0, min(step, numel - step * rank))
        shards = local[key].local_shards()
        assert local[key].size() == (numel,), key
        assert (shards[0].tensor.numel() if shards else 0) == mine, f"rank {rank}: {key}"


# -- body 2: buffers, mixed precision, ignored modules, non-FSDP roots ---------------------------


class TwoBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 10)
        self.register_buffer("b1", torch.ones(3))
        self.register_buffer("b2", torch.full((2,), 2.0))

    def forward(self, x):
        return self.lin(x)


def _multibuffer(fsdp, api, **kw):
    """Upstream's multibuffer model plus two buffers of distinct values on the root."""
    torch.manual_seed(3)
    mp = api.MixedPrecision(torch.float16, torch.float16, torch.float16)
    seq = nn.Sequential(TwoBuffers(), nn.BatchNorm1d(10), nn.Linear(10, 10))
    seq[1] = fsdp(seq[1], mixed_precision=api.MixedPrecision(), **kw)
    seq[0].lin = fsdp(seq[0].lin, mixed_precision=mp, **kw)
    return fsdp(seq, mixed_precision=mp, **kw)


def _body_buffers(rank, ws):
    (ref, RF), (tfsdp, TF) = _impls()
    TFSDP = tfsdp.FullyShardedDataParallel
    for use_orig in (False, True):
        where = f"rank {rank} use_orig_params={use_orig}"
        ours = _multibuffer(RF, ref, use_orig_params=use_orig)
        theirs = _multibuffer(TF, tfsdp, use_orig_params=use_orig)
        # Training parity under fp16 compute (S13): loss is fp16, the dict is fp32.
        for model in (ours, theirs):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(2):
                torch.manual_seed(200 + 10 * rank + step)
                loss = model(torch.randn(4, 10)).sum()
                assert loss.dtype == torch.float16, f"{where}: loss {loss.dtype}"
                loss.backward()
                opt.step()
                opt.zero_grad()
        sd_ours, sd_theirs = _full_sd(ref, RF, ours), _full_sd(tfsdp, TFSDP, theirs)
        assert list(sd_ours) == list(sd_theirs), f"{where}: {list(sd_ours)}"
        for key, expected in sd_theirs.items():
            got = sd_ours[key]
            assert got.dtype == expected.dtype, f"{where}: {key} {got.dtype} != {expected.dtype}"
            assert torch.allclose(got.float(), expected.float(), atol=2e-3), f"{where}: {key}"
        # S12: each buffer keeps its own value, saved in fp32 while the module keeps fp16.
        assert torch.equal(sd_ours["0.b1"], torch.ones(3)), sd_ours["0.b1"]
        assert torch.equal(sd_ours["0.b2"], torch.full((2,), 2.0)), sd_ours["0.b2"]
        assert ours.module[0].b1.dtype == torch.float16, where
        assert ours.module[1].module.running_mean.dtype == torch.float32, where  # MP disabled
        # SHARDED/LOCAL agree on buffers too.
        for tname in ("SHARDED_STATE_DICT",) + (() if use_orig else ("LOCAL_STATE_DICT",)):
            with RF.state_dict_type(ours, getattr(ref.StateDictType, tname)):
                s1 = ours.state_dict()
            with TFSDP.state_dict_type(theirs, getattr(tfsdp.StateDictType, tname)):
                s2 = theirs.state_dict()
            assert list(s1) == list(s2), f"{where} {tname}: {list(s1)} != {list(s2)}"
            for key in ("0.b1", "0.b2", "1.running_mean", "1.num_batches_tracked"):
                assert s1[key].dtype == s2[key].dtype and torch.equal(s1[key], s2[key]), key
    _check_ignored_modules(rank, ref, RF, tfsdp, TF)
    _check_non_fsdp_root(rank, ref, RF, tfsdp, TF)
    _check_rank0_load_and_sync(rank, ref, RF)
    _check_summon_with_grads(rank, ref, RF, tfsdp, TF)


def _check_rank0_load_and_sync(rank, ref, RF):
    """S21 on CPU: save FULL with rank0_only, load it on rank 0 only into an unwrapped model, wrap
    with ``sync_module_states=True``: every rank ends with the source values (upstream needs a
    GPU for this flow)."""
    import torch.distributed as dist

    source, _ = _nested(RF, 13)
    cfg = ref.FullStateDictConfig(rank0_only=True)
    with RF.state_dict_type(source, ref.StateDictType.FULL_STATE_DICT, cfg):
        saved = source.state_dict()
    torch.manual_seed(100 + rank)  # a different init on every rank
    plain = nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False))
    if rank == 0:
        plain.load_state_dict(saved)
    synced = RF(plain, sync_module_states=True)
    got = _full_sd(ref, RF, synced)
    expected = _full_sd(ref, RF, source)
    _assert_same_sd(got, expected, f"rank {rank} sync_module_states")
    dist.barrier()


def _check_summon_with_grads(rank, ref, RF, tfsdp, TF):
    """summon_full_params(with_grads=True) exposes the same full gradients as torch."""
    grads = []
    for fsdp, cls in ((RF, RF), (TF, tfsdp.FullyShardedDataParallel)):
        model, in_shape = _odd(fsdp, 14, use_orig_params=True)
        torch.manual_seed(400 + rank)
        model(torch.randn(in_shape)).sum().backward()
        with cls.summon_full_params(model, with_grads=True):
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert list(grads[0]) == list(grads[1]), list(grads[0])
    for name, g in grads[1].items():
        assert torch.allclose(grads[0][name], g, atol=1e-6), f"rank {rank}: grad of {name}"


def _check_ignored_modules(rank, ref, RF, tfsdp, TF):
    """S14: keys carry the prefix; ignored parameters and buffers are the live tensors."""
    built = []
    for fsdp in (RF, TF):
        torch.manual_seed(4)
        m = Model()
        m.inner = fsdp(m.inner)
        built.append(fsdp(m, ignored_modules=[m.outer]))
    ours, theirs = built
    sd_ours = ours.state_dict(prefix="foo.")
    sd_theirs = theirs.state_dict(prefix="foo.")
    assert list(sd_ours) == list(sd_theirs), f"{list(sd_ours)} != {list(sd_theirs)}"
    live = ours.module
    assert sd_ours["foo.outer.weight"].data_ptr() == live.outer.weight.data_ptr()
    assert sd_ours["foo.buffer"].data_ptr() == live.buffer.data_ptr()
    assert all(torch.equal(sd_ours[k], sd_theirs[k]) for k in sd_theirs)
    plain = Model()
    plain.load_state_dict({k[len("foo.") :]: v for k, v in sd_ours.items()}, strict=True)


def _check_non_fsdp_root(rank, ref, RF, tfsdp, TF):
    """S3 with a non-FSDP root: other ranks keep the non-FSDP entries."""
    keys = []
    for api, fsdp, cls in (
        (ref, RF, RF),
        (tfsdp, TF, tfsdp.FullyShardedDataParallel),
    ):
        torch.manual_seed(5)
        root = nn.Module()
        root.non_fsdp_lin = nn.Linear(3, 3, bias=False)
        root.fsdp_1 = fsdp(nn.Linear(3, 3, bias=False))
        cfg = api.FullStateDictConfig(rank0_only=True)
        with cls.state_dict_type(root, api.StateDictType.FULL_STATE_DICT, cfg):
            keys.append(sorted(root.state_dict()))
    assert keys[0] == keys[1], f"rank {rank}: {keys[0]} != torch {keys[1]}"


# -- body 3: bad input, device mesh, NO_SHARD ----------------------------------------------------


def _expect_rejected(model, ref, RF, sd, tname, strict, needles, where):
    """Loading ``sd`` raises a RuntimeError containing ``needles`` and changes no parameter."""
    before = _clone_sd(_full_sd(ref, RF, model))
    try:
        with RF.state_dict_type(model, getattr(ref.StateDictType, tname)):
            model.load_state_dict(sd, strict=strict)
    except RuntimeError as e:
        for needle in needles:
            assert needle in str(e), f"{where}: {needle!r} not in {e}"
    else:
        raise AssertionError(f"{where}: bad state dict was accepted")
    after = _full_sd(ref, RF, model)
    assert all(torch.equal(before[k], after[k]) for k in before), f"{where}: params changed"
    assert all(m._unshard_stack is None for m in RF.fsdp_modules(model)), where


def _body_bad_input(rank, ws):
    (ref, RF), (tfsdp, TF) = _impls()
    ours, _ = _nested(RF, 6)
    full = _clone_sd(_full_sd(ref, RF, ours))
    with RF.state_dict_type(ours, ref.StateDictType.SHARDED_STATE_DICT):
        sharded = _clone_sd(ours.state_dict())
    with RF.state_dict_type(ours, ref.StateDictType.LOCAL_STATE_DICT):
        local = _clone_sd(ours.state_dict())
    # Scribble so that a partial load would be visible.
    with torch.no_grad(), RF.summon_full_params(ours):
        for p in ours.parameters():
            p.fill_(0.5)
    wrong_shape = dict(full, **{"1.weight": torch.zeros(10, 9)})
    _expect_rejected(
        ours,
        ref,
        RF,
        wrong_shape,
        "FULL_STATE_DICT",
        True,
        ["'1.weight'", "(10, 10)", "(10, 9)"],
        "wrong shape",
    )
    missing = {k: v for k, v in full.items() if k != "1.weight"}
    _expect_rejected(
        ours,
        ref,
        RF,
        missing,
        "FULL_STATE_DICT",
        True,
        ["missing key '1.weight'", "strict=False"],
        "missing key",
    )
    _expect_rejected(
        ours,
        ref,
        RF,
        dict(full, extra=torch.zeros(1)),
        "FULL_STATE_DICT",
        True,
        ["unexpected key 'extra'"],
        "unexpected key",
    )
    _expect_rejected(
        ours,
        ref,
        RF,
        sharded,
        "FULL_STATE_DICT",
        True,
        ["'0.weight'", "ShardedTensor", "FULL_STATE_DICT"],
        "ShardedTensor as FULL",
    )
    _expect_rejected(
        ours,
        ref,
        RF,
        full,
        "SHARDED_STATE_DICT",
        True,
        ["'0.weight'", "expects a ShardedTensor"],
        "plain as SHARDED",
    )
    _expect_rejected(
        ours, ref, RF, sharded, "LOCAL_STATE_DICT", True, ["'_flat_param'"], "SHARDED as LOCAL"
    )
    _expect_rejected(
        ours,
        ref,
        RF,
        dict(local, **{"0._flat_param": full["0.weight"]}),
        "LOCAL_STATE_DICT",
        True,
        ["'0._flat_param'", "ShardedTensor"],
        "LOCAL plain",
    )
    # Construction rejects a scalar parameter before wrapping anything.
    scalar = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    scalar[1].scale = nn.Parameter(torch.tensor(1.0))
    try:
        RF(scalar, auto_wrap_policy=ref.wrap.ModuleWrapPolicy({nn.Linear}))
    except ValueError as e:
        assert "1.scale" in str(e), e
    else:
        raise AssertionError("scalar parameter accepted")
    assert all(type(m) is nn.Linear for m in scalar) and "weight" in scalar[0]._parameters
    # A valid dict still loads afterwards (no unshard was left open).
    ours.load_state_dict(full)
    _assert_same_sd(_full_sd(ref, RF, ours), full, f"rank {rank} reload after errors")
    _check_device_mesh(rank, ws, ref, RF, tfsdp, TF)
    _check_no_shard(rank, ref, RF, full)


def _check_device_mesh(rank, ws, ref, RF, tfsdp, TF):
    """S6: SHARDED gives DTensors with (Shard(0),) when FSDP got a device mesh; LOCAL refuses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ws,))
    built = []
    for fsdp in (RF, TF):
        torch.manual_seed(7)
        seq = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
        built.append(fsdp(seq, device_mesh=mesh))
    ours, theirs = built
    with RF.state_dict_type(ours, ref.StateDictType.SHARDED_STATE_DICT):
        sd_ours = ours.state_dict()
    TFSDP = tfsdp.FullyShardedDataParallel
    with TFSDP.state_dict_type(theirs, tfsdp.StateDictType.SHARDED_STATE_DICT):
        sd_theirs = theirs.state_dict()
    assert list(sd_ours) == list(sd_theirs)
    for key, expected in sd_theirs.items():
        got = sd_ours[key]
        assert isinstance(got, DTensor) and got.placements == (Shard(0),), key
        assert got.shape == expected.shape and torch.equal(got.to_local(), expected.to_local())
    with torch.no_grad(), RF.summon_full_params(ours):
        for p in ours.parameters():
            p.zero_()
    with RF.state_dict_type(ours, ref.StateDictType.SHARDED_STATE_DICT):
        ours.load_state_dict(sd_theirs)
    _assert_same_sd(_full_sd(ref, RF, ours), _full_sd(tfsdp, TFSDP, theirs), "mesh reload")
    try:
        with RF.state_dict_type(ours, ref.StateDictType.LOCAL_STATE_DICT):
            ours.state_dict()
    except RuntimeError as e:
        assert "DeviceMesh is not compatible with LOCAL_STATE_DICT" in str(e), e
    else:
        raise AssertionError("LOCAL with a device mesh was accepted")


def _check_no_shard(rank, ref, RF, full):
    """S8 on two ranks: NO_SHARD warns at construction and turns every type into FULL."""
    torch.manual_seed(6)
    seq = nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = RF(seq, sharding_strategy=ref.ShardingStrategy.NO_SHARD)
        with RF.state_dict_type(model, ref.StateDictType.SHARDED_STATE_DICT):
            sd = model.state_dict()
            model.load_state_dict(full)
    texts = [str(w.message) for w in caught]
    assert any("`NO_SHARD` sharding strategy is deprecated" in t for t in texts), texts
    assert any("full_state_dict will be returned." in t for t in texts), texts
    assert all(type(v) is torch.Tensor and v.shape == (10, 10) for v in sd.values())
    _assert_same_sd(_full_sd(ref, RF, model), full, f"rank {rank} NO_SHARD load")


# -- body 4: world size 1 (a size-1 group per rank) -------------------------------------------------------------------------


def _body_world_size_one(rank, ws):
    """Each rank builds its models on a process group of its own (size 1)."""
    import torch.distributed as dist

    (ref, RF), (tfsdp, TF) = _impls()
    solo = [dist.new_group([r]) for r in range(ws)][rank]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, _ = _nested(RF, 8, process_group=solo)
    texts = [str(w.message) for w in caught]
    expected = "FSDP is switching to use `NO_SHARD` instead of ShardingStrategy.FULL_SHARD since "
    assert any(t.startswith(expected) for t in texts), texts
    assert ours.sharding_strategy == ref.ShardingStrategy.NO_SHARD
    theirs, _ = _nested(TF, 8, process_group=solo)
    TFSDP = tfsdp.FullyShardedDataParallel
    with RF.state_dict_type(ours, ref.StateDictType.SHARDED_STATE_DICT):
        sd_ours = ours.state_dict()
        ours.load_state_dict(sd_ours)
    with TFSDP.state_dict_type(theirs, tfsdp.StateDictType.SHARDED_STATE_DICT):
        sd_theirs = theirs.state_dict()
    _assert_same_sd(sd_ours, sd_theirs, "world size 1")
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [
        (n, p.shape) for n, p in theirs.named_parameters()
    ]


# -- body 5: auto-wrap, activation checkpointing, shared parameters ------------------------------


def _fsdp_names(model, cls):
    return [n for n, m in model.named_modules() if isinstance(m, cls)]


def _body_wrap_ckpt_shared(rank, ws):
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import wrap as twrap

    from reference import wrap as rwrap

    (ref, RF), (tfsdp, TF) = _impls()
    TFSDP = tfsdp.FullyShardedDataParallel

    def tree():
        torch.manual_seed(9)
        inner = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
        return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), inner, nn.BatchNorm1d(10))

    # auto_wrap_policy goes through reference.wrap; the BN override follows mixed precision.
    size = functools.partial(rwrap.size_based_auto_wrap_policy, min_num_params=100)
    tsize = functools.partial(twrap.size_based_auto_wrap_policy, min_num_params=100)
    ours = RF(tree(), auto_wrap_policy=size, mixed_precision=ref.MixedPrecision(torch.float16))
    theirs = TF(tree(), auto_wrap_policy=tsize, mixed_precision=tfsdp.MixedPrecision(torch.float16))
    assert _fsdp_names(ours, RF) == _fsdp_names(theirs, TFSDP), _fsdp_names(ours, RF)
    x = torch.randn(4, 10)
    assert torch.allclose(ours(x).float(), theirs(x).float(), atol=1e-2)
    _assert_same_sd(_full_sd(ref, RF, ours), _full_sd(tfsdp, TFSDP, theirs), "auto-wrap")
    ours = RF(tree(), auto_wrap_policy=rwrap.ModuleWrapPolicy({nn.Linear}))
    theirs = TF(tree(), auto_wrap_policy=twrap.ModuleWrapPolicy({nn.Linear}))
    assert _fsdp_names(ours, RF) == _fsdp_names(theirs, TFSDP), _fsdp_names(ours, RF)

    # S16: checkpoint wrappers before or after FSDP leave no prefix; backward recomputes fine.
    def pair():
        torch.manual_seed(10)
        return nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))

    source = RF(nn.Sequential(checkpoint_wrapper(pair()[0]), pair()[1]))
    after = RF(pair())
    apply_activation_checkpointing(after, check_fn=lambda m: isinstance(m, nn.Linear))
    for model in (source, after):
        model(x).sum().backward()
        assert list(model.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    after.load_state_dict(source.state_dict())
    _assert_same_sd(_full_sd(ref, RF, after), _full_sd(ref, RF, source), "checkpoint load")

    # S15: shared modules and parameters keep both names with equal values, every type.
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(11)
            self.net1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.net2 = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
            self.net3 = self.net2
            self.random_parameter = nn.Parameter(torch.randn(10))
            self.shared_parameter = self.random_parameter

        def forward(self, x):
            return self.net3(self.net2(self.net1(x)))

    ours, theirs = RF(Shared()), TF(Shared())
    for tname in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        with RF.state_dict_type(ours, getattr(ref.StateDictType, tname)):
            sd = ours.state_dict()
            ours.load_state_dict(sd)
        with TFSDP.state_dict_type(theirs, getattr(tfsdp.StateDictType, tname)):
            sd_theirs = theirs.state_dict()
        _assert_same_sd(sd, sd_theirs, f"rank {rank} shared {tname}")
    full = _full_sd(ref, RF, ours)
    assert torch.equal(full["random_parameter"], full["shared_parameter"])
    assert torch.equal(full["net2.0.weight"], full["net3.0.weight"])


def test_auto_wrap_checkpoint_wrapper_shared_params(two_rank_results):
    _check_section(two_rank_results, "wrap_ckpt_shared")


# -- body 6: sharding strategies and activation checkpointing in training ------------------------


def _body_strategies(rank, ws):
    """FULL_SHARD frees the gathered storage after forward and gathers again for backward;
    SHARD_GRAD_OP keeps it. Both, with and without activation checkpointing applied after
    wrapping, train to the same parameters as torch FSDP1 (``inner`` runs twice per forward)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    (ref, RF), (tfsdp, TF) = _impls()
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for checkpoint in (False, True):
            where = f"rank {rank} {strategy} checkpoint={checkpoint}"
            trained = []
            for api, fsdp in ((ref, RF), (tfsdp, TF)):
                model, in_shape = _model(
                    fsdp, 12, sharding_strategy=getattr(api.ShardingStrategy, strategy)
                )
                if checkpoint:
                    apply_activation_checkpointing(
                        model, check_fn=lambda m: isinstance(m, nn.Linear)
                    )
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(2):
                    torch.manual_seed(300 + 10 * rank + step)
                    out = model(torch.randn(in_shape))
                    if fsdp is RF:
                        gathered = [
                            t
                            for m in RF.fsdp_modules(model)
                            for t in m._handle._gathered_for_backward
                        ]
                        freed = [t.untyped_storage().size() == 0 for t in gathered]
                        assert len(gathered) == 3, where  # inner twice, root once
                        assert all(freed) == (strategy == "FULL_SHARD") == any(freed), where
                    out.sum().backward()
                    opt.step()
                    opt.zero_grad()
                trained.append(model.state_dict())
            _assert_same_sd(trained[0], trained[1], where)
            assert not any("_checkpoint_wrapped_module" in k for k in trained[0]), where


# -- one spawn for every two-rank section; one test per section ---------------------------------

_SECTIONS = {
    "layouts": _body_layouts,
    "buffers": _body_buffers,
    "bad_input": _body_bad_input,
    "world_size_one": _body_world_size_one,
    "wrap_ckpt_shared": _body_wrap_ckpt_shared,
    "strategies": _body_strategies,
}


def _body_all(rank, ws):
    """Run every section; a failing section reports its traceback and the next one still runs
    (process start and imports dominate the cost on a loaded 2-core machine)."""
    out = {}
    for name, body in _SECTIONS.items():
        try:
            body(rank, ws)
            out[name] = None
        except Exception:
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def two_rank_results():
    return run_on_ranks(_body_all, 2, timeout=300)


def _check_section(results, name):
    errors = [f"rank {r}:\n{res[name]}" for r, res in enumerate(results) if res[name]]
    assert not errors, "\n".join(errors)


def test_layouts_values_round_trips_against_torch(two_rank_results):
    _check_section(two_rank_results, "layouts")


def test_buffers_mixed_precision_ignored_modules_against_torch(two_rank_results):
    _check_section(two_rank_results, "buffers")


def test_bad_input_device_mesh_no_shard(two_rank_results):
    _check_section(two_rank_results, "bad_input")


def test_world_size_one_runs_no_shard(two_rank_results):
    _check_section(two_rank_results, "world_size_one")


def test_sharding_strategies_and_checkpointing_train_like_torch(two_rank_results):
    _check_section(two_rank_results, "strategies")
