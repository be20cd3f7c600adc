"""Every command the README and the user documents show (docs/guide.md, docs/accuracy.md), run as
written (in order, in one scratch directory, as a user pasting them would), so the documents cannot
drift from what berth does; and the README's promises: its length, the set-up commands CI runs, every
REST endpoint, every column and term of the plan and compare tables defined, every link resolving.

A few commands are skipped, each with its reason (SKIP); a few are shrunk where the README's
size would make CI slow, keeping the command itself (REWRITES): validations run 1 step, and the
rescore scores a slice of the saved measurements. `berth profile` takes minutes, so the profile
it would write is the one the accuracy benchmark measured on this kind of machine."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from berth.hardware_profiles import PROFILE_FORMAT

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "docs" / "guide.md", ROOT / "docs" / "accuracy.md"]  # the documents whose commands run
README_MAX_LINES = 250  # issue 29: a README a user reads in ten minutes
MEASUREMENTS = ROOT / "benchmarks" / "results" / "accuracy-vm-measurements.json"

SKIP = {  # a command's first words -> why the test does not run it
    "python3 -m venv": "creates the virtualenv this test runs in",
    ".venv/bin/pip install": "installs the package this test runs from",
    "pip install": "installs the package this test runs from",
    ".venv/bin/ruff check": "CI runs the linter itself",
    ".venv/bin/ruff format": "CI runs the formatter's check itself",
    ".venv/bin/python -m pytest": "the test suite itself",
    "berth serve": "starts a server that runs until stopped (tests/test_api.py serves the API over HTTP)",
    "curl": "needs the server `berth serve` starts",
    "docker": "needs a Docker daemon",
    "berth profile": "measures this machine for minutes (tests/test_profiles.py runs `berth profile --quick`); "
    "the profile it writes is stood in by one the accuracy benchmark measured",
    "python -m benchmarks.accuracy": "measures every layout for about 35 minutes",  # the bare run, not --rescore
}


NEEDS_TORCH = {  # a command's first words -> why it needs torch (the executor extra); skipped without it
    "berth validate": "runs the plan with torch.distributed",
    "berth report": "shows the report `berth validate` wrote",
    "berth calibrate": "fits the reports `berth validate` stored",
    "python -m benchmarks.accuracy": "imports the executor's profiler",
    "python -m benchmarks.layer_fidelity": "runs the executor's layer",
}
GPU_BLOCK = "# on a machine with an NVIDIA GPU"  # a README block's first line: its commands need a GPU
GPU_PREFIX = "GPU: "


def _closed(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return True


def _readme_commands(doc: Path = README) -> list[tuple[int, str]]:
    """(line number, command) of every command in a document's ```bash blocks: continuation lines
    joined, `a && b` split, comments dropped."""
    out, block, start, gpu_block = [], None, 0, False
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            block = line.strip() == "```bash" if block is None else None
            gpu_block = block and i + 1 < len(lines) and lines[i + 1].strip() == GPU_BLOCK
            i += 1
            continue
        if block:
            start = i + 1
            text = line
            while text.rstrip().endswith("\\") or not _closed(text):
                i += 1
                text = (text.rstrip()[:-1] if text.rstrip().endswith("\\") else text) + " " + lines[i].strip()
            text = re.sub(r"\s+#\s.*$", "", text).strip()  # trailing comment
            if text and not text.startswith("#"):
                prefix = GPU_PREFIX if gpu_block else ""
                out += [(start, prefix + part.strip()) for part in text.split(" && ")]
        i += 1
    return out


COMMANDS = [(doc.relative_to(ROOT).as_posix(), n, cmd) for doc in DOCS for n, cmd in _readme_commands(doc)]


def _skip_reason(cmd: str) -> str | None:
    if cmd.startswith(GPU_PREFIX):
        return (
            "needs an NVIDIA GPU: tests/test_gpu_paths.py plans, compares and validates on `--cluster local` "
            "with a fake nvidia-smi, and tests/test_gpu_validation_script.py runs the GPU evidence script's "
            "commands on CPU workers"
        )
    torchless = importlib.util.find_spec("torch") is None
    why = next((why for prefix, why in NEEDS_TORCH.items() if cmd.startswith(prefix)), None)
    if torchless and why:
        return f"needs torch (the executor extra): {why}"
    if cmd.startswith("python -m benchmarks.accuracy") and "--rescore" in cmd:
        return None
    if cmd.startswith("berth report") and "--png" in cmd and importlib.util.find_spec("matplotlib") is None:
        return "needs matplotlib (the plot extra; tests/test_breakdown.py checks the exit 2 without it)"
    return next((why for prefix, why in SKIP.items() if cmd.startswith(prefix)), None)


def _rewrite(cmd: str, work: Path) -> str:
    """The README's command made CI-sized (see the module docstring); everything else as written."""
    cmd = cmd.replace(".venv/bin/berth ", "berth ")
    if cmd.startswith("berth validate"):
        cmd = re.sub(r"--steps \d+", "", re.sub(r"--warmup \d+", "", cmd)) + " --steps 1 --warmup 0"
    if "--rescore" in cmd:
        cmd = cmd.replace(str(MEASUREMENTS.relative_to(ROOT)), str(work / "measurements-slice.json"))
    return cmd


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The scratch directory: the example clusters, an HF config at path/to/config.json, a
    profile and a slice of the saved accuracy measurements."""
    w = tmp_path_factory.mktemp("readme")
    (w / "examples").symlink_to(ROOT / "examples")
    (w / "path" / "to").mkdir(parents=True)
    (w / "path" / "to" / "config.json").write_text(
        json.dumps(
            {  # Llama 3 8B's config.json
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "max_position_embeddings": 8192,
                "rope_theta": 500000.0,
                "torch_dtype": "bfloat16",
            }
        )
    )
    saved = json.loads(MEASUREMENTS.read_text())
    (w / "my-machine.json").write_text(json.dumps({"format": PROFILE_FORMAT, **saved["runs"][0]["profile"]}))
    run = saved["runs"][0]
    keep = 16
    sliced = {**run, "layouts": run["layouts"][:keep], "results": [p[:keep] for p in run["results"]]}
    (w / "measurements-slice.json").write_text(json.dumps({**saved, "runs": [sliced]}))
    return w


def _check_output(cmd: str, out: str, work: Path) -> None:
    """The shape the README promises for each kind of command."""
    words = shlex.split(cmd.split(">")[0])
    target = cmd.split(">")[1].strip() if ">" in cmd else None
    if target:
        data = json.loads((work / target).read_text())
        assert data.get("plans"), f"{target} holds no plan"
        return
    if "--json" in words:
        data = json.loads(out)
        assert data.get("plans") or data.get("candidates") or data.get("measured"), out[:300]
    elif "--csv" in words:
        rows = list(csv.DictReader(io.StringIO(out)))
        assert rows and {"tp", "pp", "dp", "tokens_per_s"} <= set(rows[0])
    elif words[:2] == ["berth", "plan"]:
        assert "tokens/s" in out and "searched" in out and "placement of #1" in out
    elif words[:2] == ["berth", "compare"]:
        assert "candidates" in out and "best searched layout" in out
    elif words[:2] == ["berth", "launch"]:
        assert "launch of" in out and "wrote" in out
    elif words[:2] == ["berth", "topology"]:
        assert "fast domains" in out and (work / words[words.index("--out") + 1]).is_file()
    elif words[:2] == ["berth", "validate"]:
        assert "stored in" in out
    elif words[:2] == ["berth", "report"]:
        assert "step terms, rank" in out and "largest error:" in out and "trace.json" in out
        if "--png" in words:
            assert len(list((work / words[words.index("--png") + 1]).glob("*.png"))) == 2
    elif words[:2] == ["berth", "calibrate"] and "--runs" in words:
        assert "fitted on" in out and "held out" in out and (work / words[words.index("--out") + 1]).is_file()
    elif words[:2] == ["berth", "calibrate"]:
        assert "calibration on" in out and (work / words[words.index("--out") + 1]).is_file()
    elif "--rescore" in words:
        assert "calibrated_cross_validated" in out and "not saved" in out


def test_readme_has_commands():
    tour = {c.split()[1] for _, c in _readme_commands() if c.startswith("berth ")}
    assert {"plan", "compare", "launch", "serve", "validate", "report", "probe", "calibrate"} <= tour
    kinds = {c.split()[1] for _, _, c in COMMANDS if c.startswith("berth ")}
    assert {"plan", "compare", "launch", "validate", "topology", "calibrate", "profile", "report"} <= kinds


@pytest.mark.parametrize("doc,line,cmd", COMMANDS, ids=[f"{d}:L{n}:{c[:50]}" for d, n, c in COMMANDS])
def test_readme_command(work, doc, line, cmd):
    why = _skip_reason(cmd)
    if why:
        pytest.skip(why)
    run = _rewrite(cmd, work)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "100",
        "BERTH_STORE_PATH": str(work / "default-store.sqlite"),
    }
    results = ROOT / "benchmarks" / "results"
    saved = {p: p.read_bytes() for p in results.rglob("*") if p.is_file()}
    try:
        r = subprocess.run(["bash", "-c", run], cwd=work, capture_output=True, text=True, timeout=300, env=env)
    finally:  # a documented benchmark saves its figures: the committed ones are put back, the tree stays as it was
        for p in (p for p in results.rglob("*") if p.is_file() and saved.get(p) != p.read_bytes()):
            if p in saved:
                p.write_bytes(saved[p])
            else:
                p.unlink()
    assert r.returncode == 0, f"{doc} line {line}: {cmd}\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr
    _check_output(run, r.stdout, work)
    assert (ROOT / "benchmarks" / "results").is_dir()


# ---- what the README promises -----------------------------------------------------------------


def _blocks(doc: Path) -> list[str]:
    """The ```bash blocks of a document, in order, as written."""
    return re.findall(r"^```bash\n(.*?)^```", doc.read_text(), flags=re.M | re.S)


def _section(doc: Path, title: str) -> str:
    text = doc.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_readme_reads_in_ten_minutes():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the rest belongs in docs/"


def test_readme_set_up_commands_are_the_ones_ci_runs():
    """The README's first two commands: install and plan; install and run what .ci/run runs."""
    install, tests = (b.strip() for b in _blocks(README)[:2])
    assert install.startswith("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/berth plan ")
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd "))
    ]
    assert tests.split(" && ") == [part for line in ci for part in line.split(" && ")], (tests, ci)


def _routes() -> list[str]:
    """ "METHOD /path" of every route the service's routers declare."""
    found = []
    for path in sorted((ROOT / "api").glob("routes_*.py")):
        found += [
            f"{m.upper()} {p}"
            for m, p in re.findall(r'@router\.(get|post|put|patch|delete)\(\s*"([^"]+)"', path.read_text())
        ]
    return found


def test_readme_lists_every_rest_endpoint():
    routes = _routes()
    assert "POST /v1/launch" in routes and "GET /healthz" in routes and len(routes) >= 10, routes
    table = _section(README, "A five-minute tour")
    missing = [r for r in routes if f"`{r}`" not in table]
    assert not missing, f"endpoints the README's table does not list: {missing}"


def _table_headers(out: str) -> set[str]:
    """Column names of the plan/compare tables in berth's output: the wide table's header row (cells
    between ┃) and the narrow one's (cells apart by 2+ spaces, the line after the title that starts
    with #)."""
    names: set[str] = set()
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if "┃ # ┃" in line:
            names |= {c.strip() for c in line.split("┃") if c.strip()}
        elif line.strip().startswith("#   ") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= {"─"}:
            names |= set(re.split(r"\s{2,}", line.strip()))
    return names


def test_readme_defines_every_column_and_term():
    """Every column the plan and compare tables show (wide and narrow), every time and memory term of
    the breakdown, and every bottleneck name appears, in backticks, in "Reading the output"."""
    from berth.cost_models.step import BOTTLENECK_NAMES
    from berth.specs import terms

    model = ["llama3-70b", "--cluster", "dgx-h100", "--seq-len", "8192"]
    runs = [
        ["plan", *model, "--nodes", "8", "--global-batch", "256"],
        ["compare", *model, "--nodes", "2", "--global-batch", "64", "--layout", "tp=8,pp=2", "--layout", "tp=4,cp=2"],
    ]
    columns: set[str] = set()
    for args in runs:
        for width in ("250", "80"):
            env = {**os.environ, "COLUMNS": width}
            r = subprocess.run(
                [sys.executable, "-m", "berth.cli.main", *args], capture_output=True, text=True, timeout=120, env=env
            )
            assert r.returncode == 0, r.stderr[-2000:]
            columns |= _table_headers(r.stdout)
    assert {"#", "tp", "cp", "pp", "layout", "tokens/s", "bottleneck", "vs best"} <= columns, columns
    words = columns | {t.name for t in terms.TIME} | {t.name for t in terms.MEMORY} | set(BOTTLENECK_NAMES)
    words |= {"usable", "layers per stage"}  # the breakdown's last memory row and its pipeline row
    section = _section(README, "Reading the output")
    missing = sorted(w for w in words if f"`{w}`" not in section)
    assert not missing, f"README's 'Reading the output' does not define: {missing}"


def _slug(title: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return text.replace(" ", "-")


def test_links_in_the_documents_resolve():
    """Every relative link of the README and docs/*.md names a file of the repository and, with
    #anchor, a heading of that file."""
    broken = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target}")
            elif anchor and file.suffix == ".md":
                heads = {_slug(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)}
                if anchor not in heads:
                    broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken
