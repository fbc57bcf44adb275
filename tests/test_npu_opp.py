"""``python -m cam_jit opp``: locate / install / build with fake CANN trees, fake ``.run``
packages (bash scripts that install like a custom opp package) and fake kernel source trees."""
import json
from pathlib import Path

import pytest

from cam_jit.__main__ import main
from cam_jit.ascend import discover, opp, opp_install

ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH", "ASCEND_CUSTOM_OPP_PATH",
            "SHMEM_HOME_PATH", "CAM_JIT_OPP_DIR")

# A custom opp package: installs vendors/<name>/ with op-info, library and set_env.bash under
# --install-path, as CANN's custom opp .run packages do.
FAKE_RUN = r"""#!/bin/bash
set -e
dest=""
for a in "$@"; do case "$a" in --install-path=*) dest="${a#--install-path=}";; esac; done
[ -n "$dest" ] || { echo "no --install-path" >&2; exit 2; }
v="$dest/vendors/cam_ops"
mkdir -p "$v/op_api/lib" "$v/bin" "$v/op_impl/ai_core/tbe/config/ascend910_93"
printf 'aclnnA2eGetWorkspaceSize\0' > "$v/op_api/lib/libcust_opapi.so"
echo '{"A2e": {"input0": {"name": "x"}}}' > "$v/op_impl/ai_core/tbe/config/ascend910_93/aic-ascend910_93-ops-info.json"
echo "export ASCEND_CUSTOM_OPP_PATH=$v:\${ASCEND_CUSTOM_OPP_PATH}" > "$v/bin/set_env.bash"
echo "args: $*" > "$dest/install.log"
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(discover, "DEFAULT_CANN_ROOTS", ())
    monkeypatch.setattr(opp_install, "DEFAULT_INSTALL_DIR", tmp_path / "default_opp")


@pytest.fixture
def cann(tmp_path, monkeypatch):
    home = tmp_path / "cann"
    (home / "lib64").mkdir(parents=True)
    (home / "set_env.sh").write_text("")
    (home / "version.info").write_text("Version=8.2.RC1\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
    return home


@pytest.fixture
def run_file(tmp_path):
    path = tmp_path / "CANN-custom_ops-linux.x86_64.run"
    path.write_text(FAKE_RUN)
    return path


def test_install_needs_cann(run_file, tmp_path, capsys):
    assert main(["opp", "install", str(run_file), "--dir", str(tmp_path / "opp")]) == 1
    err = capsys.readouterr().err
    assert f"cannot install {run_file.name}: CANN not found" in err and "set_env.sh" in err
    assert not (tmp_path / "opp").exists()


def test_install_then_locate_then_activate(cann, run_file, tmp_path, monkeypatch, capsys):
    target = tmp_path / "opp"
    assert main(["opp", "install", str(run_file), "--dir", str(target)]) == 0
    vendor = target / "vendors" / "cam_ops"
    out = capsys.readouterr().out
    assert f"installed {vendor}; activate with: source {vendor / 'bin' / 'set_env.bash'}" in out
    assert "--quiet" in (target / "install.log").read_text()
    assert opp.find_vendors(discover.find_cann()).searched == ()  # not active yet

    found = opp_install.locate([target])
    assert [(f.vendor.path, f.ops, f.active) for f in found] == [(vendor, ["a2e"], False)]
    monkeypatch.setenv("ASCEND_CUSTOM_OPP_PATH", str(vendor))
    assert main(["opp", "locate"]) == 0
    assert f"{vendor} [ASCEND_CUSTOM_OPP_PATH[0]] (active): a2e" in capsys.readouterr().out


def test_install_default_dir_from_env(cann, run_file, tmp_path, monkeypatch):
    monkeypatch.setenv("CAM_JIT_OPP_DIR", str(tmp_path / "mine"))
    assert opp_install.install_run(run_file) == [tmp_path / "mine" / "vendors" / "cam_ops"]


def test_install_failures_are_explained(cann, tmp_path):
    broken = tmp_path / "broken.run"
    broken.write_text("#!/bin/bash\necho 'checking CANN...'\necho 'incompatible CANN' >&2\nexit 3\n")
    with pytest.raises(opp_install.OppError, match=r"(?s)installing broken.run failed \(exit 3\).*incompatible CANN"):
        opp_install.install_run(broken, tmp_path / "opp")
    empty = tmp_path / "empty.run"
    empty.write_text("#!/bin/bash\nexit 0\n")
    with pytest.raises(opp_install.OppError, match="created no vendor directory"):
        opp_install.install_run(empty, tmp_path / "opp")
    with pytest.raises(opp_install.OppError, match="no such file"):
        opp_install.install_run(tmp_path / "absent.run", tmp_path / "opp")


def test_locate_reports_nothing(capsys):
    assert main(["opp", "locate"]) == 1
    assert "no installed opp vendor holds a CAM operator" in capsys.readouterr().out


@pytest.fixture
def source_tree(tmp_path):
    tree = tmp_path / "umdk"
    tree.mkdir()
    (tree / "build.sh").write_text(
        "#!/bin/bash\nset -e\necho \"$@\" > build_args.txt\nmkdir -p build_out\n"
        f"cat > build_out/custom_opp_cam.run <<'EOF'\n{FAKE_RUN}EOF\n")
    return tree


def test_build_needs_cann_and_a_build_script(source_tree, tmp_path):
    with pytest.raises(opp_install.OppError, match="cannot build the opp package in .*CANN not found"):
        opp_install.build_from_source(source_tree)
    with pytest.raises(opp_install.OppError, match="neither build/cam/build.sh nor build.sh in it"):
        opp_install.build_from_source(tmp_path)


def test_build_then_install(cann, source_tree, tmp_path, capsys):
    target = tmp_path / "opp"
    assert main(["opp", "build", str(source_tree), "--install", "--dir", str(target), "--", "-q"]) == 0
    captured = capsys.readouterr()
    assert (source_tree / "build_args.txt").read_text().strip() == "-q"
    assert f"built {source_tree / 'build_out' / 'custom_opp_cam.run'}" in captured.out
    assert f"installed {target / 'vendors' / 'cam_ops'}" in captured.out
    assert "SHMEM_HOME_PATH is not set" in captured.err and "moe_dispatch_layout_zb" in captured.err
    info = target / "vendors" / "cam_ops" / "op_impl" / "ai_core" / "tbe" / "config" / "ascend910_93"
    assert json.loads(next(info.glob("*.json")).read_text()) == {"A2e": {"input0": {"name": "x"}}}


def test_build_failure_shows_the_script_output(cann, source_tree):
    (source_tree / "build.sh").write_text("#!/bin/bash\necho 'ccec: error: bad kernel' >&2\nexit 1\n")
    with pytest.raises(opp_install.OppError, match=r"(?s)failed \(exit 1\).*ccec: error: bad kernel"):
        opp_install.build_from_source(source_tree)
    (source_tree / "build.sh").write_text("#!/bin/bash\nexit 0\n")
    with pytest.raises(opp_install.OppError, match="wrote no .run package"):
        opp_install.build_from_source(Path(source_tree))
