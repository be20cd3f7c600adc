"""The repository stands alone: a clone in an empty directory runs the suite's data-dependent checks.

The reference data (H100 measurements, published runs, hardware facts) are part of the repository,
in benchmarks/data/reference/ with their provenance. Nothing may send a reader, a test or a
benchmark to a folder beside the checkout: a user's clone has none.

The clone test copies the files git tracks (what a clone of the commit holds, with the working
tree's content) into a fresh directory with nothing beside it, and runs there every test file that
reads the reference data (the ones calling tests/conftest.py `require_reference` or naming
`REFERENCE`), with that copy first on the import path."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import REFERENCE, layer_fidelity, memory_fidelity, published, single_gpu
from tests import conftest

ROOT = Path(__file__).resolve().parents[1]
SIBLING = re.compile(r"\.\./" + "shared|" + "shared/" + "reference")  # split so this file does not match itself
DATA_TESTS = re.compile(r"\brequire_reference\b|\bREFERENCE\b")


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the files a clone holds are the ones git tracks")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return [name for name in out.stdout.split("\0") if name and (ROOT / name).exists()]


def test_no_tracked_file_points_outside_the_repository():
    found = []
    for name in _tracked():
        path = ROOT / name
        if path.is_symlink() or path.suffix in {".png", ".sqlite", ".whl"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [
            f"{name}:{n}: {line.strip()[:100]}" for n, line in enumerate(text.splitlines(), 1) if SIBLING.search(line)
        ]
    assert not found, "name the in-repository copy (benchmarks/data/reference/...):\n" + "\n".join(found)


def test_every_named_reference_file_exists():
    """Each `benchmarks/data/reference/<file>` a tracked file names (a profile's sources, a docstring, a
    document) is in the repository."""
    named = re.compile(r"benchmarks/data/reference/([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*)")
    missing = []
    for name in _tracked():
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".json", ".toml", ".txt"} or path.is_symlink():
            continue
        for target in named.findall(path.read_text()):
            if not (REFERENCE / target.rstrip(".")).exists():
                missing.append(f"{name}: {target}")
    assert not missing, missing


def test_every_reference_path_resolves_inside_the_repository():
    assert REFERENCE == ROOT / "benchmarks" / "data" / "reference"
    assert conftest.REFERENCE == REFERENCE
    for path in (layer_fidelity.REFERENCE, single_gpu.REFERENCE, memory_fidelity.REFERENCE, published.REFERENCE):
        assert path.is_relative_to(ROOT) and path.is_dir(), path
    assert (REFERENCE / "PROVENANCE.md").is_file()
    needed = [
        *(
            layer_fidelity.REFERENCE / f"{n}.json"
            for n in ("gemm", "attention", "layer", "head", "optimizer", "bandwidth")
        ),
        single_gpu.REFERENCE / "full-step-runs.json",
        memory_fidelity.REFERENCE / "h100-microbench" / "mem_detail.json",
        *(published.REFERENCE / n for n in published.FILES),
        *published.LOCAL_FILES,
    ]
    missing = [str(p) for p in needed if not p.is_file()]
    assert not missing, missing
    tracked = set(_tracked())
    untracked = [str(p.relative_to(ROOT)) for p in needed if str(p.relative_to(ROOT)) not in tracked]
    assert not untracked, f"reference data not tracked by git (a clone would lack them): {untracked}"


def _data_tests() -> list[str]:
    return sorted(
        f"tests/{p.name}"
        for p in (ROOT / "tests").glob("test_*.py")
        if p != Path(__file__).resolve()
        if DATA_TESTS.search(p.read_text())
    )


def test_a_clone_with_no_sibling_folder_runs_the_data_dependent_tests(tmp_path):
    clone = tmp_path / "empty" / "berth"
    for name in _tracked():
        dest = clone / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest, follow_symlinks=False)
    assert sorted(os.listdir(clone.parent)) == ["berth"]  # nothing beside the clone
    tests = _data_tests()
    assert {"tests/test_golden.py", "tests/test_compute.py", "tests/test_memory_fidelity.py"} <= set(tests), tests

    env = {**os.environ, "PYTHONPATH": str(clone), "PYTHONDONTWRITEBYTECODE": "1"}
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import benchmarks, tests.conftest as c; print(benchmarks.REFERENCE); print(c.REFERENCE)",
        ],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.split() == [str(clone / "benchmarks" / "data" / "reference")] * 2  # the clone's data, not ours

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", *tests],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 50 and "reference data missing" not in run.stdout, tail
