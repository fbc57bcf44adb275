"""The TorchAir GE converters (ge_converters/) through real torchair (SPEC.md §7.3, §7.2).

torchair's Python layer comes from the torch-npu wheel (tests/torchair_stub: fetched, never
installed; its C++ extension replaced by a documented stub) and runs in a dedicated pair of
processes, because importing torchair patches torch process-wide. Two kinds of checks:

* each converter is called as torchair calls it (positional schema arguments, ``meta_outputs``)
  inside a ``GeGraph`` on ``Data`` inputs; the produced OpDef's type, input names/order/sources
  (absent optionals as empty inputs), attributes (value and type) and output dtypes are compared
  with SPEC.md §7.3, written out below;
* ``torch.compile(backend=torchair.get_npu_backend(...))`` with ``debug.run_eagerly`` converts the
  whole FX graph to a GE graph (dumped as text) and runs the FX graph on CPU: the result must equal
  eager, and the dumped GE graph must hold the op node wired to the graph inputs.

Without access to the package registry the tests skip, saying why.
"""
import os

import pytest
import torch
import torch.distributed as dist

import torchair_stub
from dist_harness import RankPool

BF16, FP16, F32, I8, I32, BOOL = "bfloat16", "float16", "float32", "int8", "int32", "bool"
H, I, IS, E, BS, K = 64, 32, 16, 2, 4, 2


def T(*shape, dtype):
    """A tensor argument of a case: (shape, dtype name)."""
    return ("T", tuple(shape), dtype)


# ------------------------------------------------------------------------------------------------
# worker side (runs in the torchair processes)
# ------------------------------------------------------------------------------------------------
def hccl_name(group_name, rank):
    """What the stand-in for torch_npu's HCCL backend names a group's communicator."""
    return f"hccl:{group_name}:{rank}"


def _install(root):
    torchair_stub.install(root)
    from cam_jit.ascend import hccl
    from cam_jit.ops.graph import register_ge_converters

    hccl.backend_comm_name = lambda group, rank: hccl_name(group.group_name, rank)  # no torch_npu here
    return register_ge_converters()


def _describe(op):
    """An OpDef as plain data: type, [(input name, source)], {attr: (kind, value)}, [(output, dtype)]."""
    def dtype_name(desc):
        return desc.DESCRIPTOR.fields_by_name["dtype"].enum_type.values_by_number[desc.dtype].name

    attrs = {}
    for key, value in op.attr.items():
        if key.startswith("_"):
            continue
        kind = value.WhichOneof("value")
        attrs[key] = (kind, value.s.decode() if kind == "s" else getattr(value, kind))
    return {"type": op.type, "name": op.name, "inputs": [(d.name, src) for d, src in zip(op.input_desc, op.input)],
            "attrs": attrs, "outputs": [(d.name, dtype_name(d)) for d in op.output_desc]}


def _convert(op_name, args, env=None, ge_only=None):
    """Calls the registered converter of torch.ops.cam_jit.<op_name> on Data inputs named after
    the arguments (with their meta set, as torchair sets it on graph inputs); meta outputs from
    the op's fake kernel. `ge_only` {position: value} replaces arguments on the GE side only.
    Returns the described op node."""
    if dist.get_rank() != 0:
        return None
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchair.ge._ge_graph import Data, GeGraph, default_ge_graph, torch_type_to_ge_type

    op = getattr(torch.ops.cam_jit, op_name).default
    graph, count = GeGraph(), [0]

    def ge_arg(label, a):
        if isinstance(a, list):
            return [ge_arg(f"{label}_{i}", x) for i, x in enumerate(a)]
        if isinstance(a, tuple) and a[0] == "T":
            count[0] += 1
            data = Data(index=count[0] - 1, dtype=torch_type_to_ge_type(getattr(torch, a[2])), shape=list(a[1]),
                        placement="NPU", node_name=label)
            with FakeTensorMode():
                data.set_meta(fake_arg(a))
            return data
        return a

    def fake_arg(a):
        if isinstance(a, list):
            return [fake_arg(x) for x in a]
        if isinstance(a, tuple) and a[0] == "T":
            return torch.empty(a[1], dtype=getattr(torch, a[2]))
        return a

    names = [arg.name for arg in op._schema.arguments]
    with FakeTensorMode():
        meta = op(*[fake_arg(a) for a in args])
    ge_args = {**dict(enumerate(args)), **(ge_only or {})}
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with default_ge_graph(graph):
            op._ge_converter(*[ge_arg(names[i], a) for i, a in sorted(ge_args.items())], meta_outputs=meta)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    nodes = [o for o in graph._proto.op if o.type != "Data"]
    assert len(nodes) == 1, [o.type for o in nodes]
    return _describe(nodes[0])


def _converter_error(op_name, args, env=None, ge_only=None):
    try:
        _convert(op_name, args, env, ge_only)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _compile_and_dump(model_name, dump_dir):
    """torch.compile(model, backend=torchair npu backend, run_eagerly, GE graph dumped as text).
    Returns (compiled result == eager result, described non-Data nodes, Data name -> input index)."""
    import torchair
    from google.protobuf import text_format
    from torchair._ge_concrete_graph.ge_ir_pb2 import GraphDef
    from torchair.configs.compiler_config import CompilerConfig

    model, inputs = MODELS[model_name]()
    directory = os.path.join(dump_dir, f"{model_name}_rank{dist.get_rank()}")
    os.makedirs(directory, exist_ok=True)
    config = CompilerConfig()
    config.debug.run_eagerly = True
    config.debug.graph_dump.type = "txt"
    config.debug.graph_dump.path = directory
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(*inputs)
        got = torch.compile(model, backend=torchair.get_npu_backend(compiler_config=config), fullgraph=True)(*inputs)
    same = all(torch.equal(a, b) for a, b in zip(want, got))
    (dump,) = [f for f in os.listdir(directory) if f.endswith(".txt")]
    with open(os.path.join(directory, dump)) as f:
        graph = text_format.Parse(f.read(), GraphDef())
    data = {o.name: o.attr["index"].i for o in graph.op if o.type == "Data"}
    return same, [_describe(o) for o in graph.op if o.type not in ("Data", "NetOutput")], data


def _fdm_model():
    import cam_jit

    g = torch.Generator().manual_seed(3)
    x = torch.randn(BS, H, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 0], [1, 0], [0, 1]], dtype=torch.int32)
    scales = torch.rand(BS, K, generator=g)
    w1 = torch.randint(-127, 128, (E, H, 2 * I), dtype=torch.int8, generator=g)
    w2 = torch.randint(-127, 128, (E, I, H), dtype=torch.int8, generator=g)
    s1, s2 = torch.rand(E, 2 * I, generator=g) * 2e-3, torch.rand(E, H, generator=g) * 2e-3

    def model(x, ids, scales, w1, s1, w2, s2):
        out, share, nums = cam_jit.fused_deep_moe(x, ids, w1, s1, w2, s2, scales, group_ep="", ep_rank_size=1,
                                                  ep_rank_id=0, moe_expert_num=E)
        return out + share, nums

    return model, (x, ids, scales, w1, s1, w2, s2)


def _a2e_e2a_model():
    from cam_jit.ops.a2e_e2a import a2e, e2a

    rank = dist.get_rank()
    x = (torch.arange(BS * H, dtype=torch.float32).view(BS, H) / 7 + rank).to(torch.bfloat16)

    def model(x):
        out = a2e(x, None, None, BS, H, K, 1, 1, rank, "", 8, 0)
        back = e2a(out[0] if rank == 0 else x, out[3], BS, H, K, 1, 1, rank, "", 8)
        return back, out[0]

    return model, (x,)


def _lowlatency_model():
    from cam_jit.ops.moe_lowlatency import moe_dispatch_lowlatency

    x = torch.randn(BS, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 1]] * BS, dtype=torch.int32)

    def model(x, ids):
        return moe_dispatch_lowlatency(x, ids, group_ep="", ep_rank_size=1, ep_rank_id=0, moe_expert_num=E)

    return model, (x, ids)


MODELS = {"fused_deep_moe": _fdm_model, "a2e_e2a": _a2e_e2a_model, "moe_lowlatency": _lowlatency_model}


