"""Discovery of the Ascend stack on fake install trees (CANN, opp vendors and their priorities,
SHMEM, torch_npu), the FusedDeepMoe prototype detection, the per-op verdicts and ``doctor``, and
the operator registry against SPEC.md §7.4 (typed in here, not read from the registry)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from cam_jit.__main__ import main
from cam_jit.ascend import discover, npu_ops, opp, registry, report
from cam_jit.ascend.build import wrappers_dir

NO_TORCH_NPU = pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None,
                                  reason="torch_npu is installed here")
ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH", "ASCEND_CUSTOM_OPP_PATH",
            "SHMEM_HOME_PATH", "CAM_JIT_NPU_SOC", "CAM_JIT_FDM_ABI")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(discover, "DEFAULT_CANN_ROOTS", ())


def make_vendor(path: Path, ops: dict, symbols=(), soc="ascend910_93") -> Path:
    """A fake vendor: op-info JSON ``ops`` (GE op -> entry) and a 'library' holding ``symbols``."""
    lib = path / "op_api" / "lib" / "libcust_opapi.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF fake\0" + b"".join(s.encode() + b"\0" for s in symbols))
    info = path / "op_impl" / "ai_core" / "tbe" / "config" / soc / f"aic-{soc}-ops-info.json"
    info.parent.mkdir(parents=True)
    info.write_text(json.dumps(ops))
    return path


def fdm_entry(inputs, attrs):
    entry = {f"input{i}": {"name": n, "dtype": "int8"} for i, n in enumerate(inputs)}
    entry["attr"] = {"list": ",".join(attrs)}
    return entry


BASE_INPUTS = ["x", "expert_ids", "gmm1_weight", "gmm1_weight_scale", "gmm2_weight",
               "gmm2_weight_scale", "expert_scales"]
BASE_ATTRS = ["group_ep", "ep_rank_size", "ep_rank_id", "moe_expert_num", "quant_mode", "global_bs"]


def make_cann(root: Path, version_file="version.info", version="8.2.RC1") -> Path:
    (root / "lib64").mkdir(parents=True)
    (root / "set_env.sh").write_text("# fake\n")
    path = root / version_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"Version={version}\n")
    (root / "lib64" / "libopapi.so").write_bytes(b"aclnnAddGetWorkspaceSize\0")
    (root / "opp" / "vendors").mkdir(parents=True)
    return root


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """CANN with vendors 'vlow', 'vhigh' (load_priority=vhigh,vlow,ghost), an unlisted 'stray',
    and two custom vendors in ASCEND_CUSTOM_OPP_PATH (one missing)."""
    cann = make_cann(tmp_path / "cann")
    vendors = cann / "opp" / "vendors"
    (vendors / "config.ini").write_text("# comment\nload_priority=vhigh,vlow,ghost\n")
    make_vendor(vendors / "vhigh", {"A2e": {"input0": {"name": "x"}}}, ["aclnnA2eGetWorkspaceSize"])
    make_vendor(vendors / "vlow", {"E2a": {}, "A2e": {}},
                ["aclnnE2aGetWorkspaceSize", "aclnnA2eGetWorkspaceSize"])
    make_vendor(vendors / "stray", {"E2a": {}}, ["aclnnE2aGetWorkspaceSize"])
    custom = make_vendor(tmp_path / "custom" / "cam",
                         {"FusedDeepMoe": fdm_entry(BASE_INPUTS, BASE_ATTRS + ["ext_info"]),
                          "All2AllDetour": {}, "ReduceScatterDetour": {}},
                         ["aclnnFusedDeepMoeGetWorkspaceSize", "aclnnAll2AllDetourGetWorkspaceSize",
                          "aclnnReduceScatterDetourGetWorkspaceSize"])
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
    monkeypatch.setenv("ASCEND_CUSTOM_OPP_PATH", f"{custom}:{tmp_path / 'missing'}")
    return tmp_path


def test_cann_from_each_source(tmp_path, monkeypatch):
    assert discover.find_cann().home is None
    assert "ASCEND_HOME_PATH" in discover.find_cann().problem
    toolkit = make_cann(tmp_path / "toolkit", "x86_64-linux/ascend_toolkit_install.info", "8.0.RC3")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(toolkit))
    cann = discover.find_cann()
    assert (cann.home, cann.source, cann.version) == (toolkit, "ASCEND_TOOLKIT_HOME", "8.0.RC3")
    assert cann.opp == toolkit / "opp" and cann.opapi == toolkit / "lib64" / "libopapi.so"
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "nothing"))
    cann = discover.find_cann()
    assert cann.home is None and f"ASCEND_HOME_PATH={tmp_path / 'nothing'} is not a CANN install" in cann.problem
    monkeypatch.delenv("ASCEND_HOME_PATH")
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME")
    default = make_cann(tmp_path / "default", "compiler/version.info", "7.0.0")
    cann = discover.find_cann(default_roots=(tmp_path / "absent", default))
    assert cann.home == default and cann.version == "7.0.0" and "default location" in cann.source
    (default / "compiler" / "version.info").unlink()
    cann = discover.find_cann(default_roots=(default,))
    assert cann.version is None and "no readable version file" in cann.problem
    monkeypatch.setenv("ASCEND_OPP_PATH", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    assert discover.find_cann(default_roots=(default,)).opp == tmp_path / "elsewhere"


def test_vendor_search_order(tree):
    cann = discover.find_cann()
    vendors = opp.find_vendors(cann)
    assert [v.name for v in vendors.searched] == ["cam", "vhigh", "vlow"]
    assert vendors.searched[0].source == "ASCEND_CUSTOM_OPP_PATH[0]"
    assert vendors.searched[1].source == "vendors/config.ini load_priority[0]"
    skipped = " | ".join(vendors.skipped)
    assert "ASCEND_CUSTOM_OPP_PATH[1]" in skipped and "'ghost'" in skipped
    assert "stray is not in load_priority" in skipped
    libs = opp.library_search_order(vendors, cann)
    assert libs == [v.opapi for v in vendors.searched] + [cann.opapi]
    # the first vendor in order that has the op and its symbol provides it
    a2e = opp.find_provider(registry.op("a2e"), vendors, cann)
    assert a2e.vendor.name == "vhigh"
    assert opp.find_provider(registry.op("e2a"), vendors, cann).vendor.name == "vlow"
    assert opp.find_provider(registry.op("moe_dispatch_layout_zb"), vendors, cann) is None


def test_load_priority_parsing(tmp_path):
    ini = tmp_path / "config.ini"
    ini.write_text("[x]\nload_priority = a , b,,c\nother=1\n")
    assert opp.load_priority(ini) == ["a", "b", "c"]
    assert opp.load_priority(tmp_path / "absent.ini") == []


@pytest.mark.parametrize("inputs, attrs, abi", [
    (BASE_INPUTS + ["gmm1_bias_optional", "gmm2_bias_optional"], BASE_ATTRS, "w4a8"),
    (BASE_INPUTS, BASE_ATTRS + ["ext_info", "shmem_workspace"], "base"),
    (BASE_INPUTS, BASE_ATTRS, "master"),
])
def test_fdm_abi_detection(tmp_path, monkeypatch, inputs, attrs, abi):
    make_vendor(tmp_path / "v", {"FusedDeepMoe": fdm_entry(inputs, attrs)})
    monkeypatch.setenv("ASCEND_CUSTOM_OPP_PATH", str(tmp_path / "v"))
    choice = opp.detect_fdm_abi(opp.find_vendors(None))
    assert choice.abi == abi and "op-info JSON of vendor v" in choice.how
    monkeypatch.setenv("CAM_JIT_FDM_ABI", "master" if abi != "master" else "base")
    assert opp.detect_fdm_abi(opp.find_vendors(None)).abi == ("master" if abi != "master" else "base")
    monkeypatch.setenv("CAM_JIT_FDM_ABI", "w8a8")
    with pytest.raises(ValueError, match="CAM_JIT_FDM_ABI: expected one of base, w4a8, master, got 'w8a8'"):
        opp.detect_fdm_abi(opp.find_vendors(None))


def test_fdm_abi_unknown_without_op_info(tmp_path):
    choice = opp.detect_fdm_abi(opp.find_vendors(None))
    assert choice.abi is None and "CAM_JIT_FDM_ABI" in choice.how


def test_shmem(tmp_path, monkeypatch):
    assert "SHMEM_HOME_PATH is not set" in discover.find_shmem().problem
    monkeypatch.setenv("SHMEM_HOME_PATH", str(tmp_path / "shmem"))
    assert "is not a directory" in discover.find_shmem().problem
    (tmp_path / "shmem" / "shmem" / "lib").mkdir(parents=True)
    assert "no libshmem" in discover.find_shmem().problem
    lib = tmp_path / "shmem" / "shmem" / "lib" / "libshmem.so"
    lib.write_bytes(b"")
    assert discover.find_shmem() == discover.Shmem(tmp_path / "shmem", lib, None)


def test_soc_names(monkeypatch):
    assert discover.soc_family("Ascend910_9391") == "ascend910_93"
    assert discover.soc_family("Ascend910B3") == "ascend910b"
    assert discover.soc_family("Ascend310P3") == "ascend310p"
    soc = discover.find_soc(runtime=False)
    assert soc.name is None and "CAM_JIT_NPU_SOC is not set" in soc.source
    monkeypatch.setenv("CAM_JIT_NPU_SOC", "Ascend910B4")
    assert discover.find_soc(runtime=False).name == "ascend910b"


@NO_TORCH_NPU
def test_torch_npu_found_without_importing_it(tmp_path, monkeypatch):
    assert discover.find_torch_npu().root is None
    assert "pip install torch-npu==" in discover.find_torch_npu().problem
    package = tmp_path / "site" / "torch_npu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (package / "version.py").write_text("__version__ = '2.1.0.post3'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    found = discover.find_torch_npu()
    assert found.root == package and found.version == "2.1.0.post3"
    assert f"built for torch 2.1.*, but torch is {torch.__version__}" in found.problem


def verdicts(stack):
    return {name: report.verdict(entry, stack) for name, entry in registry.ops().items()}


def test_verdicts(tree, monkeypatch):
    monkeypatch.setenv("CAM_JIT_NPU_SOC", "ascend910_93")
    monkeypatch.setattr(report.discover, "find_torch_npu",
                        lambda: discover.TorchNpu(None, None, "torch_npu is not importable"))
    stack = report.discover_stack(runtime_soc=False)
    assert stack.fdm.abi == "base"
    v = verdicts(stack)
    assert v["a2e"].stack == ["torch_npu not importable"]  # no torch_npu on this machine
    assert v["a2e"].problems == [] and v["a2e"].provider.vendor.name == "vhigh"
    assert v["all_to_all_detour"].problems == []
    assert v["reduce_scatter_detour"].problems[0][0].startswith("not configured for ascend910_93")
    assert [w for w, _ in v["fused_deep_moe"].problems] == ["needs SHMEM, not found"]
    assert "the installed FusedDeepMoe is the base variant" in v["fused_deep_moe_w4a8"].problems[0][0]
    assert any("no installed package provides aclnnDispatchLayoutZeroBuffer" in w
               for w, _ in v["moe_dispatch_layout_zb"].problems)
    shmem = tree / "shmem"
    (shmem / "lib").mkdir(parents=True)
    (shmem / "lib" / "libshmem.so").write_bytes(b"")
    monkeypatch.setenv("SHMEM_HOME_PATH", str(shmem))
    v = verdicts(report.discover_stack(runtime_soc=False))
    assert v["fused_deep_moe"].problems == [] and v["fused_deep_moe"].provider.vendor.name == "cam"
    monkeypatch.setenv("CAM_JIT_NPU_SOC", "ascend910b")
    v = verdicts(report.discover_stack(runtime_soc=False))
    assert v["reduce_scatter_detour"].problems == [] and v["a2e"].problems
    monkeypatch.setattr(report.discover, "find_torch_npu",
                        lambda: discover.TorchNpu(Path("/x/torch_npu"), torch.__version__))
    v = verdicts(report.discover_stack(runtime_soc=False))
    assert v["reduce_scatter_detour"].ready and not v["a2e"].ready


def test_doctor_on_a_fake_tree(tree, monkeypatch, capsys):
    monkeypatch.setenv("CAM_JIT_NPU_SOC", "ascend910_93")
    monkeypatch.setattr(report.discover, "find_torch_npu",
                        lambda: discover.TorchNpu(Path("/x/torch_npu"), torch.__version__))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for expected in ("CANN       8.2.RC1 at", "FDM ABI    base (op-info JSON of vendor cam",
                     "a2e                         ready (aclnnA2e from vhigh)",
                     "fused_deep_moe              not ready: needs SHMEM, not found",
                     f"search     {tree / 'custom' / 'cam'}", "stray is not in load_priority"):
        assert expected in out, (expected, out)
    assert "BLOCKED" not in out and "no NPU operator can run here" not in out


@NO_TORCH_NPU
def test_doctor_here_says_there_is_no_npu(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "BLOCKED    torch_npu not importable, CANN not found, no NPU visible" in out
    assert "no NPU operator can run here" in out and "On this machine the ops run on CPU" in out
    assert "npu    unavailable: torch_npu is not importable" in out


SPEC_910_93 = {"a2e", "all_to_all_detour", "e2a", "fused_deep_moe", "fused_deep_moe_fwk",
               "fused_deep_moe_w4a8", "moe_combine_lowlatency_zb", "moe_combine_normal_zb",
               "moe_dispatch_layout_zb", "moe_dispatch_lowlatency_zb", "moe_dispatch_normal_zb",
               "moe_notify_dispatch_zb", "reduce_scatter_detour"}  # SPEC.md §7.4


def test_registry_matches_spec_7_4():
    ops = registry.ops()
    listed = {n for n, e in ops.items() if "ascend910_93" in e.listed_socs and e.variant != "master"}
    assert listed == SPEC_910_93
    shmem = {n for n, e in ops.items() if e.requires_shmem}
    assert shmem == {"fused_deep_moe"} | {n for n in SPEC_910_93 if n.endswith("_zb")}
    assert ops["reduce_scatter_detour"].socs == ("ascend910b",)  # SPEC §7.3: OpDef 910b only
    for name, entry in ops.items():
        for other in entry.exclusive_with:
            assert name in ops[other].exclusive_with, (name, other)  # symmetric
    fdm = registry.fdm_abi()
    assert set(fdm.codes) == set(fdm.variant_ops) == {"base", "w4a8", "master"}
    assert {ops[n].variant for n in fdm.variant_ops.values()} == set(fdm.codes)
    assert registry.op("a2e").workspace_symbol == "aclnnA2eGetWorkspaceSize"
    with pytest.raises(KeyError, match="'nope' is not in the Ascend operator registry"):
        registry.op("nope")


def test_every_registry_wrapper_exists():
    for name in registry.wrapper_files():
        assert (wrappers_dir() / name).is_file(), name


def test_privateuse1_kernels_are_registered():
    import cam_jit.ops.a2e_e2a  # noqa: F401  (defines the schemas)
    import cam_jit.ops.detour  # noqa: F401

    names = npu_ops.register()
    assert set(names) == set(registry.torch_ops())
    for name in names:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cam_jit::{name}", "PrivateUse1")
    assert npu_ops.register() == names  # idempotent
