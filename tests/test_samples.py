"""Every sample runs as a user would run it (a fresh process, local CPU ranks) and passes; small
sizes keep it quick. A sample exits non-zero on a mismatch, so this also checks its verdict."""
import pathlib
import subprocess
import sys

import pytest

SAMPLES = pathlib.Path(__file__).resolve().parent.parent / "samples"
SMALL = ["--bs", "4", "--hidden", "256", "--inter", "128", "--experts", "8", "--topk", "4", "--iters", "1"]
RUNS = {
    "fused_deep_moe": ["fused_deep_moe_sample.py", *SMALL],
    "fused_deep_moe-options": ["fused_deep_moe_sample.py", *SMALL, "--ranks", "4", "--share", "--smooth", "--mask",
                               "--eplb"],
    "fused_deep_moe_w4a8": ["fused_deep_moe_w4a8_sample.py", *SMALL, "--share", "--smooth"],
    "fused_deep_moe_shmem": ["fused_deep_moe_shmem_sample.py", *SMALL, "--ranks", "4", "--share", "--smooth", "--mask"],
    "moe_prefill": ["moe_prefill_sample.py", *SMALL[:-2], "--bs", "24", "--iters", "1"],
    "a2e_e2a": ["a2e_e2a_sample.py", "--experts", "1", "--attention", "3", "--bs", "6", "--hidden", "256",
                "--iters", "1"],
}


@pytest.mark.parametrize("argv", RUNS.values(), ids=RUNS.keys())
def test_sample_passes(argv):
    done = subprocess.run([sys.executable, str(SAMPLES / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PASS" in done.stdout
