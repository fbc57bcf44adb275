"""What a newcomer does first, exactly as the README shows it: its snippets run as written (also in
strict mode), `cam_jit.reference` is reachable from `import cam_jit`, and the errors a first
multi-rank attempt or a malformed weight produces name the right argument and the fix."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cam_jit
from dist_harness import free_port

REPO = Path(__file__).resolve().parent.parent


def _readme_block(section: str, index: int = 0) -> str:
    """The index-th ```python block under the README heading `section`."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)[index]


@pytest.fixture(scope="module")
def using_it():
    """The variables of the README's "Using it" snippet, after running it."""
    scope = {}
    with torch.no_grad():
        exec(_readme_block("Using it"), scope)
    return scope


def test_reference_is_an_attribute_of_the_package():
    code = "import cam_jit; print(cam_jit.reference.fused_deep_moe.__module__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "cam_jit.reference.fused_deep_moe"
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        cam_jit.no_such_thing


def test_readme_single_rank_snippet_passes_strict_mode(using_it, monkeypatch):
    monkeypatch.setenv("CAM_JIT_STRICT", "1")
    s = using_it
    with torch.no_grad():
        strict = cam_jit.fused_deep_moe(s["x"], s["expert_ids"].int(), s["w1"], s["s1"], s["w2"], s["s2"],
                                        s["expert_scales"], group_ep="", ep_rank_size=1, ep_rank_id=0,
                                        moe_expert_num=s["E"])
    assert all(torch.equal(a, b) for a, b in zip(strict, (s["output"], s["share_output"], s["expert_token_nums"])))


def test_readme_buffer_snippet_reuses_the_using_it_variables(using_it):
    scope = dict(using_it, rank=0, num_ranks=1, port=free_port())
    with torch.no_grad():
        exec(_readme_block("Zero-copy buffer (`FusedDeepMoeBuffer`)"), scope)
    got = (scope["output"], scope["share_output"], scope["expert_token_nums"])
    assert all(torch.equal(a, b) for a, b in zip(got, (using_it["output"], using_it["share_output"],
                                                      using_it["expert_token_nums"])))


def test_buffer_errors_name_the_buffer_method(using_it):
    s = using_it
    with cam_jit.FusedDeepMoeBuffer() as buf:
        buf.init(0, 1, 64 << 20, f"tcp://127.0.0.1:{free_port()}")
        with pytest.raises(TypeError) as info:
            buf.zb_fused_deep_moe(s["x"], s["expert_ids"], s["w1"], s["s1"], s["w2"], s["s2"], s["expert_scales"],
                                  None, None, None, None, None, None, None, "", 1, 0, s["E"], 0, 0)
    assert str(info.value).startswith("FusedDeepMoeBuffer.zb_fused_deep_moe: argument 'expert_ids'"), info.value
    assert "int32" in str(info.value) and "int64" in str(info.value)


def test_several_ranks_without_a_process_group_says_how_to_get_one(using_it):
    assert not dist.is_initialized()
    s = using_it
    with pytest.raises(ValueError) as info:
        cam_jit.fused_deep_moe(s["x"], s["expert_ids"].int(), s["w1"][:4], s["s1"][:4], s["w2"][:4], s["s2"][:4],
                               s["expert_scales"], group_ep="", ep_rank_size=2, ep_rank_id=0, moe_expert_num=s["E"])
    message = str(info.value)
    assert "torch.distributed.init_process_group" in message and "not initialized" in message, message
    assert '"" then names the default group' in message and "'world'" not in message, message


def test_gmm1_weight_missing_its_up_half_is_reported_against_it(using_it):
    s = using_it
    gate_only = s["w1"][..., : s["I"]]
    with pytest.raises(ValueError) as info:
        cam_jit.fused_deep_moe(s["x"], s["expert_ids"].int(), gate_only, s["s1"], s["w2"], s["s2"], s["expert_scales"],
                               group_ep="", ep_rank_size=1, ep_rank_id=0, moe_expert_num=s["E"])
    message = str(info.value)
    assert message.startswith("fused_deep_moe: argument 'gmm1_weight': expected a last dimension of "
                              f"{2 * s['I']}"), message
    assert "is the up half missing?" in message, message


@pytest.mark.parametrize("per_expert", [False, True])
def test_single_stacked_tensors_are_named_without_an_index(using_it, per_expert):
    s = using_it
    w2 = s["w2"][..., :-1]
    w2 = list(w2.unbind(0)) if per_expert else w2
    w = (list(t.unbind(0)) if per_expert else t for t in (s["w1"], s["s1"], s["s2"]))
    w1, s1, s2 = w
    with pytest.raises(ValueError) as info:
        cam_jit.fused_deep_moe(s["x"], s["expert_ids"].int(), w1, s1, w2, s2, s["expert_scales"],
                               group_ep="", ep_rank_size=1, ep_rank_id=0, moe_expert_num=s["E"])
    assert f"argument 'gmm2_weight{'[0]' if per_expert else ''}'" in str(info.value), info.value
