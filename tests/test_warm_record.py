"""The warm record (cam_jit.jit.warm): a registered backend's entry found by `stat` calls alone,
and every change that must still miss it: sources (also edits keeping size and mtime, and new
files), the compiler (replaced, or a new one earlier on PATH), torch, the code that declares the
spec, a tampered library, and the trust rules."""
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from cam_jit import jit
from cam_jit.jit import backends, core, memo, spec as spec_module, trust, warm

DATA = Path(__file__).resolve().parent / "jit_data"
SETTLE = 0.2


@pytest.fixture
def backend(tmp_path, monkeypatch):
    """A registered backend `test-warm` whose spec lists a private copy of the tiny sources (as
    the CPU backend lists its kernels), a private cache, files settled after SETTLE s, a real
    compiler reached through an empty PATH directory searched first, and a log of the spec
    factory's calls (a load through the warm record makes none)."""
    monkeypatch.setenv("CAM_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CAM_JIT_DISABLE_JIT", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(memo, "SETTLE_SECONDS", SETTLE)
    early = tmp_path / "early"
    early.mkdir()
    monkeypatch.setenv("PATH", f"{early}{os.pathsep}{os.environ['PATH']}")
    folder = tmp_path / "src" / "warm"
    folder.mkdir(parents=True)
    for name in ("tiny.cpp", "tiny.h"):
        shutil.copy(DATA / name, folder / name)
    calls = []

    def factory():
        calls.append(1)
        listed = []
        sources, headers = backends.tree_files(folder, ".cpp", ".h", walked=listed)
        return jit.BuildSpec(backend="test-warm", name="t_warm", root=folder.parent, sources=sources,
                             headers=headers, listed=tuple(listed))

    monkeypatch.setitem(jit.BACKENDS, "test-warm", jit.Backend("test-warm", factory, lambda: None))
    return folder, early, calls


def load():
    core._LOADED.clear()
    return jit.load("test-warm")


def warm_load(calls):
    """Build, let everything settle, load until the warm record is written; then one load by it."""
    first = load()
    time.sleep(SETTLE + 0.1)
    load()  # hashes the library, records its identity in the memo
    load()  # the memo vouches: the warm record is written
    assert list((jit.cache_dir() / "test-warm").glob(f"{warm.PREFIX}*"))
    before = len(calls)
    hit = load()
    assert len(calls) == before and not hit.built and hit.library == first.library, "not loaded by the warm record"
    return first


def missed(calls, before):
    return len(calls) > before


def test_warm_record_loads_without_building_the_spec(backend):
    folder, early, calls = backend
    first = warm_load(calls)
    assert first.entry == first.library.parent and str(first.library) in __import__("torch").ops.loaded_libraries


@pytest.mark.parametrize("how", ["edit keeping size and mtime", "new file"])
def test_changed_sources_miss(backend, how):
    folder, early, calls = backend
    first = warm_load(calls)
    if how == "new file":
        (folder / "extra.h").write_text("#pragma once\n")
    else:
        header = folder / "tiny.h"
        before = header.stat()
        header.write_text(header.read_text().replace("42", "43"))
        os.utime(header, ns=(before.st_atime_ns, before.st_mtime_ns))
    n = len(calls)
    again = load()
    assert missed(calls, n) and again.built and again.entry != first.entry


def test_a_compiler_placed_earlier_on_path_misses(backend):
    folder, early, calls = backend
    first = warm_load(calls)
    real = shutil.which("c++")
    wrapper = early / "c++"
    wrapper.write_text(f"#!/bin/sh\nexec {real} \"$@\"\n")
    wrapper.chmod(0o755)
    n = len(calls)
    again = load()
    assert missed(calls, n) and again.entry.parent == first.entry.parent and again.entry != first.entry


def test_a_replaced_compiler_misses(backend, tmp_path, monkeypatch):
    folder, early, calls = backend
    wrapper = early / "c++"
    wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('c++')} \"$@\"\n")
    wrapper.chmod(0o755)
    time.sleep(SETTLE + 0.1)
    warm_load(calls)
    wrapper.write_text(wrapper.read_text() + "# upgraded\n")  # same path, another file state
    n = len(calls)
    load()
    assert missed(calls, n)


def test_changed_torch_misses(backend, monkeypatch):
    folder, early, calls = backend
    first = warm_load(calls)
    facts = spec_module.environment_facts()
    other = lambda: {**facts, "torch": facts["torch"] + ".other"}  # noqa: E731
    monkeypatch.setattr(spec_module, "environment_facts", other)
    monkeypatch.setattr(warm, "environment_facts", other)
    n = len(calls)
    again = load()
    assert missed(calls, n) and again.built and again.entry.parent != first.entry.parent


def test_edited_spec_code_misses(backend, tmp_path, monkeypatch):
    folder, early, calls = backend
    code = tmp_path / "spec_code.py"
    code.write_text("# the module that declares the spec\n")
    monkeypatch.setattr(warm, "_SPEC_SOURCE", str(code))
    time.sleep(SETTLE + 0.1)
    warm_load(calls)
    code.write_text("# the module that declares the spec, edited\n")
    n = len(calls)
    load()
    assert missed(calls, n)


def test_tampered_library_is_refused_and_rebuilt(backend, caplog):
    caplog.set_level(logging.INFO, logger="cam_jit")
    folder, early, calls = backend
    first = warm_load(calls)
    library = first.library
    before = library.stat()
    data = library.read_bytes()
    at = data.index(b"GCC:")
    with open(library, "r+b") as f:  # same inode, same size, mtime put back
        f.seek(at)
        f.write(b"gcc:")
    os.utime(library, ns=(before.st_atime_ns, before.st_mtime_ns))
    n = len(calls)
    again = load()
    assert missed(calls, n) and "sha256 differs" in caplog.text and again.built


def test_the_entry_is_still_trust_checked(backend):
    folder, early, calls = backend
    first = warm_load(calls)
    first.entry.chmod(0o777)
    n = len(calls)
    with pytest.raises(trust.UntrustedCacheError, match="group- or world-writable"):
        load()
    assert not missed(calls, n)  # refused by the warm path itself


def test_a_record_others_can_write_is_ignored_and_replaced(backend):
    folder, early, calls = backend
    warm_load(calls)
    (record,) = (jit.cache_dir() / "test-warm").glob(f"{warm.PREFIX}*")
    record.chmod(0o666)
    n = len(calls)
    load()
    assert missed(calls, n) and record.stat().st_mode & 0o777 == 0o644
    n = len(calls)
    load()
    assert not missed(calls, n)


def test_clean_removes_the_record(backend):
    folder, early, calls = backend
    warm_load(calls)
    jit.clean("test-warm")
    assert not list((jit.cache_dir() / "test-warm").glob(f"{warm.PREFIX}*"))
