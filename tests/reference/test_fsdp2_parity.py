# ruff: noqa: B023  (lambdas inside the per-implementation loop are called at once)
"""Multi-rank checks of the reference FSDP2 against the rules and against upstream ``fully_shard``.

Two spawns in all (module-scoped fixtures): world size 2 runs most sub-cases on both
implementations; world size 4 covers the uneven (5, 3) layout and ``reshard_after_forward=2``.
Each rank returns plain Python observations; the test functions compare them with values
derived from the rules (``torch.chunk``, the spec's tables) and with upstream's observations.
"""

from __future__ import annotations

import pytest

from tests._spawn import run_on_ranks

IMPLS = ("ref", "up")


def _api(impl):
    if impl == "ref":
        import reference._fully_shard as api
    else:
        import torch.distributed.fsdp as api
    return api


def _catch(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # the observation is the exception's type and message
        return (type(e).__name__, str(e))


def _mlp(seed=0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4), nn.Linear(4, 1))


def _shard(api, model, mesh, **kw):
    api.fully_shard(model[0], mesh=mesh, **kw)
    api.fully_shard(model[2], mesh=mesh, **kw)
    api.fully_shard(model, mesh=mesh, **kw)
    return model


def _state(module):
    group = module._get_fsdp_state()._fsdp_param_group
    return str(group.fsdp_params[0].sharded_state).split(".")[-1]


