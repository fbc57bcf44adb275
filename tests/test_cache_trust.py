"""The JIT cache as a trust boundary (cam_jit/jit/trust.py): only what its user (or root) could
have written is loaded; manifests cannot point outside their entry; a library that matches its
manifest but does not load is rebuilt once; build-lock waits are bounded and lock files private;
a killed builder takes its compiler processes with it."""
import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from cam_jit import jit
from cam_jit.jit import core, trust
from test_jit_engine import (DATA, Procs, cache, child_env, entry_of, hold_lock, make_spec, procs,  # noqa: F401
                             replace_file, spec_arg, src)

OTHER_UID = 65534  # "nobody": a user other than the one running the tests


def _built(src):
    spec = make_spec(src, "tiny")
    loaded = jit.load_spec(spec)
    assert loaded.built
    core._LOADED.clear()
    return spec, loaded.entry


def test_entry_owned_by_another_user_is_refused(src, cache):
    if os.geteuid() != 0:
        pytest.skip("giving a cache entry to another user (chown) needs root")
    spec, entry = _built(src)
    for path in (entry, *entry.iterdir()):
        os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(trust.UntrustedCacheError) as refused:
        jit.load_spec(spec)
    text = str(refused.value)
    assert f"{entry} is owned by uid {OTHER_UID}" in text and "CAM_JIT_CACHE_DIR" in text, text
    # the same for a directory above the entry that the other user owns (they could swap the entry)
    for path in (entry, *entry.iterdir()):
        os.chown(path, 0, 0)
    os.chown(entry.parent, OTHER_UID, OTHER_UID)
    with pytest.raises(trust.UntrustedCacheError, match=f"{entry.parent} is owned by uid {OTHER_UID}"):
        jit.load_spec(spec)


@pytest.mark.parametrize("where,mode", [("root", 0o777), ("backend", 0o1777), ("entry", 0o775), ("library", 0o666)])
def test_group_or_world_writable_path_is_refused(src, cache, where, mode):
    spec, entry = _built(src)
    library = next(p for p in entry.iterdir() if p.suffix == ".so")
    path = {"root": cache, "backend": cache / spec.backend, "entry": entry, "library": library}[where]
    os.chmod(path, mode)
    with pytest.raises(trust.UntrustedCacheError) as refused:
        jit.load_spec(spec)
    assert f"{path} is group- or world-writable (mode {mode:04o})" in str(refused.value)
    assert "chmod go-w" in str(refused.value)
    # `doctor`'s listing reports it instead of failing
    listed = [e for e in jit.list_entries(spec.backend) if e.path == entry]
    assert listed and "group- or world-writable" in listed[0].problem


def test_engine_creates_owner_only_paths_whatever_the_umask(src, cache):
    old = os.umask(0o000)
    try:
        spec, entry = _built(src)
    finally:
        os.umask(old)
    paths = [cache, cache / spec.backend, entry.parent, entry, *entry.iterdir()]
    assert all(not p.stat().st_mode & 0o022 for p in paths), [(str(p), oct(p.stat().st_mode)) for p in paths]
    lock = entry.with_name(entry.name + ".lock")
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    assert jit.load_spec(spec).entry == entry  # and they load


def test_manifest_library_outside_its_entry_is_never_loaded(src, cache, tmp_path):
    spec, entry = _built(src)
    manifest = json.loads((entry / "manifest.json").read_text())
    outside = entry.parent / "planted.so"
    outside.write_bytes((entry / manifest["library"]).read_bytes())
    (entry / "manifest.json").write_text(json.dumps(dict(manifest, library="../planted.so")))
    reloaded = jit.load_spec(spec)  # the entry is unusable: rebuilt, the planted file untouched
    assert reloaded.built and reloaded.library.parent == entry
    assert "/" not in json.loads((entry / "manifest.json").read_text())["library"] and outside.exists()


def test_library_that_matches_its_manifest_but_does_not_load_is_rebuilt_once(src, cache, caplog):
    import hashlib

    spec, entry = _built(src)
    manifest = json.loads((entry / "manifest.json").read_text())
    junk = b"not an ELF file"
    replace_file(entry / manifest["library"], junk)  # this process maps the old inode: never truncate it
    (entry / "manifest.json").write_text(json.dumps(dict(manifest, size=len(junk),
                                                         sha256=hashlib.sha256(junk).hexdigest())))
    loaded = jit.load_spec(spec)
    assert loaded.built and loaded.entry == entry and "does not load" in caplog.text
    assert jit.verify_entry(entry)[0]["size"] != len(junk)


def test_build_lock_wait_is_bounded(src, cache, procs, monkeypatch):  # noqa: F811
    spec = make_spec(src, "tiny")
    lock = entry_of(spec).with_name(entry_of(spec).name + ".lock")
    trust.make_dirs(lock.parent)
    holder = hold_lock(lock, 60)
    procs.procs.append(holder)
    monkeypatch.setenv("CAM_JIT_BUILD_LOCK_TIMEOUT", "1.5")
    start = time.monotonic()
    with pytest.raises(jit.BuildError) as waited:
        jit.load_spec(spec)
    assert 1.4 < time.monotonic() - start < 15
    text = str(waited.value)
    assert str(lock) in text and "CAM_JIT_BUILD_LOCK_TIMEOUT=1.5" in text, text
    monkeypatch.setenv("CAM_JIT_BUILD_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CAM_JIT_BUILD_LOCK_TIMEOUT: expected a positive number"):
        jit.load_spec(spec)


def test_lock_file_of_another_user_is_refused(src, cache):
    if os.geteuid() != 0:
        pytest.skip("giving a lock file to another user (chown) needs root")
    spec = make_spec(src, "tiny")
    lock = entry_of(spec).with_name(entry_of(spec).name + ".lock")
    trust.make_dirs(lock.parent)
    lock.touch()
    os.chown(lock, OTHER_UID, OTHER_UID)
    with pytest.raises(trust.UntrustedCacheError, match="a build lock"):
        jit.load_spec(spec)


def _session_members(sid):
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


def test_killed_builder_takes_its_compilers_with_it(src, cache, procs):  # noqa: F811
    """SIGKILL of the building process alone (not its group): ninja and the compiler die too,
    long before the ~2 s compile would have ended."""
    builder = procs.start([spec_arg(src, "slow", headers=())], child_env(cache))
    deadline = time.monotonic() + 60
    while not [p for p in _session_members(builder.pid) if p != builder.pid and _is_compiler(p)]:
        assert builder.poll() is None and time.monotonic() < deadline, builder.communicate()
        time.sleep(0.02)
    os.kill(builder.pid, signal.SIGKILL)
    builder.communicate()
    left = _session_members(builder.pid)
    deadline = time.monotonic() + 1.5
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _session_members(builder.pid)
    assert not left, [(p, Path(f"/proc/{p}/stat").read_text()[:80], Path(f"/proc/{p}/cmdline").read_bytes()[:200])
                      for p in left if Path(f"/proc/{p}").exists()]


def _is_compiler(pid):
    try:
        return b"slow.cpp" in Path(f"/proc/{pid}/cmdline").read_bytes() and \
            b"ninja" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
