"""A first-use build reports ninja's steps while it runs (cam_jit.jit.progress): as `cam_jit`
logger records when logging is configured, as one live line on a terminal, and not at all on a
non-terminal stderr (which keeps exactly the "compiling" and "built" lines)."""
import json
import logging
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cam_jit import jit
from cam_jit.jit import core, progress

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "jit_data"
RUNNER = DATA / "runner.py"
TINY = json.dumps({"backend": "test-progress", "name": "t_progress", "root": str(DATA), "sources": ["tiny.cpp"],
                   "headers": ["tiny.h"]})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAM_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CAM_JIT_DISABLE_JIT", raising=False)
    monkeypatch.setattr(core, "_LOADED", {})
    return tmp_path / "cache"


def _env(cache):
    env = dict(os.environ, PYTHONPATH=str(REPO), CAM_JIT_CACHE_DIR=str(cache))
    env.pop("CAM_JIT_DISABLE_JIT", None)
    return env


def test_steps_are_logger_records_when_logging_is_configured(cache, caplog):
    spec = jit.BuildSpec(backend="test-progress", name="t_progress", root=DATA, sources=(DATA / "tiny.cpp",),
                         headers=(DATA / "tiny.h",))
    with caplog.at_level(logging.INFO, logger="cam_jit"):
        assert jit.load_spec(spec).built
    messages = [r.getMessage() for r in caplog.records if r.name == "cam_jit"]
    steps = [m for m in messages if m.startswith("building the test-progress backend: [")]
    assert steps == ["building the test-progress backend: [1/2] tiny.o",
                     "building the test-progress backend: [2/2] t_progress.so"], messages
    assert messages[0].startswith("compiling the test-progress backend")
    assert messages[-1].startswith("built the test-progress backend in")


def test_non_terminal_stderr_gets_only_the_two_lines(cache):
    run = subprocess.run([sys.executable, str(RUNNER), TINY], capture_output=True, text=True, timeout=300,
                         env=_env(cache), cwd="/")
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("cam_jit")]
    assert len(lines) == 2 and "\r" not in run.stderr, run.stderr
    assert lines[0].startswith("cam_jit: compiling the test-progress backend")
    assert lines[1].startswith("cam_jit: built the test-progress backend in")
    # the README's JIT cache table says exactly this
    row = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| first use |"))
    assert "prints two lines on stderr" in row, row
    for line, cut in ((lines[0], " ("), (lines[1], " in ")):
        assert line.split(cut)[0].replace("test-progress", "cpu") in row, (line, row)
    assert "this happens once per cache entry`" in row and lines[0].endswith("this happens once per cache entry")


def test_terminal_gets_one_live_line_cleared_before_the_built_line(cache):
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(RUNNER), TINY], stdin=terminal, stdout=subprocess.PIPE,
                            stderr=terminal, env=_env(cache), cwd="/")
    os.close(terminal)
    seen = b""
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=60) == 0, seen
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        os.close(controller)
    text = seen.decode()
    live = "\r\x1b[Kcam_jit: building the test-progress backend: "
    assert live + "[1/2] tiny.o" in text and live + "[2/2] t_progress.so" in text, repr(text)
    built = text.index("cam_jit: built the test-progress backend")
    assert text[:built].endswith("\r\x1b[K"), repr(text)  # the live line was cleared first
    assert text.count("\n", text.index("cam_jit: compiling"), built) == 1, repr(text)  # no step added a line


def test_finished_steps_are_read_from_the_ninja_log(tmp_path):
    (tmp_path / "build.ninja").write_text("rule cc\n  command = x\nbuild a.o: cc a.cpp\nbuild b.o: cc b.cpp\n"
                                          "build lib.so: link a.o b.o\ndefault lib.so\n")
    (tmp_path / ".ninja_log").write_text("# ninja log v5\n0\t10\t0\tb.o\tabc\n5\t20\t0\ta.o\tdef\n")
    assert progress.planned_steps(tmp_path) == ["a.o", "b.o", "lib.so"]
    assert progress.finished_steps(tmp_path) == ["b.o", "a.o"]
    assert progress.planned_steps(tmp_path / "missing") == [] == progress.finished_steps(tmp_path / "missing")
