"""The one domain exception for user input. The API turns it into 422, the CLI into exit 2."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class BerthError(ValueError):
    """Bad user input: names the field, the offending value and what is wrong."""

    def __init__(self, field: str, value: Any, problem: str):
        self.field, self.value, self.problem = field, value, problem
        super().__init__(f"{field}={_short(value)}: {problem}")

    def __reduce__(self):  # crosses process boundaries (the service builds large clusters in a child)
        return (type(self), (self.field, self.value, self.problem))

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "value": _jsonable(self.value), "problem": self.problem}


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else _short(value)


def from_validation_error(err: ValidationError, prefix: str = "") -> BerthError:
    """The first pydantic error as a BerthError naming the dotted field and its value; a key the spec does not have
    first, with the fields missing (a misspelt key is both: `num_layer` given, `num_layers` missing)."""
    errors = err.errors()
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    missing = ", ".join(".".join(map(str, e["loc"])) for e in errors if e.get("type") == "missing")
    loc = ".".join(str(p) for p in first.get("loc", ()))
    field = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "input")
    msg = first.get("msg", "invalid") + (f" (missing: {missing})" if missing and first is not errors[0] else "")
    return BerthError(field, first.get("input"), msg.removeprefix("Value error, "))