def _ws2_body(rank, ws):
    import types

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (ws,))
    out = {"rank": rank}
    for impl in IMPLS:
        api = _api(impl)
        o = out[impl] = {}
        # -- layout (P1): Linear(3,5): (5,3) + (5,); Linear(5,4): (4,5) + (4,); Linear(4,1): (1,4)
        model = _mlp()
        originals = {n: p.detach().clone() for n, p in model.named_parameters()}
        _shard(api, model, mesh)
        layout = {}
        names = {id(p): n for n, p in model.named_parameters()}
        for fsdp_module in (model[0], model[2], model):
            for fp in fsdp_module._get_fsdp_state()._fsdp_param_group.fsdp_params:
                name = names[id(fp.sharded_param)]
                p = model.get_parameter(name)
                layout[name] = dict(
                    is_param_dtensor=isinstance(p, nn.Parameter) and isinstance(p, DTensor),
                    is_sharded_param=p is fp.sharded_param,
                    global_size=tuple(p.shape),
                    global_stride=p.stride(),
                    placements=p.placements,
                    sharded_size=tuple(fp.sharded_size),
                    padded=tuple(fp.padded_sharded_param_size),
                    data=fp._sharded_param_data.tolist(),
                    local=p.to_local().tolist(),
                    local_shape=tuple(p.to_local().shape),
                    shares_storage=p.to_local().untyped_storage().data_ptr()
                    == fp._sharded_param_data.untyped_storage().data_ptr(),
                    requires_grad=p.requires_grad,
                    original=originals[name].tolist(),
                )
        o["layout"] = layout
        # -- states (P2) and training parity for each reshard_after_forward
        for raf in (True, False, None):
            model = _shard(api, _mlp(), mesh, reshard_after_forward=raf)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            steps = []
            for step in range(2):
                torch.manual_seed(100 + 10 * step + rank)
                loss = model(torch.randn(4, 3)).sum()
                after_fwd = [(_state(m), type(w).__name__) for m, w in ((model, model[3].weight),)]
                after_fwd += [(_state(m), type(m.weight).__name__) for m in (model[0], model[2])]
                loss.backward()
                after_bwd = [_state(m) for m in (model[0], model[2])]
                grads = [p.grad.to_local().tolist() for p in model.parameters()]
                opt.step()
                opt.zero_grad()
                steps.append((after_fwd, after_bwd, grads))
            full = {n: p.full_tensor().detach().tolist() for n, p in model.named_parameters()}
            o[("train", raf)] = (steps, full)
        # -- mixed precision (P5)
        for mp in [
            (torch.bfloat16, torch.float32),
            (torch.float32, torch.float32),
            (torch.bfloat16, torch.bfloat16),
            (torch.float16, None),
        ]:
            model = _mlp()
            for child in (model[0], model[2]):
                api.fully_shard(child, mesh=mesh, mp_policy=api.MixedPrecisionPolicy(*mp))
            root_policy = api.MixedPrecisionPolicy(*mp, output_dtype=torch.float64)
            api.fully_shard(model, mesh=mesh, mp_policy=root_policy)
            y = model(torch.ones(2, 3))
            y.sum().backward()
            fp = model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
            o[("mp", mp)] = (
                fp.param_dtype,
                fp.reduce_dtype,
                fp.orig_dtype,
                y.dtype,
                model[0].weight.dtype,
                model[0].weight.grad.dtype,
                model[0].weight.grad.to_local().tolist(),
            )
        # -- errors (P3, P12, P13), each leaving the module unchanged
        errors = {}

        def attempt(key, module, **kw):
            before = {n: p for n, p in module.named_parameters()}
            errors[key] = _catch(lambda: api.fully_shard(module, mesh=mesh, **kw) and None)
            unchanged = not isinstance(module, api.FSDPModule) and all(
                module.get_parameter(n) is p for n, p in before.items()
            )
            errors[key] += (unchanged,)

        scalar = nn.Linear(2, 2)
        scalar.scalar_p = nn.Parameter(torch.tensor(1.0))
        attempt("scalar", scalar)
        attempt("noncontig", nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last))
        for raf in (3, 0, "x"):
            attempt(("raf", raf), nn.Linear(2, 2), reshard_after_forward=raf)
        attempt("replicate", nn.Linear(2, 2), shard_placement_fn=lambda p: Replicate())
        attempt("bias_dim1", nn.Linear(2, 4), shard_placement_fn=lambda p: Shard(1))
        attempt("uneven_dim1", nn.Linear(3, 4, bias=False), shard_placement_fn=lambda p: Shard(1))
        errors["mesh2d"] = _catch(
            lambda: api.fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, ws))) and None
        )

        def double_root():
            a, b = nn.Linear(2, 2), nn.Linear(2, 2)
            api.fully_shard([a, b], mesh=mesh)
            a(torch.ones(1, 2))

        errors["two_roots"] = _catch(double_root)

        def child_first():
            m = _shard(api, _mlp(), mesh)
            m[0](torch.ones(1, 3))
            m(torch.ones(1, 3))

        errors["child_first"] = _catch(child_first)
        o["errors"] = errors
        # -- Shard(-1) placement (P13) with training
        lin = nn.Linear(4, 3, bias=False)
        api.fully_shard(lin, mesh=mesh, shard_placement_fn=lambda p: Shard(-1))
        lin(torch.ones(2, 4)).sum().backward()
        fp = lin._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        o["shard_last"] = (
            fp.fsdp_placement,
            lin.weight.to_local().shape,
            lin.weight.grad.placements,
        )
        # -- state dict (P8) and reset_sharded_param after assign=True (P9)
        model = _shard(api, _mlp(), mesh, reshard_after_forward=False)
        model(torch.ones(1, 3))
        registered_before = type(model[0].weight).__name__
        sd = model.state_dict()
        o["sd"] = dict(
            registered_before=registered_before,
            keys=sorted(sd),
            types={type(v).__name__ for v in sd.values()},
            same_ptr=sd["0.weight"].to_local().data_ptr() == model[0].weight.to_local().data_ptr(),
            state_after=_state(model[0]),
            load_plain=_catch(
                lambda: model.load_state_dict({k: v.full_tensor() for k, v in sd.items()}) and None
            )[0],
        )
        new = {
            k: DTensor.from_local(
                torch.full_like(v.to_local(), 7.0),
                mesh,
                v.placements,
                shape=v.shape,
                stride=v.stride(),
            )
            for k, v in sd.items()
        }
        old = model[0].weight
        model.load_state_dict(new, assign=True)
        fp = model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        o["assign"] = dict(
            new_object=model[0].weight is not old,
            tracked=fp.sharded_param is model[0].weight,
            data=fp._sharded_param_data.tolist(),
            in_buffer=fp._sharded_param_data.untyped_storage().data_ptr()
            == model[0].weight.to_local().untyped_storage().data_ptr(),
        )
        # -- meta-device init (P10) and CPU offload (P11)
        with torch.device("meta"):
            meta_model = _mlp()
        _shard(api, meta_model, mesh)
        meta_err = _catch(lambda: meta_model(torch.ones(1, 3)) and None)
        meta_model.to_empty(device="cpu")
        fp = meta_model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        o["meta"] = (meta_err[0], "materialized" in meta_err[1], fp._sharded_param_data.numel())
        offload = _shard(api, _mlp(), mesh, offload_policy=api.CPUOffloadPolicy(pin_memory=False))
        offload(torch.ones(2, 3)).sum().backward()
        o["offload"] = (offload[0].weight.grad.to_local().tolist(), offload[0].weight.device.type)
        o["pin"] = _catch(
            lambda: _shard(api, _mlp(), mesh, offload_policy=api.CPUOffloadPolicy()) and None
        )[0]
        # -- HSDP (P16) on a (replicate=1, shard=2) and a (replicate=2, shard=1) mesh
        for shape in ((1, 2), (2, 1)):
            hsdp_mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
            model = _shard(api, _mlp(), hsdp_mesh)
            torch.manual_seed(rank)
            model(torch.randn(2, 3)).sum().backward()
            w = model[0].weight
            o[("hsdp", shape)] = (
                w.placements,
                tuple(w.to_local().shape),
                w.grad.to_local().tolist(),
            )
        # -- all-gather extensions (P14), patched onto the local tensor after fully_shard
        for nargs in (1, 5):
            model = _shard(api, _mlp(), mesh)
            local, calls = model[2].weight._local_tensor, []  # (4, 5): even at ws 2
            if nargs == 5:

                def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
                    calls.append(("pre", mesh.size(), tuple(outer_size), outer_stride))
                    return (self * 2,), "md"
            else:

                def pre(self, mesh):
                    calls.append(("pre", mesh.size()))
                    return (self * 2,), "md"

            def post(self, outputs, metadata, param_dtype, *, out=None):
                calls.append(("post", metadata, out is not None, tuple(outputs[0].shape)))
                if out is None:  # the unsharded param aliases the output: 2x the weight
                    return outputs[0], (outputs[0],)
                return None  # later unshards refill the aliased output in place

            local.fsdp_pre_all_gather = types.MethodType(pre, local)
            local.fsdp_post_all_gather = types.MethodType(post, local)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for _ in range(2):
                loss = model(torch.ones(2, 3)).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            o[("ext", nargs)] = (calls, losses)
        model = _shard(api, _mlp(), mesh)
        model[0].weight._local_tensor.fsdp_pre_all_gather = lambda mesh: None
        o["ext_one_sided"] = _catch(lambda: model(torch.ones(1, 3)) and None)[0]
    return out


