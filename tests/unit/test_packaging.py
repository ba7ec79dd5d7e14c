"""What `pip install` ships: every folder of Python modules under shardwise/ is a package setup.cfg finds."""

from __future__ import annotations

import configparser
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def _shipped() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    include = [p.strip() for p in cfg["options.packages.find"]["include"].split(",")]
    assert cfg["options"]["packages"].strip() == "find:"
    return set(find_packages(str(ROOT), include=include))


def test_every_module_folder_is_shipped() -> None:
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "shardwise").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert "shardwise.adapters.torch.checkpoint" in folders
    missing = sorted(folders - _shipped())
    assert not missing, f"folders of modules without __init__.py, left out of a non-editable install: {missing}"


def test_extras_give_ranges_and_constraints_pin_what_setup_installs() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = {name: [r.strip() for r in value.strip().splitlines() if r.strip()]
              for name, value in cfg["options.extras_require"].items()}
    assert extras["torch"] == ["torch>=2.4"] and "torch>=2.4" in extras["all"]
    assert extras["tf"] == ["tensorflow>=2.16"] and extras["tf-cpu"] == ["tensorflow-cpu>=2.16"]
    exact = [r for rs in extras.values() for r in rs if "==" in r.split(";")[0]]
    assert not exact, f"exact pins belong in constraints.txt, not in the extras: {exact}"
    pins = {line.split("==")[0]: line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")}
    assert pins["torch"] == "2.13.0" and "tensorflow-cpu" in pins and "mpi4py" in pins
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-c constraints.txt" in setup and "tf-cpu" in setup and "constraints.txt scripts/setup.sh" in setup
