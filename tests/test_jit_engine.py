"""Robustness tests of the JIT build engine (cam_jit.jit).

Most builds use tiny sources from tests/jit_data that include no torch header (well under a
second to compile); one session-wide build compiles a real TORCH_LIBRARY op (torch_op.cpp).
Fresh-process checks run tests/jit_data/runner.py in subprocesses with timeouts, each in its own
session so that leftovers can be killed as a group.
"""
import importlib.machinery
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import cam_jit
from cam_jit import jit
from cam_jit.jit import core, memo, toolchain, trust

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "jit_data"
RUNNER = DATA / "runner.py"


# ---------------------------------------------------------------------------------- helpers

def make_spec(root, name, headers=("tiny.h",), **kw):
    """A one-source spec from ``root`` (backend ``test-<name>``, library ``t_<name>``)."""
    return jit.BuildSpec(backend=f"test-{name}", name=f"t_{name}", root=Path(root),
                         sources=(Path(root) / f"{name}.cpp",),
                         headers=tuple(Path(root) / h for h in headers), **kw)


def spec_arg(root, name, headers=("tiny.h",)):
    return json.dumps({"backend": f"test-{name}", "name": f"t_{name}", "root": str(root),
                       "sources": [f"{name}.cpp"], "headers": list(headers)})


def child_env(cache, **overrides):
    env = dict(os.environ, PYTHONPATH=str(REPO), CAM_JIT_CACHE_DIR=str(cache))
    env.pop("CAM_JIT_DISABLE_JIT", None)
    env.update(overrides)
    return env