def _ws4_body(rank, ws):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for impl in IMPLS:
        api = _api(impl)
        lin = nn.Linear(3, 5, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.arange(15.0).view(5, 3))
        api.fully_shard(lin, mesh=mesh)
        fp = lin._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        layout = (
            tuple(fp.sharded_size),
            tuple(fp.padded_sharded_param_size),
            fp._sharded_param_data.tolist(),
        )
        sd = lin.state_dict()
        v = sd["weight"]
        lin.load_state_dict(
            {
                "weight": DTensor.from_local(
                    v.to_local() + 1, mesh, v.placements, shape=v.shape, stride=v.stride()
                )
            },
            assign=True,
        )
        fp = lin._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        reset = fp._sharded_param_data.tolist()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 10), nn.Linear(10, 2))
        api.fully_shard(model[0], mesh=mesh, reshard_after_forward=2)
        api.fully_shard(model, mesh=mesh, reshard_after_forward=2)
        y = model(torch.ones(2, 4))
        w = model[0].weight
        fp = model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        post = (
            _state(model[0]),
            type(w).__name__,
            w.placements,
            w.device_mesh.mesh.tolist(),
            tuple(w.to_local().shape),
            tuple(fp.sharded_size),
        )
        y.sum().backward()
        after_bwd = (_state(model[0]), type(model[0].weight).__name__)
        out[impl] = dict(
            layout=layout,
            reset=reset,
            post=post,
            after_bwd=after_bwd,
            grad=model[0].weight.grad.to_local().tolist(),
        )
    return out


