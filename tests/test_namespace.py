"""One installed namespace, `berth`: the packages keep their folders (specs/, hardware_profiles/,
topology/, cost_models/, planner/, executor/, launch/, api/, cli/) and are imported as `berth.specs`, ...
(pyproject's package-dir).

- the wheel holds only `berth/` and its dist-info, every package folder and data file included;
- installed from that wheel, `berth.planner` is the wheel's, run from the repo root (whose bare
  `planner/` folder is then on sys.path) or from elsewhere, and no module loads under a bare name;
- no file imports, or runs with `-m`, a bare package name (`planner`, `specs`, `cli`, ...): the same
  module under two names would be two module objects (two ClusterSpec classes).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specs", "hardware_profiles", "topology", "cost_models", "planner", "executor", "launch", "api", "cli")
PACKAGE_DATA = {
    "specs": ["*.json"],
    "hardware_profiles": ["devices/*.json", "servers/*.json", "nvidia_smi_names.json"],
}
SCANNED = [*PACKAGES, "tests", "benchmarks"]
BARE = "|".join(PACKAGES)
# a module path held in a string: "cli.main", "api.app:create_app"
MODULE_STRING = re.compile(rf"({BARE})(\.\w+)+(:\w+)?")
# code or a command held in a string: "from cli.main import main", "python -m executor.worker"
CODE_IN_STRING = re.compile(rf"(?<![\w.])(from\s+({BARE})(\.\w+)*\s+import\b|import\s+({BARE})\b|-m\s+({BARE})\b)")
DOCS = [ROOT / "README.md", ROOT / "Dockerfile", ROOT / ".ci" / "run", *sorted((ROOT / "docs").glob("*.md"))]


def _python_files() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def _bare_uses(text: str, name: str, strings: bool = True) -> list[str]:
    """Where the Python source `text` imports a bare package, or holds one in a string as a module
    path ("cli.main", "api.app:create_app") or inside code or a command ("-m executor.worker")."""
    found = []
    for node in ast.walk(ast.parse(text, filename=name)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            s = node.value
            path = ROOT / s.split(":")[0].replace(".", "/")
            module = MODULE_STRING.fullmatch(s) and (
                path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
            )
            if module or CODE_IN_STRING.search(s):
                found.append(f"{name}:{node.lineno}: string {s[:80]!r}")
        found += [f"{name}:{node.lineno}: import {n}" for n in names if n.split(".")[0] in PACKAGES]
    return found


def test_scan_catches_the_old_style():
    """The scan below finds each form it forbids, and passes the new style."""
    old = (
        "import planner.search\nfrom api.app import create_app\nfrom executor import worker\n"
        "def f():\n    from cost_models.step import x\n"
        'CMD = ["-m", "cli.main"]\nAPP = "api.app:create_app"\nCODE = "from cli.main import main"\n'
        'SH = "python -m executor.worker --plans p.json"\n'
        'import berth.planner.search\nfrom berth.api.app import create_app\nOK = ["-m", "berth.cli.main"]\n'
        'NOT_A_MODULE = "api.sqlite"\nPACKAGE = "specs.hardware"\n'
    )
    found = [hit.split(": ", 1)[1] for hit in _bare_uses(old, "old.py")]
    assert sorted(found) == sorted(
        [
            "import planner.search",
            "import api.app",
            "import executor",
            "import cost_models.step",
            "string 'cli.main'",
            "string 'api.app:create_app'",
            "string 'from cli.main import main'",
            "string 'python -m executor.worker --plans p.json'",
            "string 'specs.hardware'",
        ]
    )


def test_no_file_imports_or_runs_a_bare_package():
    this = Path(__file__).resolve()  # its strings hold the old style on purpose (the scan's own test)
    found = [hit for p in _python_files() for hit in _bare_uses(p.read_text(), str(p.relative_to(ROOT)), p != this)]
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if CODE_IN_STRING.search(line):
                found.append(f"{doc.relative_to(ROOT)}:{n}: {line.strip()[:80]}")
    assert not found, "write berth.planner (not planner), ...:\n" + "\n".join(found)


def _wheel(tmp_path: Path) -> Path:
    """berth's wheel, built by setuptools (no network, no build isolation) from a copy of the
    sources, so the checkout is left as it is."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    build = f"from setuptools import build_meta; build_meta.build_wheel({str(out)!r})"
    r = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = out.glob("berth-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("needs setuptools (the build backend; in the dev extra)")
    return _wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_only_berth_with_every_package_and_data_file(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    (info,) = tops - {"berth"}
    assert tops == {"berth", info} and info.endswith(".dist-info"), tops
    assert "berth/__init__.py" not in names  # a namespace package over the five
    expected = {
        f"berth/{p.relative_to(ROOT).as_posix()}"
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    expected |= {
        f"berth/{p.relative_to(ROOT).as_posix()}"
        for pkg, globs in PACKAGE_DATA.items()
        for g in globs
        for p in (ROOT / pkg).glob(g)
    }
    assert expected <= set(names), sorted(expected - set(names))
    assert len([n for n in names if n.endswith(".json")]) >= 10  # the profiles and presets
    zf = zipfile.ZipFile(wheel)
    assert zf.read(f"{info}/top_level.txt").decode().split() == ["berth"]
    assert "berth = berth.cli.main:main" in zf.read(f"{info}/entry_points.txt").decode()


def _run_installed(site: Path, cwd: Path, code: str) -> subprocess.CompletedProcess:
    """Python with the unpacked wheel first on its path and the test environment's dependencies
    after it, without site (-S: no editable-install finder from a .pth file): a regular install."""
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sorted(deps)]), "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


CHECK = """
import json, sys
from berth.cli.main import main
import berth.specs.tree as specs
from berth.hardware_profiles import load_device
from berth.planner.planning import make_cluster
assert make_cluster("dgx-h100", 1).__class__ is specs.ClusterSpec
try:
    main(["plan", "tiny-gpt", "--cluster", "dgx-h100", "--top", "1", "--json"])
except SystemExit as done:
    assert done.code in (0, None), done.code
bare = sorted(m for m in sys.modules if m.split(".")[0] in BARE_PACKAGES)
sys.stderr.write("\\nRESULT " + json.dumps({"specs": specs.__file__, "bare": bare,
                                           "device": load_device("h100-sxm").name}))
""".replace("BARE_PACKAGES", repr(PACKAGES))


@pytest.mark.parametrize("where", ["repo root", "elsewhere"])
def test_installed_wheel_resolves_berth_to_itself_from_the_repo_root_and_elsewhere(wheel, tmp_path, where):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    r = _run_installed(site, ROOT if where == "repo root" else tmp_path, CHECK)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["plans"]  # the presets and profiles (package data) came with the wheel
    result = json.loads(r.stderr.rsplit("RESULT ", 1)[1])
    assert Path(result["specs"]).resolve() == (site / "berth" / "specs" / "tree.py").resolve()
    assert result["bare"] == [] and result["device"]


def test_every_module_imports_under_berth_only_from_the_repo_root(tmp_path):
    """This environment's berth (editable or regular), imported module by module from the repo root
    (the bare folders then on sys.path): no module loads under a bare name, and each resolves to one
    file whether imported from the root or from elsewhere. The executor's torch modules are left to
    its own tests (importing torch twice would make this the slowest test here)."""
    mods = [
        f"berth.{p.relative_to(ROOT).with_suffix('').as_posix().replace('/', '.')}".removesuffix(".__init__")
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if "__pycache__" not in p.parts
        and (pkg != "executor" or p.name in ("__init__.py", "checks.py", "breakdown.py"))
    ]
    code = f"""
import importlib, json, sys
files = {{m: importlib.import_module(m).__file__ for m in {mods!r}}}
bare = sorted(m for m in sys.modules if m.split(".")[0] in {set(PACKAGES)!r})
print(json.dumps({{"files": files, "bare": bare}}))
"""
    seen = []
    for cwd in (ROOT, tmp_path):
        r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        seen.append(json.loads(r.stdout))
    assert seen[0]["bare"] == [] and seen[1]["bare"] == []
    assert seen[0]["files"] == seen[1]["files"]
    assert len(seen[0]["files"]) == len(mods) > 25