class Procs:
    """Starts runner processes in their own sessions; kills whatever is left at teardown."""

    def __init__(self):
        self.procs = []

    def start(self, args, env, prefix=()):
        proc = subprocess.Popen([*prefix, sys.executable, str(RUNNER), *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, cwd="/")
        self.procs.append(proc)
        return proc

    def run(self, args, env, timeout=120, prefix=()):
        """Run a runner to completion: (parsed JSON line, stderr, return code)."""
        proc = self.start(args, env, prefix)
        out, err = proc.communicate(timeout=timeout)
        lines = out.strip().splitlines()
        return (json.loads(lines[-1]) if lines else None), err, proc.returncode

    def kill_all(self):
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.kill_all()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A private cache per test; JIT enabled; no memoised backends leak between tests."""
    path = tmp_path / "cache"
    monkeypatch.setenv("CAM_JIT_CACHE_DIR", str(path))
    monkeypatch.delenv("CAM_JIT_DISABLE_JIT", raising=False)
    monkeypatch.setattr(core, "_LOADED", {})
    return path


@pytest.fixture
def src(tmp_path):
    """A private copy of the test sources (tests may edit or corrupt them)."""
    return Path(shutil.copytree(DATA, tmp_path / "src"))


@pytest.fixture(scope="session")
def torch_op_cache(tmp_path_factory):
    """One real build of a TORCH_LIBRARY op in a fresh process: (cache dir, result, stderr)."""
    cache = tmp_path_factory.mktemp("torch_op") / "cache"
    p = Procs()
    try:
        result, err, rc = p.run([spec_arg(DATA, "torch_op", headers=())], child_env(cache),
                                timeout=300)
    finally:
        p.kill_all()
    assert rc == 0, err
    return cache, result, err


def temp_dirs(cache):
    return sorted(str(p) for p in Path(cache).glob("*/*/.tmp-*"))


def entry_of(spec):
    """The entry path this process would use for ``spec`` (probes the compiler)."""
    compiler = toolchain.find_compiler()
    version = toolchain.compiler_version(compiler, jit.cache_dir(), probe=True)
    return jit.cache_dir() / spec.backend / jit.content_key(spec) / jit.compiler_key(
        compiler.path, version)


def replace_file(path, data):
    """Change a file's bytes through a new inode (the old one may be mapped by this process)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def hold_lock(lock, seconds: float) -> subprocess.Popen:
    """A process of its own session holding the file lock at `lock` for `seconds`; returns once it
    holds it (the caller kills its process group)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, filelock; l = filelock.UnixFileLock(sys.argv[1]);"
         "l.acquire(); print('held', flush=True); time.sleep(float(sys.argv[2]))", str(lock), str(seconds)],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    if holder.stdout.readline().strip() != "held":
        os.killpg(holder.pid, signal.SIGKILL)
        holder.communicate()
        raise AssertionError(f"the lock holder never took {lock}")
    return holder


def as_nobody() -> list:
    """The command prefix that runs a process as uid 65534; skips the test where setpriv is missing
    or that user cannot run Python on this checkout."""
    if not shutil.which("setpriv"):
        pytest.skip("setpriv is not installed")
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run([*prefix, sys.executable, "-c", f"import os; os.listdir({str(REPO)!r})"],
                           capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"user 65534 cannot run Python on this checkout: {probe.stderr[-200:]!r}")
    return prefix


# ------------------------------------------------------------------------------- cache key

def test_key_changes_with_every_input(src, monkeypatch):
    spec = make_spec(src, "tiny")
    base = jit.content_key(spec)
    keys = {"base": base}

    def key_with(path, change):
        old = path.read_bytes()
        path.write_bytes(change(bytearray(old)))
        try:
            return jit.content_key(spec)
        finally:
            path.write_bytes(old)

    def flip_first(data):
        data[0] ^= 1
        return bytes(data)

    keys["source byte"] = key_with(src / "tiny.cpp", flip_first)
    keys["source appended"] = key_with(src / "tiny.cpp", lambda d: bytes(d) + b" ")
    keys["header byte"] = key_with(src / "tiny.h", flip_first)
    assert jit.content_key(spec) == base  # restored files give the original key back

    keys["cflags"] = jit.content_key(make_spec(src, "tiny", cflags=("-O2",)))
    keys["ldflags"] = jit.content_key(make_spec(src, "tiny", ldflags=("-lm",)))
    keys["extra"] = jit.content_key(make_spec(src, "tiny", extra_key={"cann": "8.0"}))
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "9.9.9")
        keys["torch"] = jit.content_key(spec)
    with monkeypatch.context() as m:
        m.setattr(torch.version, "git_version", "0" * 40)
        keys["torch_git"] = jit.content_key(spec)
    with monkeypatch.context() as m:
        m.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI)
        keys["cxx11_abi"] = jit.content_key(spec)
    with monkeypatch.context() as m:
        m.setattr(importlib.machinery, "EXTENSION_SUFFIXES", [".cpython-399-other.so"])
        keys["python_abi"] = jit.content_key(spec)
    with monkeypatch.context() as m:
        m.setattr(sys.implementation, "cache_tag", "cpython-399")
        keys["python_cache_tag"] = jit.content_key(spec)
    with monkeypatch.context() as m:
        m.setattr(cam_jit._version, "__version__", "99.0")
        keys["cam_jit"] = jit.content_key(spec)
    assert jit.content_key(spec) == base
    assert len(set(keys.values())) == len(keys), keys

    compilers = {jit.compiler_key("/usr/bin/c++", "gcc 12"), jit.compiler_key("/opt/c++", "gcc 12"),
                 jit.compiler_key("/usr/bin/c++", "gcc 13")}
    assert len(compilers) == 3


def test_key_is_content_not_location_or_mtime(src, tmp_path):
    base = jit.content_key(make_spec(src, "tiny"))
    again = Path(shutil.copytree(src, tmp_path / "reinstalled"))
    for f in again.iterdir():
        os.utime(f, (time.time() + 3600, time.time() + 3600))
    assert jit.content_key(make_spec(again, "tiny")) == base
    (again / "tiny.cpp").rename(again / "other.cpp")  # same bytes, other name
    renamed = jit.BuildSpec(backend="test-tiny", name="t_tiny", root=again,
                            sources=(again / "other.cpp",), headers=(again / "tiny.h",))
    assert jit.content_key(renamed) != base


def test_compiler_version_is_probed_once_per_binary(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "fakecxx"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho fakecxx 1.0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    compiler = toolchain.find_compiler()
    assert toolchain.compiler_version(compiler, tmp_path, probe=False) is None
    assert toolchain.compiler_version(compiler, tmp_path, probe=True) == "fakecxx 1.0"
    assert toolchain.compiler_version(compiler, tmp_path, probe=False) == "fakecxx 1.0"  # memo
    fake.write_text("#!/bin/sh\necho fakecxx 2.0.1\n")  # upgraded in place: new identity
    upgraded = toolchain.find_compiler()
    assert upgraded.identity != compiler.identity
    assert toolchain.compiler_version(upgraded, tmp_path, probe=False) is None
    assert toolchain.compiler_version(upgraded, tmp_path, probe=True) == "fakecxx 2.0.1"


# ------------------------------------------------------------------------------ backends

def test_cpu_spec_from_kernels_dir(tmp_path, monkeypatch):
    # from the checkout or an installed wheel, the kernels found are the repository's
    shipped = {p.relative_to(jit.kernels_dir()): p.read_bytes() for p in jit.kernels_dir().rglob("*.*")
               if p.suffix in (".cpp", ".h")}
    assert shipped and shipped == {p.relative_to(REPO / "kernels"): p.read_bytes()
                                   for p in (REPO / "kernels").rglob("*.*") if p.suffix in (".cpp", ".h")}
    package = tmp_path / "site" / "cam_jit"
    cpu = package / "_kernels" / "cpu"
    (cpu / "sub").mkdir(parents=True)
    for name in ("b.cpp", "a.cpp", "sub/c.cpp", "common.h", "notes.txt"):
        (cpu / name).write_text("// x\n")
    monkeypatch.setattr(jit.backends, "_PACKAGE_DIR", package)
    assert jit.kernels_dir() == package / "_kernels"  # installed wheel layout wins
    spec = jit.cpu_spec()
    assert spec.backend == "cpu" and spec.root == package / "_kernels"
    assert [spec.relative(p) for p in spec.sources] == ["cpu/a.cpp", "cpu/b.cpp", "cpu/sub/c.cpp"]
    assert [spec.relative(p) for p in spec.headers] == ["cpu/common.h"]
    assert "-O3" in spec.cflags and "-ffp-contract=off" in spec.cflags
    shutil.rmtree(package / "_kernels")
    (tmp_path / "site" / "kernels" / "cpu").mkdir(parents=True)
    assert jit.kernels_dir() == tmp_path / "site" / "kernels"
    with pytest.raises(jit.JitError, match="no C.. sources"):
        jit.cpu_spec()


def test_backend_registry_and_memoised_load(src, monkeypatch):
    assert jit.default_backend() == "cpu"  # torch_npu is not installed here
    with pytest.raises(jit.JitError, match="unknown backend 'nope'.*cpu"):
        jit.load("nope")
    with pytest.raises(jit.JitError, match="npu.*not available"):
        jit.load("npu")
    calls = []
    monkeypatch.setitem(jit.BACKENDS, "test-tiny", jit.Backend(
        "test-tiny", lambda: calls.append(1) or make_spec(src, "tiny"), lambda: None))
    first = jit.load("test-tiny")
    assert first.built and first.backend == "test-tiny" and first.library.is_file()
    assert first.entry == first.library.parent and (first.entry / "manifest.json").is_file()
    assert jit.load("test-tiny") is first and calls == [1]


# ------------------------------------------------------------------- fresh-process loading

def test_cold_build_reports_what_where_and_how_long(torch_op_cache):
    cache, result, err = torch_op_cache
    assert result["built"] and result["check"] == 43
    lines = [line for line in err.splitlines() if line.startswith("cam_jit: ")]
    assert len(lines) == 2, err
    assert "compiling the test-torch_op backend" in lines[0] and str(cache) in lines[0]
    assert "built the test-torch_op backend in" in lines[1] and " s: " in lines[1]
    manifest = json.loads((Path(result["entry"]) / "manifest.json").read_text())
    assert manifest["inputs"]["content"]["torch_git"] == torch.version.git_version
    assert manifest["build_seconds"] > 0 and not temp_dirs(cache)


def test_warm_load_spawns_nothing_even_without_toolchain(torch_op_cache, procs):
    cache, cold, _ = torch_op_cache
    arg = spec_arg(DATA, "torch_op", headers=())
    no_tools = child_env(cache, PATH="/nonexistent")  # neither c++ nor ninja; CXX unset
    no_tools.pop("CXX", None)
    envs = (no_tools, child_env(cache, CXX="/nonexistent/c++"), child_env(cache))
    runs = [procs.start([arg], env) for env in envs]
    for proc in runs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        warm = json.loads(out.strip().splitlines()[-1])
        assert not warm["built"] and warm["check"] == 43 and warm["entry"] == cold["entry"]
        assert [e for e in warm["events"] if e[0] != "import_torch"] == []
        assert warm["modules"] == []  # neither filelock (no lock) nor cpp_extension imported
        assert "cam_jit:" not in err  # the warm path is silent


def test_read_only_cache_as_unprivileged_user(torch_op_cache, procs):
    prefix = as_nobody()
    shared = Path(tempfile.mkdtemp(prefix="cam_jit_ro_"))
    try:
        os.chmod(shared, 0o755)
        cache = shutil.copytree(torch_op_cache[0], shared / "cache")
        for path in [cache, *cache.rglob("*")]:  # read-only, read bits as the build made them
            os.chmod(path, path.stat().st_mode & 0o7555)
        env = child_env(cache, HOME="/nonexistent")
        warm, err, rc = procs.run([spec_arg(DATA, "torch_op", headers=())], env, prefix=prefix)
        assert rc == 0, err
        assert not warm["built"] and warm["check"] == 43
        assert [e for e in warm["events"] if e[0] != "import_torch"] == []
        miss, err, rc = procs.run([spec_arg(DATA, "tiny")], env, prefix=prefix)
        assert rc == 3 and miss["error"] == "BuildError", err
        assert "not writable" in miss["message"] and "CAM_JIT_CACHE_DIR" in miss["message"]
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_concurrent_cold_processes_compile_once(src, cache, procs, tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    args = [spec_arg(src, "slow", headers=()), "--barrier", str(barrier), "4"]
    runs = [procs.start(args, child_env(cache)) for _ in range(4)]
    results, errs = [], ""
    for proc in runs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
        errs += err
    assert sorted(r["built"] for r in results) == [False, False, False, True]
    assert len({r["check"] for r in results}) == 1 and len({r["entry"] for r in results}) == 1
    assert errs.count("cam_jit: compiling") == 1
    assert len(list(cache.glob("test-slow/*/*/manifest.json"))) == 1 and not temp_dirs(cache)


def test_sigkill_while_compiling_then_next_process_recovers(src, cache, procs):
    arg = spec_arg(src, "slow", headers=())
    builder = procs.start([arg], child_env(cache))
    deadline = time.monotonic() + 60
    while not list(cache.glob("test-slow/*/.tmp-*/build.ninja")):
        assert builder.poll() is None and time.monotonic() < deadline, builder.communicate()
        time.sleep(0.02)
    time.sleep(0.5)  # ninja runs the compiler now; slow.cpp takes ~2 s
    tmp = Path(temp_dirs(cache)[0])
    assert builder.poll() is None and not list(tmp.glob("*.o")) and not list(tmp.glob("*.so"))
    os.killpg(builder.pid, signal.SIGKILL)
    builder.communicate()
    assert temp_dirs(cache) == [str(tmp)]  # the killed build left its temp dir
    result, err, rc = procs.run([arg], child_env(cache), timeout=120)
    assert rc == 0 and result["built"], err
    assert not temp_dirs(cache)


def test_sigkill_just_before_publish_then_next_process_recovers(src, cache, procs):
    arg = spec_arg(src, "tiny")
    dead, err, rc = procs.run([arg, "--die-at-publish"], child_env(cache))
    assert rc == -signal.SIGKILL and dead is None, err
    (tmp,) = temp_dirs(cache)  # complete, unpublished build
    assert (Path(tmp) / "manifest.json").is_file()
    assert not [p for p in cache.glob("test-tiny/*/*") if p.is_dir() and p.name[0] != "."]
    result, err, rc = procs.run([arg], child_env(cache))
    assert rc == 0 and result["built"] and result["check"] == 42, err
    assert not temp_dirs(cache)


# --------------------------------------------------------------------------- in-process

def test_truncated_or_corrupted_library_is_rebuilt(src, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="cam_jit")
    spec = make_spec(src, "tiny")
    first = jit.load_spec(spec)
    data = first.library.read_bytes()
    replace_file(first.library, data[: len(data) // 2])
    again = jit.load_spec(spec)
    assert again.built and again.entry == first.entry
    assert "failed verification" in caplog.text and "bytes" in caplog.text
    assert jit.verify_entry(again.entry)[1] is None

    caplog.clear()
    data = again.library.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    stat = again.library.stat()
    replace_file(again.library, bytes(flipped))
    os.utime(again.library, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime
    third = jit.load_spec(spec)
    assert third.built and "sha256" in caplog.text
    assert jit.verify_entry(third.entry)[1] is None

    replace_file(third.library, bytes(flipped))  # corrupted and rebuilding impossible
    monkeypatch.setenv("CAM_JIT_DISABLE_JIT", "1")
    with pytest.raises(jit.CacheMissError, match="(?s)Rejected entry.*sha256"):
        jit.load_spec(spec)


def test_disable_jit_miss_and_hit(src, cache, monkeypatch):
    spec = make_spec(src, "tiny")
    monkeypatch.setenv("CAM_JIT_DISABLE_JIT", "1")
    with pytest.raises(jit.CacheMissError) as miss:
        jit.load_spec(spec)
    message = str(miss.value)
    assert isinstance(miss.value, RuntimeError)
    assert "test-tiny" in message and "CAM_JIT_DISABLE_JIT=1" in message
    assert str(cache / "test-tiny" / jit.content_key(spec)) in message
    assert "python -m cam_jit build --backend test-tiny" in message
    assert not cache.joinpath("test-tiny").exists()
    monkeypatch.delenv("CAM_JIT_DISABLE_JIT")
    built = jit.load_spec(spec)
    monkeypatch.setenv("CAM_JIT_DISABLE_JIT", "1")
    hit = jit.load_spec(spec)
    assert built.built and not hit.built and hit.library == built.library


def test_compile_error_is_short_and_points_to_the_log(src, cache):
    with pytest.raises(jit.BuildError) as failure:
        jit.load_spec(make_spec(src, "bad", headers=()))
    message = str(failure.value)
    assert "error:" in message and "undeclared_in_cam_jit_test" in message
    assert "command: " in message and "bad.cpp" in message
    log_path = Path(message.split("full log: ")[1].strip())
    assert log_path.is_file() and log_path.is_relative_to(cache)
    assert "ninja: build stopped" in log_path.read_text()
    assert len(message) < 2000 and "ninja: build stopped" not in message
    assert not temp_dirs(cache) and not list(cache.glob("test-bad/*/*/manifest.json"))


def test_missing_tools_are_named_only_when_a_build_is_needed(src, tmp_path, monkeypatch):
    spec = make_spec(src, "tiny")
    with monkeypatch.context() as m:
        m.setenv("CXX", "/nonexistent/c++")
        with pytest.raises(jit.ToolchainError, match="(?s)/nonexistent/c\\+\\+.*apt-get install g"):
            jit.load_spec(spec)
    with monkeypatch.context() as m:
        m.setenv("CXX", toolchain.find_compiler().path)
        m.setenv("PATH", str(tmp_path))
        m.setitem(sys.modules, "ninja", None)  # hides the ninja Python package
        with pytest.raises(jit.ToolchainError, match="ninja.*pip install ninja"):
            jit.load_spec(spec)
    built = jit.load_spec(spec)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "ninja", None)
    warm = jit.load_spec(spec)
    assert built.built and not warm.built and warm.library == built.library


def test_waiter_says_what_it_waits_for(src, caplog, monkeypatch, procs):
    caplog.set_level(logging.INFO, logger="cam_jit")
    spec = make_spec(src, "tiny")
    lock = entry_of(spec).with_name(entry_of(spec).name + ".lock")
    lock.parent.mkdir(parents=True)
    procs.procs.append(hold_lock(lock, 1.5))
    monkeypatch.setattr(core, "WAIT_LOG_FIRST", 0.3)
    monkeypatch.setattr(core, "WAIT_LOG_EVERY", 0.3)
    start = time.monotonic()
    loaded = jit.load_spec(spec)
    assert loaded.built and time.monotonic() - start > 1.0
    waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert len(waits) >= 2 and str(lock) in waits[0] and "test-tiny" in waits[0]


# ------------------------------------------------------------------------- sources memo

@pytest.fixture
def settled(monkeypatch):
    """Sources count as settled at once (they are seconds old in a real checkout, fresh here),
    and a counter of how often the engine hashes them."""
    monkeypatch.setattr(memo, "SETTLE_SECONDS", 0.0)
    hashed = []
    real = core.file_digests
    monkeypatch.setattr(core, "file_digests", lambda spec: hashed.append(spec.backend) or real(spec))
    return hashed


def memos(backend):
    return sorted(p.name for p in (jit.cache_dir() / backend).glob(f"{memo.PREFIX}*"))


def test_warm_load_finds_the_entry_without_hashing_the_sources(src, settled):
    spec = make_spec(src, "tiny")
    first = jit.load_spec(spec)
    hashed = len(settled)
    assert first.built and hashed and len(memos("test-tiny")) == 1
    again = jit.load_spec(spec)
    assert not again.built and again.entry == first.entry and len(settled) == hashed  # not hashed again


def test_an_edit_that_keeps_size_and_mtime_still_misses_the_memo(src, settled):
    spec = make_spec(src, "tiny")
    first = jit.load_spec(spec)
    header = src / "tiny.h"
    before = header.stat()
    header.write_text(header.read_text().replace("42", "43"))  # same size
    os.utime(header, ns=(before.st_atime_ns, before.st_mtime_ns))  # same mtime; ctime moved on
    hashed = len(settled)
    edited = jit.load_spec(spec)
    assert len(settled) > hashed and edited.built and edited.entry != first.entry
    assert len(memos("test-tiny")) == 1  # the new state's memo replaced the old one
    hashed = len(settled)
    assert not jit.load_spec(spec).built and len(settled) == hashed


def test_fresh_sources_record_no_memo(src, settled, monkeypatch):
    monkeypatch.setattr(memo, "SETTLE_SECONDS", 3600.0)  # every file "was just edited"
    spec = make_spec(src, "tiny")
    jit.load_spec(spec)
    hashed = len(settled)
    jit.load_spec(spec)
    assert memos("test-tiny") == [] and len(settled) == hashed + 1


def test_a_memo_others_can_write_or_pointing_elsewhere_is_not_trusted(src, settled):
    spec = make_spec(src, "tiny")
    first = jit.load_spec(spec)
    (name,) = memos("test-tiny")
    path = jit.cache_dir() / "test-tiny" / name
    path.chmod(0o666)
    hashed = len(settled)
    assert not jit.load_spec(spec).built and len(settled) == hashed + 1  # ignored: hashed, rewritten 0644
    assert path.stat().st_mode & 0o777 == 0o644
    other = jit.load_spec(make_spec(src, "tiny", headers=()))  # another content key, same cache
    other_key = other.entry.parent.name
    (jit.cache_dir() / "test-tiny").joinpath(name).write_text(other_key)  # a memo lying about the key
    path.chmod(0o644)
    hashed = len(settled)
    again = jit.load_spec(spec)
    assert again.entry == first.entry and not again.built and len(settled) == hashed + 1


def test_memo_hit_still_checks_the_library_against_its_manifest(src, settled, caplog):
    caplog.set_level(logging.INFO, logger="cam_jit")
    spec = make_spec(src, "tiny")
    first = jit.load_spec(spec)
    data = bytearray(first.library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    replace_file(first.library, bytes(data))
    again = jit.load_spec(spec)
    assert again.built and "sha256" in caplog.text and jit.verify_entry(again.entry)[1] is None


# -------------------------------------------------- the library vouched for by its identity

@pytest.fixture
def vouching(monkeypatch):
    """Files count as settled 0.2 s after their last change (so that a change made after a memo is
    recorded lands on a later clock tick), and a log of the libraries the engine hashes."""
    monkeypatch.setattr(memo, "SETTLE_SECONDS", 0.2)
    hashed = []
    real = core._verify
    monkeypatch.setattr(core, "_verify", lambda entry: hashed.append(entry) or real(entry))
    return hashed


def vouched_load(spec, hashed):
    """Build, let the library settle, load once hashing it (which records its identity), then
    check that the next load takes the library on the memo's word: no hash."""
    first = jit.load_spec(spec)
    assert first.built
    time.sleep(0.3)
    assert not jit.load_spec(spec).built and hashed  # hashed, identity recorded
    before = len(hashed)
    again = jit.load_spec(spec)
    assert not again.built and again.library == first.library and len(hashed) == before
    return first.library


def test_library_rewritten_in_place_with_its_size_and_mtime_is_caught(src, vouching, caplog):
    caplog.set_level(logging.INFO, logger="cam_jit")
    spec = make_spec(src, "tiny")
    library = vouched_load(spec, vouching)
    before = library.stat()
    data = library.read_bytes()
    at = data.index(b"GCC:")  # the .comment section: never mapped for execution (this process has it loaded)
    with open(library, "r+b") as f:  # the same inode, the same size
        f.seek(at)
        f.write(b"gcc:")
    os.utime(library, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = library.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    hashed = len(vouching)
    again = jit.load_spec(spec)
    assert len(vouching) > hashed and "sha256 differs" in caplog.text and again.built
    assert jit.verify_entry(again.entry)[1] is None


def test_library_replaced_through_a_new_inode_with_its_size_and_mtime_is_caught(src, vouching, caplog):
    caplog.set_level(logging.INFO, logger="cam_jit")
    spec = make_spec(src, "tiny")
    library = vouched_load(spec, vouching)
    before = library.stat()
    data = bytearray(library.read_bytes())
    data[data.index(b"GCC:")] ^= 0x20
    replace_file(library, bytes(data))
    os.utime(library, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = library.stat()
    assert after.st_ino != before.st_ino and (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    hashed = len(vouching)
    again = jit.load_spec(spec)
    assert len(vouching) > hashed and "sha256 differs" in caplog.text and again.built


def test_an_unsettled_library_is_hashed_on_every_load(src, vouching, monkeypatch):
    spec = make_spec(src, "tiny")
    jit.load_spec(spec)
    monkeypatch.setattr(memo, "SETTLE_SECONDS", 3600.0)  # the library (and sources) "were just written"
    for _ in range(2):
        hashed = len(vouching)
        assert not jit.load_spec(spec).built and len(vouching) == hashed + 1


def test_a_vouched_entry_is_still_trust_checked(src, vouching):
    spec = make_spec(src, "tiny")
    library = vouched_load(spec, vouching)
    library.parent.chmod(0o777)
    with pytest.raises(trust.UntrustedCacheError, match="group- or world-writable"):
        jit.load_spec(spec)


def test_clean_removes_the_memos(src, settled):
    jit.load_spec(make_spec(src, "tiny"))
    assert memos("test-tiny")
    jit.clean("test-tiny")
    assert memos("test-tiny") == []
