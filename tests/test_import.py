"""`import cam_jit` stays cheap: it defines every op (with its fake, CPU, PrivateUse1 and
inference-only autograd kernels) but imports the zero buffer, the reference and the Ascend
discovery/build modules only when they are first used. Checked in fresh processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys
import cam_jit
from cam_jit.ops import _registry
loaded = sorted(m for m in sys.modules if m.startswith("cam_jit"))
import torch
ops = {info.name: [key for key in ("CPU", "Meta", "PrivateUse1", "Autograd")
                   if torch._C._dispatch_has_kernel_for_dispatch_key(info.qualname, key)]
       for info in _registry.OPS}
lazy = {}
for name in sys.argv[1:]:
    lazy[name] = type(getattr(cam_jit, name)).__name__
from cam_jit import jit
print(json.dumps({"loaded": loaded, "ops": ops, "lazy": lazy, "backends": sorted(jit.BACKENDS),
                  "after": sorted(m for m in sys.modules if m.startswith("cam_jit"))}))
"""


def probe(*attributes):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", PROBE, *attributes], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_defines_every_op_and_defers_the_rest():
    result = probe()
    loaded = result["loaded"]
    for lazy in ("cam_jit.zero_buffer", "cam_jit.reference", "cam_jit.ascend.build", "cam_jit.ascend.discover",
                 "cam_jit.ascend.opp", "cam_jit.ascend.registry", "cam_jit.ops.fused_deep_moe_strict"):
        assert lazy not in loaded, (lazy, loaded)
    assert "cam_jit.ascend.npu_ops" in loaded  # registers the PrivateUse1 kernels
    assert len(result["ops"]) >= 9
    for name, keys in result["ops"].items():
        assert "Autograd" in keys and "Meta" in keys, (name, keys)
    for name in ("fused_deep_moe", "a2e", "e2a", "all2_all_detour", "reduce_scatter_detour"):
        assert "CPU" in result["ops"][name] and "PrivateUse1" in result["ops"][name], result["ops"][name]
    assert "cpu_zb" in result["backends"]  # the zero buffer's backend is known before its import


def test_lazy_attributes_import_on_first_access():
    result = probe("FusedDeepMoeBuffer", "zero_buffer", "reference", "ascend")
    assert result["lazy"] == {"FusedDeepMoeBuffer": "type", "zero_buffer": "module", "reference": "module",
                              "ascend": "module"}
    assert {"cam_jit.zero_buffer", "cam_jit.reference"} <= set(result["after"])


def test_unknown_attribute_still_raises():
    import cam_jit

    with pytest.raises(AttributeError, match="no_such_thing"):
        cam_jit.no_such_thing
    assert {"FusedDeepMoeBuffer", "zero_buffer", "reference", "ascend", "nn"} <= set(dir(cam_jit))
