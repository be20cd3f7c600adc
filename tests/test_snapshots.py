"""Contract snapshots: the REST service's OpenAPI schema, the plan JSON schema (what `berth plan
--json` writes and `berth validate/launch` read) and every CLI command's options, compared with
the files in tests/snapshots/. A change to any of them fails here until its snapshot is
regenerated on purpose and the diff reviewed with the change:

    BERTH_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/test_snapshots.py

Snapshots are written only when that variable is set, never as a side effect of a normal run.
"""

import difflib
import json
import os
from pathlib import Path
from typing import Any

import pytest

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("BERTH_UPDATE_SNAPSHOTS") == "1"
REGENERATE = "BERTH_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/test_snapshots.py"


def _compare(name: str, data: Any) -> None:
    path = SNAPSHOTS / name
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
        return
    if not path.is_file():
        pytest.fail(f"no snapshot {path}; write it with: {REGENERATE}", pytrace=False)
    old = path.read_text()
    if old != text:
        diff = "".join(list(difflib.unified_diff(old.splitlines(True), text.splitlines(True), str(path), "now"))[:80])
        pytest.fail(
            f"{name} changed (a contract change must be deliberate): review and regenerate with {REGENERATE}\n{diff}",
            pytrace=False,
        )


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def cli_options() -> dict[str, Any]:
    """Every command of `berth` with its arguments and options: names, flags, type, default,
    whether required, and help."""
    import typer

    from berth.cli.main import app

    group = typer.main.get_command(app)

    def kind_of(p) -> str:  # typer >= 0.24 keeps the annotation; older typer, click's type
        annotation = getattr(getattr(p, "type_descriptor", None), "annotation", None)
        if annotation is None:
            return str(p.type)
        return annotation.__name__ if isinstance(annotation, type) else str(annotation)

    def params(command) -> list[dict[str, Any]]:
        return [
            {
                "name": p.name,
                "kind": p.param_type_name,
                "opts": list(p.opts),
                "secondary_opts": list(p.secondary_opts),
                "type": kind_of(p),
                "required": p.required,
                "multiple": p.multiple,
                "default": _jsonable(p.default),
                "help": getattr(p, "help", None),
            }
            for p in command.params
        ]

    return {
        "berth": params(group),
        "commands": {
            name: {"help": (cmd.help or "").strip(), "params": params(cmd)}
            for name, cmd in sorted(group.commands.items())
        },
    }


def test_openapi_schema(tmp_path):
    from berth.api.app import create_app
    from berth.api.settings import Settings

    _compare("openapi.json", create_app(Settings(store_path=str(tmp_path / "api.sqlite"))).openapi())


def test_plan_json_schema():
    from berth.specs.tree import Plan

    _compare("plan.schema.json", Plan.model_json_schema())


def test_cli_options():
    _compare("cli-options.json", cli_options())


def test_a_changed_contract_fails_with_the_diff_and_how_to_regenerate(tmp_path, monkeypatch):
    """The comparison itself can fail: a snapshot that differs names the change and the command."""
    import tests.test_snapshots as me

    monkeypatch.setattr(me, "SNAPSHOTS", tmp_path)
    monkeypatch.setattr(me, "UPDATE", False)
    (tmp_path / "x.json").write_text(json.dumps({"a": 1}, indent=2) + "\n")
    me._compare("x.json", {"a": 1})
    with pytest.raises(pytest.fail.Exception, match="BERTH_UPDATE_SNAPSHOTS=1") as err:
        me._compare("x.json", {"a": 2})
    assert '-  "a": 1' in str(err.value) and '+  "a": 2' in str(err.value)
    with pytest.raises(pytest.fail.Exception, match="no snapshot"):
        me._compare("missing.json", {})