def _compile_error(model_name, dump_dir):
    try:
        _compile_and_dump(model_name, dump_dir)
    except Exception as e:  # noqa: BLE001 - torch.compile wraps the converter's error
        return str(e)
    return None


# ------------------------------------------------------------------------------------------------
# test side
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def air_pool():
    root = torchair_stub.torchair_root()
    pool = RankPool(2, timeout=300)
    try:
        registered = pool.run(_install, str(root))
        assert registered[0] == ["cam_jit::fused_deep_moe", "cam_jit::a2e", "cam_jit::e2a"]
        yield pool
    finally:
        pool.close()


def _fdm_args(w4a8=False, shared=True, experts_as_list=True):
    """fused_deep_moe arguments in schema order; per-expert lists (dynamic inputs of 2)."""
    wd, pack = (I32, 8) if w4a8 else (I8, 1)
    per = (lambda *shape, dtype: [T(*shape, dtype=dtype) for _ in range(E)]) if experts_as_list else \
        (lambda *shape, dtype: [T(E, *shape, dtype=dtype)])
    opt = (lambda t: t) if shared else (lambda t: None)
    return [
        T(BS, H, dtype=BF16), T(BS, K, dtype=I32),
        per(H, 2 * I // pack, dtype=wd), per(2 * I, dtype=F32), per(I, H // pack, dtype=wd), per(H, dtype=F32),
        T(BS, K, dtype=F32),
        opt(T(H, 2 * IS // pack, dtype=wd)), opt(T(2 * IS, dtype=F32)), opt(T(IS, H // pack, dtype=wd)),
        opt(T(H, dtype=F32)),
        T(E, H, dtype=F32), opt(T(H, dtype=F32)), T(BS, dtype=BOOL),
        per(2 * I, dtype=F32) if w4a8 else [], per(H, dtype=F32) if w4a8 else [],
        opt(T(2 * IS, dtype=F32)) if w4a8 else None, opt(T(H, dtype=F32)) if w4a8 else None,
        "hccl_ep_group", 1, 0, E, 0, 8,
    ]


# SPEC.md §7.3 FusedDeepMoe: the 14 inputs in order (list inputs dynamic: <name><i>)
FDM_INPUTS = ["x", "expert_ids", "gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale",
              "expert_scales", "share_gmm1_weight", "share_gmm1_weight_scale", "share_gmm2_weight",
              "share_gmm2_weight_scale", "expert_smooth_scales", "share_smooth_scales", "x_active_mask"]
W4A8_INPUTS = ["gmm1_bias_optional", "gmm2_bias_optional", "share_gmm1_bias_optional", "share_gmm2_bias_optional"]
DYNAMIC = {"gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale", "gmm1_bias_optional",
           "gmm2_bias_optional"}
FDM_ATTRS = {"group_ep": ("s", "hccl_ep_group"), "ep_rank_size": ("i", 1), "ep_rank_id": ("i", 0),
             "moe_expert_num": ("i", E), "quant_mode": ("i", 0), "global_bs": ("i", 8)}
FDM_OUTPUTS = [("output", "DT_BF16"), ("share_output", "DT_BF16"), ("expert_token_nums", "DT_INT64")]


def _expected_inputs(names, present):
    """[(input name, source)]: Data nodes are named after the schema argument (list item i:
    <arg>_<i>); absent optionals are empty sources."""
    out = []
    for name in names:
        arg = name[:-len("_optional")] if name.endswith("_optional") else name
        if name in DYNAMIC:
            out += [(f"{name}{i}", f"{arg}_{i}:0") for i in range(present.get(name, E))]
        else:
            out.append((name, f"{arg}:0" if present.get(name, 1) else ""))
    return out


def test_fused_deep_moe_w8a8_is_the_base_prototype(air_pool):
    got = air_pool.run(_convert, "fused_deep_moe", _fdm_args())[0]
    assert got["type"] == "FusedDeepMoe"
    assert got["inputs"] == _expected_inputs(FDM_INPUTS, {})
    assert got["attrs"] == {**FDM_ATTRS, "ext_info": ("i", 0), "shmem_workspace": ("i", 0),
                            "shmem_workspace_size": ("i", 0)}
    assert got["outputs"] == FDM_OUTPUTS


def test_fused_deep_moe_absent_optionals_are_empty_inputs(air_pool):
    got = air_pool.run(_convert, "fused_deep_moe", _fdm_args(shared=False, experts_as_list=False))[0]
    absent = {n: 0 for n in FDM_INPUTS[7:11] + ["share_smooth_scales"]}
    assert got["inputs"] == _expected_inputs(FDM_INPUTS, {**absent, **{n: 1 for n in DYNAMIC}})
    assert got["inputs"][7:11] == [(n, "") for n in FDM_INPUTS[7:11]]


def test_fused_deep_moe_w4a8_prototype(air_pool):
    got = air_pool.run(_convert, "fused_deep_moe", _fdm_args(w4a8=True))[0]
    assert got["type"] == "FusedDeepMoe"
    assert got["inputs"] == _expected_inputs(FDM_INPUTS + W4A8_INPUTS, {})
    assert got["attrs"] == FDM_ATTRS
    assert got["outputs"] == FDM_OUTPUTS


def test_fused_deep_moe_master_prototype_by_env(air_pool):
    got = air_pool.run(_convert, "fused_deep_moe", _fdm_args(), {"CAM_JIT_FDM_ABI": "master"})[0]
    assert got["inputs"] == _expected_inputs(FDM_INPUTS, {})
    assert got["attrs"] == FDM_ATTRS


def test_fused_deep_moe_weights_must_fit_the_installed_prototype(air_pool):
    error = air_pool.run(_converter_error, "fused_deep_moe", _fdm_args(), {"CAM_JIT_FDM_ABI": "w4a8"})[0]
    assert error.startswith("TypeError: fused_deep_moe: argument 'gmm1_weight'") and "'w4a8'" in error


A2E_ATTRS = {"batch_size": ("i", 6), "hidden_size": ("i", H), "topk": ("i", K), "expert_rank_size": ("i", 1),
             "attention_rank_size": ("i", 2), "rank": ("i", 0), "group_ep": ("s", "hccl_afd"),
             "aiv_num": ("i", 24), "compute_gate": ("i", 1)}


def test_a2e(air_pool):
    args = [T(1, H, dtype=BF16), T(1, K, dtype=I32), None, 6, H, K, 1, 2, 0, "hccl_afd", 24, 1]
    got = air_pool.run(_convert, "a2e", args)[0]
    assert got["type"] == "A2e"
    assert got["inputs"] == [("x", "x:0"), ("expert_ids", "expert_ids:0"), ("scales", "")]
    assert got["attrs"] == A2E_ATTRS
    assert got["outputs"] == [("expand_x", "DT_BF16"), ("simulate_expert_ids", "DT_INT32"),
                              ("simulate_expert_scales", "DT_FLOAT"), ("atten_batch_size", "DT_INT32"),
                              ("x_active_mask", "DT_BOOL")]


def test_e2a(air_pool):
    args = [T(3, H, dtype=FP16), T(2, dtype=I32), 6, H, K, 1, 2, 2, "hccl_afd", 24]
    got = air_pool.run(_convert, "e2a", args)[0]
    assert got["type"] == "E2a"
    assert got["inputs"] == [("expand_x", "expand_x:0"), ("atten_batch_size", "atten_batch_size:0")]
    attrs = {k: v for k, v in A2E_ATTRS.items() if k != "compute_gate"}
    # attention rank: batch_size is expand_x's row count, as UMDK's e2a binding passes it
    assert got["attrs"] == {**attrs, "rank": ("i", 2), "batch_size": ("i", 3)}
    assert got["outputs"] == [("x", "DT_BF16")]  # the wrapper's forced bf16 (SPEC §2.3)


def test_a2e_on_an_attention_rank_passes_x_rows_as_the_batch(air_pool):
    """UMDK cam_feature src/cam/comm_operator/pybind/a2e.cpp, A2eImplNpu: on a rank >=
    expertRankSize the batch attribute is x.size(0) (the kernel copies batch * H elements of x)."""
    args = [T(3, H, dtype=BF16), T(3, K, dtype=I32), T(3, K, dtype=F32), 6, H, K, 1, 2, 2, "hccl_afd", 24, 1]
    got = air_pool.run(_convert, "a2e", args)[0]
    assert got["attrs"] == {**A2E_ATTRS, "rank": ("i", 2), "batch_size": ("i", 3)}


def _world_group_name():
    return dist.group.WORLD.group_name


def test_group_names_become_hccl_communicator_names(air_pool):
    """UMDK cam_feature src/cam/examples/a2e_e2a_sample.py (main) passes
    group._get_backend(torch.device("npu")).get_hccl_comm_name(rank) as group_ep; the converters
    resolve a torch group name ("" = the default group) to that name at trace time."""
    world = air_pool.run(_world_group_name)[0]
    for given in ("", world):
        args = [T(3, H, dtype=FP16), T(2, dtype=I32), 6, H, K, 1, 1, 1, given, 24]
        got = air_pool.run(_convert, "e2a", args)[0]
        assert got["attrs"]["group_ep"] == ("s", hccl_name(world, 0))


def test_attributes_must_be_graph_constants(air_pool):
    args = [T(6, H, dtype=BF16), T(2, dtype=I32), 6, H, K, 1, 2, 0, "hccl_afd", 24]
    # a dynamic-shape int reaches the converter as a graph tensor (on an expert rank, which uses it)
    error = air_pool.run(_converter_error, "e2a", args, None, {2: T(1, dtype=I32)})
    assert error[0].startswith("TypeError: e2a: argument 'batch_size': expected a graph attribute")


def test_compiled_fused_deep_moe_builds_the_ge_node(air_pool, tmp_path):
    dist_world_name = air_pool.run(_world_group_name)[0]
    for rank, (same, nodes, data) in enumerate(air_pool.run(_compile_and_dump, "fused_deep_moe", str(tmp_path))):
        assert same
        (fdm,) = [n for n in nodes if n["type"] == "FusedDeepMoe"]
        index = {name: data[src.split(":")[0]] for name, src in fdm["inputs"] if src}
        # graph inputs of the model: x, ids, scales, w1, s1, w2, s2
        assert index == {"x": 0, "expert_ids": 1, "gmm1_weight0": 3, "gmm1_weight_scale0": 4,
                         "gmm2_weight0": 5, "gmm2_weight_scale0": 6, "expert_scales": 2}
        assert [src for _, src in fdm["inputs"][7:]] == [""] * 7
        assert fdm["attrs"]["group_ep"] == ("s", hccl_name(dist_world_name, rank))
        assert fdm["attrs"]["moe_expert_num"] == ("i", E)
        assert fdm["outputs"] == FDM_OUTPUTS


def test_compiled_a2e_e2a_builds_the_ge_nodes(air_pool, tmp_path):
    for rank, (same, nodes, data) in enumerate(air_pool.run(_compile_and_dump, "a2e_e2a", str(tmp_path))):
        assert same
        (a2e,) = [n for n in nodes if n["type"] == "A2e"]
        (e2a,) = [n for n in nodes if n["type"] == "E2a"]
        assert a2e["inputs"] == [("x", f"{_data_name(data, 0)}:0"), ("expert_ids", ""), ("scales", "")]
        a2e_node = a2e["name"]
        expand = f"{a2e_node}:0" if rank == 0 else f"{_data_name(data, 0)}:0"
        assert e2a["inputs"] == [("expand_x", expand), ("atten_batch_size", f"{a2e_node}:3")]
        assert a2e["attrs"]["rank"] == ("i", rank) and e2a["attrs"]["rank"] == ("i", rank)


def _data_name(data, index):
    (name,) = [n for n, i in data.items() if i == index]
    return name


def test_fused_deep_moe_w8a8_refuses_biases(air_pool):
    error = air_pool.run(_converter_error, "fused_deep_moe", _fdm_args(), None, {17: T(H, dtype=F32)})[0]
    assert error.startswith("ValueError: fused_deep_moe: argument 'share_gmm2_bias': expected empty/None")


def test_ops_without_converter_say_why_in_torchair(air_pool, tmp_path):
    error = air_pool.run(_compile_error, "moe_lowlatency", str(tmp_path))[0]
    assert "NotImplementedError: cam_jit::moe_dispatch_lowlatency has no TorchAir GE converter: no GE op of " \
           "matching semantics" in error
