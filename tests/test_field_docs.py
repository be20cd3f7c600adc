"""Every field of the spec tree (specs/tree.py) and of the API's bodies (api/schemas.py) has a
description: it is what the OpenAPI schema and the plan JSON schema show a reader (units and
meaning). A new field without one fails here."""

import inspect

import pytest
from pydantic import BaseModel, Field

from berth.api import schemas
from berth.specs import tree as specs


def models_of(module) -> list[type[BaseModel]]:
    """The pydantic models defined in `module` (not the ones it imports)."""
    return [
        c
        for c in vars(module).values()
        if inspect.isclass(c) and issubclass(c, BaseModel) and c.__module__ == module.__name__
    ]


def undocumented(models: list[type[BaseModel]]) -> list[str]:
    return [
        f"{m.__name__}.{name}"
        for m in models
        for name, info in m.model_fields.items()
        if not (info.description or "").strip()
    ]


@pytest.mark.parametrize("module", [specs, schemas], ids=["specs", "schemas"])
def test_every_field_has_a_description(module):
    models = models_of(module)
    assert len(models) >= 10, f"found only {len(models)} models in {module.__name__}"
    missing = undocumented(models)
    assert not missing, f"fields without Field(..., description=...) in {module.__name__}: {missing}"


def test_the_walk_finds_an_undocumented_field():
    class Sample(BaseModel):
        plain: int = 0
        blank: int = Field(default=0, description=" ")
        documented: int = Field(default=0, description="seconds per step")

    assert undocumented([Sample]) == ["Sample.plain", "Sample.blank"]
