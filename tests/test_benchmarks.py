"""Every benchmark script still runs against the current internals (small sizes, one repetition):
they are not run by anything else, and a benchmark that rotted unnoticed once already. Figures
are not checked here (a timed assertion is flaky on a shared machine); the scripts' own checks that
the paths they compare agree are."""
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
RUNS = {
    "cpu_limits": (["bench_cpu_limits.py", "--bs", "1", "20", "--reps", "1", "--fresh", "1", "--skip-buffer",
                    "--hidden", "256", "--inter", "128"], "W4A8 / W8A8, BS 1"),
    "fused_deep_moe": (["bench_fused_deep_moe.py", "--bs", "2", "--hidden", "256", "--inter", "128", "--experts", "4",
                        "--topk", "2", "--iters", "1", "--threads", "1"], "op (C++ path)"),
    "zero_buffer": (["bench_zero_buffer.py", "--ranks", "2", "--bs", "2", "--prefill", "0", "--hidden", "256",
                     "--inter", "128", "--experts", "4", "--topk", "2", "--blocks", "1", "--calls", "1",
                     "--threads", "1"], "whole op"),
    "prefill": (["bench_prefill.py", "--ranks", "2", "--bs", "16", "--hidden", "256", "--experts", "4", "--topk", "2",
                 "--blocks", "1", "--threads", "1"], "normal / low-latency"),
    "jit": (["bench_jit.py", "--tiny", "--runs", "1", "--concurrent", "2"], "warm cam_jit.load()"),
}


@pytest.mark.parametrize("argv, printed", RUNS.values(), ids=RUNS.keys())
def test_benchmark_runs(argv, printed):
    done = subprocess.run([sys.executable, str(BENCHMARKS / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert printed in done.stdout, done.stdout[-3000:]
