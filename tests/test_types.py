"""mypy over the package, at the strictness pyproject.toml's [tool.mypy] sets: CI fails on a type error.

The package folders are installed as one namespace (`berth.planner` from planner/, ...; pyproject's
[tool.setuptools.package-dir]) and there is no berth/ folder for mypy to find, so the test builds
one: a berth/ of links to the folders in a temporary directory, then `mypy -p berth` there, one run.
"""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
MYPY_TIMEOUT_S = 600  # a cold cache checks the package and the torch it imports in ~30 s on 2 shared cores


def test_mypy_is_clean(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")
    package_dirs = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    berth = tmp_path / "berth"
    berth.mkdir()
    for package, folder in package_dirs.items():
        namespace, name = package.split(".")
        assert namespace == "berth", package
        (berth / name).symlink_to(ROOT / folder, target_is_directory=True)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(PYPROJECT),
            "--cache-dir",
            str(tmp_path / ".mypy_cache"),
            "-p",
            "berth",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=MYPY_TIMEOUT_S,
    )
    assert run.returncode == 0, f"mypy found type errors (exit {run.returncode}):\n{run.stdout}{run.stderr}"
