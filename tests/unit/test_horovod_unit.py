"""The horovod backend's plumbing that needs no Horovod: launch detection, horovodrun
command, backend registry, and build.sh's "disabled, not failed" exit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.backends import BACKENDS, backend_status
from shardwise.context import resolve_backend
from shardwise.core.errors import ConfigError
from shardwise.core.launch_env import LaunchInfo, detect_launch
from shardwise.cli.launch import build_horovodrun_command

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "scripts" / "horovod" / "build.sh"


def test_horovodrun_gloo_environment_is_detected() -> None:
    env = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"}
    assert detect_launch(env) == LaunchInfo("horovodrun", 1, 4, 1, 2)
    # horovodrun --mpi / mpirun set OpenMPI's variables too: those win.
    env.update(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4")
    assert detect_launch(env).launcher == "openmpi"


def test_horovod_is_registered() -> None:
    assert BACKENDS["horovod"] == ("shardwise.backends.horovod", "horovod")
    assert "horovod" in backend_status()


def test_auto_backend_under_horovodrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDWISE_BACKEND", raising=False)
    if backend_status()["horovod"] != "available":
        pytest.skip("horovod is not installed")
    assert resolve_backend(None, LaunchInfo("horovodrun", 0, 2, 0, 2)) == "horovod"


def test_build_horovodrun_command(tmp_path: Path) -> None:
    fake = str(tmp_path / "horovodrun")
    cmd = ["python", "train.py"]
    assert build_horovodrun_command(2, cmd, path=fake) == [fake, "-np", "2", "--gloo", "-H", "localhost:2"] + cmd
    assert build_horovodrun_command(4, cmd, hosts="a:2,b:2", path=fake)[3:6] == ["--gloo", "-H", "a:2,b:2"]
    with pytest.raises(ConfigError, match="no command"):
        build_horovodrun_command(2, [], path=fake)
    with pytest.raises(ConfigError, match="-np"):
        build_horovodrun_command(0, cmd, path=fake)


def test_cli_run_horovodrun_dry_run(tmp_path: Path) -> None:
    fake = tmp_path / "horovodrun"
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "run", "--horovodrun", "--launcher", str(fake),
                          "-np", "2", "--dry-run", "--", "python", "x.py"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(fake), "-np", "2", "--gloo", "-H", "localhost:2", "python", "x.py"]


@pytest.mark.parametrize("require, code", [("0", 0), ("1", 1)])
def test_build_script_outside_a_venv_disables_instead_of_failing(require: str, code: int) -> None:
    """Without a venv python the build stops at once: exit 0 ("disabled"), or 1 when Horovod is required."""
    base = getattr(sys, "_base_executable", None) or "/usr/bin/python3"
    probe = subprocess.run([base, "-c", "import sys; print(sys.prefix != sys.base_prefix)"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != "False":
        pytest.skip("no non-venv python to try")
    out = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHON=base, SHARDWISE_REQUIRE_HOROVOD=require))
    assert out.returncode == code, out.stdout + out.stderr
    assert "Horovod backend disabled" in out.stderr


def test_patch_is_a_unified_diff_of_the_three_cmake_files() -> None:
    text = (ROOT / "scripts" / "horovod" / "horovod-0.28.1.patch").read_text()
    files = [line.split()[1] for line in text.splitlines() if line.startswith("+++ ")]
    assert files == ["b/CMakeLists.txt", "b/horovod/tensorflow/CMakeLists.txt", "b/horovod/torch/CMakeLists.txt"]
    assert text.count("+set(CMAKE_CXX_STANDARD 17)") == 1 and "+    set(CMAKE_CXX_STANDARD 17)" in text