@pytest.fixture(scope="module")
def ws2():
    return run_on_ranks(_ws2_body, 2, timeout=600)


@pytest.fixture(scope="module")
def ws4():
    return run_on_ranks(_ws4_body, 4, timeout=600)


# ---- world size 2 -------------------------------------------------------------------------------


def test_layout_follows_chunk_rule(ws2):
    """P1: shard = torch.chunk(orig, ws)[rank], zero-padded to chunk 0's size, DTensor view."""
    import math

    import torch
    from torch.distributed.tensor import Shard

    for res in ws2:
        rank = res["rank"]
        for name, obs in res["ref"]["layout"].items():
            orig = torch.tensor(obs["original"])
            chunks = list(torch.chunk(orig, 2, dim=0))
            step = math.ceil(orig.size(0) / 2)
            chunk = chunks[rank] if rank < len(chunks) else orig.new_empty((0, *orig.shape[1:]))
            padded = (step, *orig.shape[1:])
            expected_data = torch.zeros(padded)
            expected_data[: chunk.size(0)] = chunk
            where = f"{name} on rank {rank}"
            assert obs["is_param_dtensor"] and obs["is_sharded_param"], where
            assert obs["global_size"] == tuple(orig.shape), where
            assert obs["global_stride"] == orig.stride(), where
            assert obs["placements"] == (Shard(0),), where
            assert obs["sharded_size"] == tuple(chunk.shape), where
            assert obs["padded"] == padded, where
            assert obs["data"] == expected_data.reshape(-1).tolist(), where
            assert obs["local_shape"] == tuple(chunk.shape), where
            assert torch.tensor(obs["local"]).reshape(chunk.shape).equal(chunk), where
            assert obs["shares_storage"] and obs["requires_grad"], where
        assert res["ref"]["layout"] == res["up"]["layout"], f"rank {rank}"


@pytest.mark.parametrize("raf", [True, False, None])
def test_states_after_forward_and_backward(ws2, raf):
    """P2: True → SHARDED, False → UNSHARDED, None → root keeps, others reshard; bwd → SHARDED."""
    root_state = "SHARDED" if raf is True else "UNSHARDED"
    child_state = "UNSHARDED" if raf is False else "SHARDED"
    registered = {"SHARDED": "DTensor", "UNSHARDED": "Parameter"}
    for res in ws2:
        for after_fwd, after_bwd, _ in res["ref"][("train", raf)][0]:
            assert after_fwd[0] == (root_state, registered[root_state])
            assert after_fwd[1:] == [(child_state, registered[child_state])] * 2
            assert after_bwd == ["SHARDED", "SHARDED"]
        assert res["ref"][("train", raf)][0] == res["up"][("train", raf)][0]


@pytest.mark.parametrize("raf", [True, False, None])
def test_sgd_matches_local_replica_and_upstream(ws2, raf):
    """Two SGD steps equal plain training on the mean of every rank's gradient."""
    import torch

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for r in range(2):
            torch.manual_seed(100 + 10 * step + r)
            (model(torch.randn(4, 3)).sum() / 2).backward()
        opt.step()
        opt.zero_grad()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    for res in ws2:
        for impl in IMPLS:
            full = res[impl][("train", raf)][1]
            for name, value in full.items():
                assert torch.allclose(torch.tensor(value), expected[name], atol=1e-6), (impl, name)


