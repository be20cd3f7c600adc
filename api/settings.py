"""Service settings, from the environment (prefix BERTH_), e.g. BERTH_STORE_PATH=/data/berth.sqlite."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BERTH_", extra="ignore")

    store_path: str | None = Field(default=None, description="SQLite file; default ~/.local/share/berth/berth.sqlite")
    max_gpus: int = Field(default=65_536, gt=0, description="largest cluster a request may plan for")
    max_candidates: int = Field(default=2_000_000, gt=0, description="most layouts one search may score")
    request_timeout_s: float = Field(default=10.0, gt=0, description="time budget of one search or compare")
    max_concurrent_searches: int = Field(default=2, gt=0, description="searches running at once (CPU-bound)")
    max_body_bytes: int = Field(default=1_048_576, gt=0, description="largest request body")
    validation_enabled: bool = Field(default=False, description="allow POST /v1/validations (runs the executor)")
    api_key: str | None = Field(default=None, description="required in X-API-Key for validations when set")
