"""The contract ships with the package and nothing shipped points to a document that does not.

docs/semantics.md is the numerical and interface contract; it is installed as
cam_jit/_docs/semantics.md and printed by `python -m cam_jit docs [SECTION]`. The working
specification it was written from is not shipped, so no shipped file may refer to it.
"""
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = "SPEC" + ".md"  # spelled apart so this file does not match itself
SHIPPED = ("cam_jit", "kernels", "wrappers", "ge_converters", "docs", "samples", "benchmarks",
           "README.md", "pyproject.toml", "cam_jit_cli.py")
_SKIP_DIRS = {"__pycache__", ".pytest_cache", "build"}


def _shipped_files():
    for top in SHIPPED:
        path = REPO / top
        if path.is_file():
            yield path
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
            for name in files:
                yield Path(root) / name


def test_no_shipped_file_mentions_the_working_spec():
    offenders = [f"{path.relative_to(REPO)}:{n}" for path in _shipped_files()
                 for n, line in enumerate(path.read_bytes().decode("utf-8", "replace").splitlines(), 1)
                 if FORBIDDEN in line or re.search(r"\bSPEC §", line)]
    assert offenders == []


def test_every_section_reference_exists():
    """Each `docs/semantics.md §N.M` in a shipped file names a section the document has."""
    from cam_jit import docs

    known = set(docs.sections())
    refs = set()
    for path in _shipped_files():
        text = path.read_bytes().decode("utf-8", "replace")
        for chain in re.findall(r"semantics\.md,? (§[0-9.]+(?:(?:,|/| and|-) ?§[0-9.]+)*)", text):
            refs.update((str(path.relative_to(REPO)), ref.rstrip(".")) for ref in re.findall(r"§([0-9.]+)", chain))
    assert refs, "no references found: the pattern is wrong"
    assert sorted(r for r in refs if r[1] not in known) == []


def test_cli_prints_the_contract_and_one_section():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "cam_jit", "docs", "1.8"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("### 1.8 W8A8 arithmetic")
    assert "b = m * (1/127)" in run.stdout and "### 1.9" not in run.stdout
    bad = subprocess.run([sys.executable, "-m", "cam_jit", "docs", "42.7"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "no section '42.7'" in bad.stderr and "1.8" in bad.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout (the build writes build/ and *.egg-info)."""
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src") / "cam_jit"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "tests", "__pycache__", ".pytest_cache",
                                                             "build", "*.egg-info", "dist"))
    out = tmp_path_factory.mktemp("wheel")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (path,) = out.glob("*.whl")
    return path


def test_wheel_ships_the_contract_and_no_spec_reference(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "cam_jit/_docs/semantics.md" in names and "cam_jit_cli.py" in names
        assert "cam-jit = cam_jit_cli:main" in next(z.read(n).decode() for n in names
                                                     if n.endswith("entry_points.txt"))
        assert z.read("cam_jit/_docs/semantics.md") == (REPO / "docs" / "semantics.md").read_bytes()
        offenders = [n for n in names if FORBIDDEN.encode() in z.read(n)]
    assert offenders == []


def test_installed_layout_finds_the_shipped_docs(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path)
    code = "from cam_jit import docs; print(docs.semantics_path()); print(docs.semantics('0.7').splitlines()[0])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert run.returncode == 0, run.stderr
    path, heading = run.stdout.splitlines()
    assert path == str(tmp_path / "cam_jit" / "_docs" / "semantics.md")
    assert heading == "### 0.7 Names"
