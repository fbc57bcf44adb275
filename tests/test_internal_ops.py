"""Internal ops reachable as torch.ops._cam_jit_cpu* check their arguments as public ones do:
inconsistent arguments raise, never crash the process (each case runs in a fresh process so a
segfault fails the test instead of the session)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRELUDE = """
import torch, cam_jit, cam_jit.zero_buffer
from cam_jit.ops._kernels import cpu_kernels
from cam_jit.zero_buffer._heap import zb_kernels
cpu, zb = cpu_kernels(), zb_kernels()
q, a = torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
w1, s1 = torch.zeros(8, 6, dtype=torch.int8), torch.ones(6)
w2, s2 = torch.zeros(3, 8, dtype=torch.int8), torch.ones(8)
"""
CASES = {
    # more groups than the per-expert weight list holds (ranks that disagreed on E used to segfault)
    "expert_ffn-list": "cpu.expert_ffn_w8a8(q, a, [1, 1, 1, 1], [w1, w1], [s1, s1], [w2, w2], [s2, s2], torch.bfloat16)",
    "expert_ffn-stacked": "cpu.expert_ffn_w8a8(q, a, [2, 2], [w1[None]], [s1[None]], [w2[None]], [s2[None]], torch.bfloat16)",
    # a row index past the rows of q, and one of another dtype
    "expert_ffn-index": "cpu.expert_ffn_w8a8(q, a, [2], [w1], [s1], [w2], [s2], torch.bfloat16, torch.tensor([0, 4]))",
    "expert_ffn-index-dtype": "cpu.expert_ffn_w8a8(q, a, [2], [w1], [s1], [w2], [s2], torch.bfloat16, "
                              "torch.tensor([0, 1], dtype=torch.int32))",
    "combine-rows": "cpu.combine(torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([[5]]), torch.ones(1, 1), 1)",
    "quantize-index": "cpu.quantize_rows(torch.zeros(2, 8, dtype=torch.bfloat16), None, torch.tensor([7]), None)",
    # x with fewer rows than expert_ids, and smooth scales for fewer experts than the ids name
    "route_and_quantize-rows": "cpu.route_and_quantize(torch.zeros(1, 8, dtype=torch.bfloat16), "
                               "torch.tensor([[0, 1], [1, 0]], dtype=torch.int32), 2, 4, None)",
    # ids naming an expert the weight containers do not hold, and no weights at all
    "moe_one_rank-experts": "cpu.moe_one_rank(torch.zeros(1, 8, dtype=torch.bfloat16), torch.tensor([[3]], dtype=torch.int32), "
                            "1, 4, None, torch.ones(1, 1), [w1, w1], [s1, s1], [], [w2, w2], [s2, s2], [], True)",
    "moe_one_rank-empty": "cpu.moe_one_rank(torch.zeros(1, 8, dtype=torch.bfloat16), torch.tensor([[0]], dtype=torch.int32), "
                          "1, 1, None, torch.ones(1, 1), [], [], [], [], [], [], True)",
    "route_and_quantize-smooth": "cpu.route_and_quantize(torch.zeros(1, 8, dtype=torch.bfloat16), "
                                 "torch.tensor([[3]], dtype=torch.int32), 1, 4, torch.ones(2, 8))",
    # x with fewer rows than expert_ids, and combine weights of another shape than expert_ids
    "moe_one_rank-x-rows": "cpu.moe_one_rank(torch.zeros(1, 8, dtype=torch.bfloat16), torch.tensor([[0], [0]], dtype=torch.int32), "
                           "2, 1, None, torch.ones(2, 1), [w1], [s1], [], [w2], [s2], [], True)",
    "moe_one_rank-weights": "cpu.moe_one_rank(torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([[0], [0]], dtype=torch.int32), "
                            "2, 1, None, torch.ones(1, 1), [w1], [s1], [], [w2], [s2], [], True)",
    "exp_direct-dtype": "cpu.exp_direct(torch.zeros(4, dtype=torch.float64))",
    "zb-region": "zb.region(4096, [16], torch.int64)",
    "zb-put_rows": "zb.put_rows([4096], q, a, torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), [4], 1, 32, 1)",
    "zb-take_rows": "zb.take_rows(4096, [1], 4, 32, 8, 1, 1)",
    "zb-publish": "zb.publish([4096], [1], [], 1, [4096])",
    "zb-wait_flags": "zb.wait_flags([4096], 1, 0.01, 4096)",
    "zb-unmap": "zb.unmap_segment(4096, 4096)",
    "zb-mapped-overrun": "addr = zb.map_segment('/cam_jit_zb.test.' + str(__import__('os').getpid()), 4096, True); "
                         "zb.unlink_segment('/cam_jit_zb.test.' + str(__import__('os').getpid())); "
                         "zb.region(addr, [4097], torch.int8)",
}


@pytest.mark.parametrize("call", CASES.values(), ids=CASES.keys())
def test_internal_op_with_inconsistent_arguments_raises(call):
    code = PRELUDE + f"try:\n    {call}\nexcept RuntimeError as err:\n    print('raised:', str(err)[:200])\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0 and "raised:" in done.stdout, (done.returncode, done.stdout, done.stderr[-2000:])
