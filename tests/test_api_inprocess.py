"""The routers in-process (fastapi.testclient over ASGI, no server process), with the app's
`get_service` dependency overridden by another real Service: its own SQLite file in a tmp dir,
or worker pools held busy. The tests over a real `berth serve` stay in tests/test_api.py and
tests/test_security.py."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from fastapi.testclient import TestClient

from berth.api.app import create_app
from berth.api.service import Service, Workers, get_service
from berth.api.settings import Settings
from berth.planner.store import Store

TINY = {
    "model": "tiny-gpt",
    "training": {"seq_len": 128, "global_batch_size": 16},
    "cluster": {"preset": "dgx-h100"},
    "search": {"top": 2},
}


@pytest.fixture
def overridden(tmp_path):
    """An app on one store whose routes are handed another Service (a second store), and that
    Service; both closed afterwards."""

    def make(**settings):
        service = Service(Settings(store_path=str(tmp_path / "override.sqlite"), **settings))
        app = create_app(Settings(store_path=str(tmp_path / "app.sqlite")))
        app.dependency_overrides[get_service] = lambda: service
        made.append(service)
        return app, service

    made: list[Service] = []
    yield make
    for service in made:
        service.close()


def _hold(pool: Workers, release: threading.Event, runs: bool) -> None:
    """One job in `pool`, through its own bounded `run`, until `release` is set; returns once the
    job holds a thread (`runs`) or a place in the queue."""
    placed = threading.Event()

    def work() -> None:
        placed.set()
        release.wait(30)

    async def job() -> None:
        task = asyncio.ensure_future(pool.run(work))
        await asyncio.sleep(0)  # the task has counted itself and submitted its job
        if not runs:
            placed.set()
        with contextlib.suppress(asyncio.CancelledError):  # the pool shut down with the job queued
            await task

    threading.Thread(target=asyncio.run, args=(job(),), daemon=True).start()
    assert placed.wait(10)


def test_answers_go_to_the_overriding_service_store(overridden, tmp_path):
    app, service = overridden()
    with TestClient(app) as client:
        r = client.post("/v1/plans", json=TINY)
        assert r.status_code == 200, r.text
        plan_id = r.json()["id"]
        assert client.get(f"/v1/plans/{plan_id}").json()["plans"] == r.json()["plans"]
        r = client.post("/v1/launch", json={"plan_id": plan_id, "pick": 1, "format": "slurm"})
        assert r.status_code == 200 and "berth.sbatch" in r.json()["files"], r.text
        assert client.get("/healthz").json()["validation_enabled"] is False
    service.writer.stop()  # the row is on disk
    assert Store(str(tmp_path / "override.sqlite")).get_plan(plan_id)["response"]["id"] == plan_id
    assert Store(str(tmp_path / "app.sqlite")).get_plan(plan_id) is None


def test_a_queued_search_over_budget_is_503_and_a_full_queue_429_in_process(overridden):
    app, service = overridden(request_timeout_s=0.5, max_concurrent_searches=1, max_queued_requests=1)
    body = {**TINY, "training": {"seq_len": 256, "global_batch_size": 32}}  # not in the plan cache
    release = threading.Event()
    try:
        _hold(service.searches, release, runs=True)  # the one search thread busy
        with TestClient(app) as client:
            r = client.post("/v1/plans", json=body)  # waits in the queue past its budget
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "0.5 s budget" in r.json()["detail"]
            _hold(service.searches, release, runs=False)  # and now the one queue place taken too
            r = client.post("/v1/plans", json={**body, "search": {"top": 3}})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert "search: 2 requests running or queued" in r.json()["detail"]
            assert client.get("/healthz").status_code == 200
    finally:
        release.set()


def test_validation_routes_follow_the_overriding_settings(overridden):
    app, _ = overridden()
    with TestClient(app) as client:
        r = client.post("/v1/validations", json={"plan_id": "x" * 32}, headers={"X-API-Key": "k"})
        assert r.status_code == 403 and "disabled" in r.json()["detail"]
    app, _ = overridden(validation_enabled=True, api_key="secret-secret-secret")
    with TestClient(app) as client:
        r = client.get("/v1/validations/nope", headers={"X-API-Key": "wrong"})
        assert r.status_code == 401, r.text


def test_strict_json_and_body_limit_in_process(tmp_path):
    app = create_app(Settings(store_path=str(tmp_path / "api.sqlite"), max_body_bytes=2000))
    with TestClient(app) as client:
        text = (
            '{"model": "tiny-gpt", "training": {"seq_len": NaN, "global_batch_size": 16}, '
            '"cluster": {"preset": "dgx-h100"}}'
        )
        r = client.post("/v1/plans", content=text, headers={"content-type": "application/json"})
        assert r.status_code == 422 and "NaN" in r.text, r.text
        r = client.post("/v1/plans", content=b"{" + b" " * 3000 + b"}", headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        r = client.post("/v1/plans", json={**TINY, "training": {"seq_len": 128, "global_batch_size": 0}})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][:2] == ["body", "training"], r.text


def test_a_model_type_that_is_no_text_is_422_in_process(tmp_path):
    """An HF config whose model_type is a list is refused naming the field (it was a 500)."""
    app = create_app(Settings(store_path=str(tmp_path / "app.sqlite")))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/plans", json={**TINY, "model": {"model_type": ["llama"], "hidden_size": 64}})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "model", "model_type"]
