"""One floor per role (docs/design.md, "Floors"): every import of a berth package, at module level or
inside a function, and every module path held in a string ("-m berth.executor.worker"), points to the
same package or to one on a lower floor; nothing runs back up. Drawn from the source with `ast`."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the ground first; packages on one floor may not import each other
FLOORS: tuple[tuple[str, ...], ...] = (
    ("specs",),  # the vocabulary: spec tree, axes, errors, layouts, presets, stages, rule and engine tables
    ("hardware_profiles",),  # the bundled device and server profiles, and their loader
    ("topology",),  # the cluster: a graph of GPUs and links, its fabric levels, presets and this machine
    ("cost_models",),  # pure, vectorized cost terms
    ("planner",),  # inputs, topology, search, placement, plans, probes, calibration
    ("executor",),  # running a plan with torch.distributed
    ("launch",),  # each engine's launch files (the torchrun ones run the executor)
    ("api",),  # the REST service
    ("cli",),  # the command line, its tables and figures
)
FLOOR = {package: i for i, floor in enumerate(FLOORS) for package in floor}
MODULE_IN_STRING = re.compile(r"berth(\.\w+)+(:\w+)?")  # "berth.executor.worker", "berth.api.app:create_app"
LARGEST_PACKAGE_LINES = 4000


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, berth package) of every import of a berth package in `path`, and of every string that
    names a berth module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a file name such as "berth.sqlite" is no module path: only strings that name a package count
            s = node.value
            names = [s] if MODULE_IN_STRING.fullmatch(s) and s.split(".")[1].split(":")[0] in FLOOR else []
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("berth.") and n.count(".") >= 1]
    return found


def _package_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_package_has_a_floor():
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {name.split(".")[1] for name in dirs} == set(FLOOR)
    assert list(FLOOR) == [name.split(".")[1] for name in dirs], "pyproject lists the packages floor by floor"


def test_no_import_runs_upward_or_sideways():
    wrong = []
    for package, floor in FLOOR.items():
        for path in _package_files(package):
            for line, target in _imports(path):
                if target == package:
                    continue
                if target not in FLOOR:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: berth.{target} is no package")
                elif FLOOR[target] >= floor:
                    wrong.append(
                        f"{path.relative_to(ROOT)}:{line}: {package} (floor {floor}) imports {target} "
                        f"(floor {FLOOR[target]})"
                    )
    assert not wrong, "\n".join(wrong)


def test_the_scan_sees_every_form(tmp_path):
    """The scan finds a module-level import, one inside a function and a module path in a string."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from berth.cli.main import main\n"
        "def f():\n    import berth.api.app\n"
        'CMD = ["-m", "berth.executor.worker"]\n'
        "from berth.specs import tree\n"
    )
    assert sorted(t for _, t in _imports(probe)) == ["api", "cli", "executor", "specs"]


def test_the_largest_package_is_under_4000_lines():
    lines = {p: sum(len(f.read_text().splitlines()) for f in _package_files(p)) for p in FLOOR}
    assert max(lines.values()) < LARGEST_PACKAGE_LINES, lines