def test_mixed_precision_dtypes(ws2):
    """P5 clamping; forward output in output_dtype; sharded grads stay in the original dtype."""
    import torch

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    expected = {  # (param_dtype, reduce_dtype) after clamping
        (bf16, f32): (bf16, f32),
        (f32, f32): (None, None),
        (bf16, bf16): (bf16, None),
        (f16, None): (f16, None),
    }
    for res in ws2:
        for mp, clamped in expected.items():
            obs = res["ref"][("mp", mp)]
            assert obs[:2] == clamped, mp
            assert obs[2:6] == (f32, torch.float64, f32, f32), mp
            up = res["up"][("mp", mp)]
            assert obs[:6] == up[:6], mp
            assert torch.allclose(torch.tensor(obs[6]), torch.tensor(up[6]), atol=1e-6), mp


SPEC_MESSAGES = {
    "scalar": ("ValueError", "fully_shard doesn't support scalar parameters. Change scalar_p to "
               "a 1D tensor with numel equal to 1."),
    "noncontig": ("NotImplementedError", "FSDP does not support non-contiguous parameters yet: "
                  "param.shape=torch.Size([8, 8, 3, 3]) param.stride()=(72, 1, 24, 8)"),
    ("raf", 3): ("ValueError", "If passing reshard_after_forward as an int, it should be a factor "
                 "of 2, not 3"),
    ("raf", 0): ("ValueError", "If passing reshard_after_forward as an int, it should be a factor "
                 "of 2, not 0"),
    ("raf", "x"): ("ValueError", "reshard_after_forward should be a bool or an int representing "
                   "the group size to reshard to, not x"),
    "replicate": ("ValueError", "Invalid shard_placement_fn result: R"),
    "bias_dim1": ("AssertionError", "Shard dim 1 is invalid for 1D tensor: torch.Size([4])"),
    "uneven_dim1": ("NotImplementedError", "FSDP does not support uneven sharding on dim 1: "
                    "torch.Size([4, 3]) (world size: 2)"),
}  # fmt: skip


def test_errors_match_spec_and_upstream_and_leave_module_unchanged(ws2):
    for res in ws2:
        errors, up_errors = res["ref"]["errors"], res["up"]["errors"]
        for key, (kind, message) in SPEC_MESSAGES.items():
            assert errors[key][:2] == (kind, message), key
            assert errors[key][2], f"{key}: the module was changed by a failed fully_shard"
        assert errors["mesh2d"] == (
            "AssertionError",
            "Please init the 2D mesh for HSDP with mesh_dim_names specified",
        )
        assert errors["two_roots"][0] == "RuntimeError"
        assert errors["two_roots"][1].startswith("FSDP requires a single root module but got")
        assert errors["child_first"] == (
            "RuntimeError",
            "FSDP state has already been lazily initialized for 0\nFSDP requires running "
            "forward through the root module first",
        )
        assert {k: v[:2] for k, v in errors.items()} == {k: v[:2] for k, v in up_errors.items()}


def test_shard_placement_fn_negative_dim(ws2):
    """P13: Shard(-1) is normalised; Linear(4, 3).weight on 2 ranks → local (3, 2), grad too."""
    from torch.distributed.tensor import Shard

    for res in ws2:
        placement, local_shape, grad_placements = res["ref"]["shard_last"]
        assert placement == Shard(1) and tuple(local_shape) == (3, 2)
        assert grad_placements == (Shard(1),)
        assert res["ref"]["shard_last"] == res["up"]["shard_last"]


def test_state_dict_and_assign_reset(ws2):
    """P8: values are the sharded DTensors (no copy), resharded first; plain loads fail. P9."""
    for res in ws2:
        sd = res["ref"]["sd"]
        assert sd["registered_before"] == "Parameter"  # raf=False kept it unsharded
        assert sd["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight", "3.bias", "3.weight"]
        assert sd["types"] == {"DTensor"} and sd["same_ptr"]
        assert sd["state_after"] == "SHARDED" and sd["load_plain"] == "RuntimeError"
        assign = res["ref"]["assign"]
        assert assign["new_object"] and assign["tracked"] and assign["in_buffer"]
        rows = 3 - res["rank"]  # Linear(3,5).weight: 3 rows on rank 0, 2 rows + padding on 1
        assert assign["data"] == [7.0] * (3 * rows) + [0.0] * (3 * (3 - rows))
        assert (sd, assign) == (res["up"]["sd"], res["up"]["assign"])


