"""Service settings, from the environment (prefix BERTH_), e.g. BERTH_STORE_PATH=/data/berth.sqlite.
Every queue, store and connection is bounded; the README's "REST service" section lists them."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MIN_KEY_LENGTH = 16


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BERTH_", extra="ignore")

    store_path: str | None = Field(default=None, description="SQLite file; default ~/.local/share/berth/berth.sqlite")
    max_gpus: int = Field(default=65_536, gt=0, description="largest cluster a request may plan for")
    max_candidates: int = Field(default=2_000_000, gt=0, description="most layouts one search may score")
    request_timeout_s: float = Field(default=10.0, gt=0, description="time budget of one whole request")
    max_concurrent_searches: int = Field(default=2, gt=0, description="searches running at once (CPU-bound)")
    max_queued_requests: int = Field(
        default=64, ge=0, description="requests waiting for a worker thread; beyond that 429 with Retry-After at once"
    )
    max_body_bytes: int = Field(default=1_048_576, gt=0, description="largest request body")
    store_max_plans: int = Field(default=1_000_000, gt=0, description="plan ids kept (oldest dropped first)")
    store_max_bytes: int = Field(default=1 << 30, gt=0, description="distinct answers' JSON kept, in bytes")
    store_retention_days: float | None = Field(default=None, gt=0, description="drop plan ids older than this")
    validation_enabled: bool = Field(default=False, description="allow POST /v1/validations (runs the executor)")
    api_key: str | None = Field(default=None, description="required in X-API-Key for validations")
    max_queued_validations: int = Field(default=4, gt=0, description="validations queued or running; beyond 429")
    timeout_keep_alive_s: float = Field(default=5.0, gt=0, description="idle keep-alive connections closed after")
    header_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="a request's headers (and body) must arrive within this; slower connections are closed",
    )
    write_timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="an answer the client does not read within this is dropped"
    )
    limit_concurrency: int = Field(
        default=256,
        gt=0,
        le=65_536,
        description="connections at once; a new one takes the slot of the longest-reading one, else 503",
    )
    max_connections_per_client: int = Field(
        default=64, gt=0, le=65_536, description="connections at once from one client address (same rule)"
    )
    max_header_bytes: int = Field(default=16_384, gt=0, le=1 << 20, description="largest request head; beyond 431")
    max_answer_ranks: int = Field(
        default=65_536,
        gt=0,
        le=1 << 24,
        description="plans x GPUs one answer may list (each plan lists every rank's placement); beyond 422",
    )
    allowed_hosts: str | None = Field(
        default=None,
        max_length=4096,
        description="comma-separated Host header values accepted (e.g. 'berth.example.com,127.0.0.1'); "
        "other hosts get 400. Unset: any host",
    )

    @field_validator("api_key")
    @classmethod
    def _key_length(cls, key: str | None) -> str | None:
        if key is not None and (len(key.strip()) < MIN_KEY_LENGTH or key != key.strip()):
            raise ValueError(
                f"an API key needs at least {MIN_KEY_LENGTH} characters and no leading or trailing space "
                "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        return key

    @model_validator(mode="after")
    def _key_for_validations(self) -> Settings:
        if self.validation_enabled and not self.api_key:
            raise ValueError("BERTH_VALIDATION_ENABLED=1 needs BERTH_API_KEY: validations run code on this host")
        if self.max_connections_per_client > self.limit_concurrency:
            self.max_connections_per_client = self.limit_concurrency
        return self

    def hosts(self) -> frozenset[str] | None:
        """The allowed Host values (lowercase, without port), or None for any."""
        if not self.allowed_hosts:
            return None
        return frozenset(h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip())