def test_meta_init_and_cpu_offload(ws2):
    for res in ws2:
        assert res["ref"]["meta"] == ("RuntimeError", True, 9)  # padded (3, 3) after to_empty
        assert res["ref"]["offload"][1] == "cpu"
        assert res["ref"]["offload"] == res["up"]["offload"]
        assert res["ref"]["pin"] == res["up"]["pin"] == "RuntimeError"  # CPU-only build


def test_hsdp_placements_and_grads(ws2):
    """P16: (Replicate(), Shard(0)); local = chunk over the shard dim; grads as upstream."""
    from torch.distributed.tensor import Replicate, Shard

    for res in ws2:
        for shape, local in (((1, 2), (3 - res["rank"], 3)), ((2, 1), (5, 3))):
            obs = res["ref"][("hsdp", shape)]
            assert obs[:2] == ((Replicate(), Shard(0)), local), shape
            assert obs == res["up"][("hsdp", shape)], shape


def test_all_gather_extensions(ws2):
    """P14: 1- and 5-arg pre hooks get the shard mesh (and global size/stride); post hook gets
    ``out=`` from the second unshard on; training matches upstream."""
    for res in ws2:
        for nargs in (1, 5):
            calls, losses = res["ref"][("ext", nargs)]
            pre = ("pre", 2, (4, 5), (5, 1)) if nargs == 5 else ("pre", 2)
            assert calls[0] == pre and calls[1] == ("post", "md", False, (4, 5))
            assert all(c == ("post", "md", True, (4, 5)) for c in calls[3::2])
            assert (calls, losses) == res["up"][("ext", nargs)]
        assert res["ref"]["ext_one_sided"] == res["up"]["ext_one_sided"] == "AssertionError"


# ---- world size 4 -------------------------------------------------------------------------------


def test_uneven_layout_and_reset_at_world_size_4(ws4):
    """P1/P9 at ws 4: (5, 3) → chunks of 2, 2, 1, 0 rows padded to 2 rows."""
    rows = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 0, 0, 0], [0] * 6]
    sizes = [(2, 3), (2, 3), (1, 3), (0, 3)]
    for rank, res in enumerate(ws4):
        sharded, padded, data = res["ref"]["layout"]
        assert (sharded, padded, data) == (sizes[rank], (2, 3), rows[rank])
        valid = 3 * sizes[rank][0]
        assert res["ref"]["reset"] == [x + 1 for x in rows[rank][:valid]] + [0] * (6 - valid)
        assert res["ref"]["layout"] == res["up"]["layout"]
        assert res["ref"]["reset"] == res["up"]["reset"]


def test_reshard_after_forward_int(ws4):
    """P2: raf=2 at ws 4 → SHARDED_POST_FORWARD on mesh [[0,1],[2,3]], (Replicate(), Shard(0))."""
    from torch.distributed.tensor import Replicate, Shard

    sharded = [(3, 4), (3, 4), (3, 4), (1, 4)]
    for rank, res in enumerate(ws4):
        state, kind, placements, mesh, local, sharded_size = res["ref"]["post"]
        assert (state, kind) == ("SHARDED_POST_FORWARD", "DTensor")
        assert placements == (Replicate(), Shard(0)) and mesh == [[0, 1], [2, 3]]
        assert local == (5, 4) and sharded_size == sharded[rank]
        assert res["ref"]["after_bwd"] == ("SHARDED", "DTensor")
        assert res["ref"]["post"] == res["up"]["post"]
        assert res["ref"]["grad"] == res["up"]["grad"]
