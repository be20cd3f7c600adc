""" "Pick plan N" is written once (specs/tree.py plan_listing and pick_plan): `berth validate/launch
--pick` and the API's `pick` (launch, validations) read a listing the same way and refuse the same
way, naming the field and the value."""

import json

import pytest
from fastapi.testclient import TestClient

from berth.api.app import create_app
from berth.api.settings import Settings
from berth.cli.main import main
from berth.planner.search import predict_layouts
from berth.specs.errors import BerthError
from berth.specs.models import load_model
from berth.specs.tree import Layout, TrainingSpec, pick_plan, plan_listing
from berth.topology.clusters import cluster_from_preset


@pytest.fixture(scope="module")
def plans():
    layouts = [
        Layout(tp=1, dp=8, micro_batch_size=1, num_microbatches=2),
        Layout(tp=2, dp=4, micro_batch_size=2, num_microbatches=1),
    ]
    found = predict_layouts(
        load_model("tiny-gpt"),
        TrainingSpec(seq_len=128, global_batch_size=16),
        cluster_from_preset("dgx-h100", 1),
        layouts,
    )
    return [p.model_dump(mode="json") for p in found]


def test_every_listing_shape_and_every_pick(plans):
    probe = {"engine": "executor", "picks": [{"layout": "x", "why": "y", "plan": p} for p in plans]}  # probe --json
    for listing in ({"plans": plans}, {"candidates": plans}, plans, probe):
        assert plan_listing(listing) == plans
        assert [pick_plan(plan_listing(listing), n, "x").layout.tp for n in (1, 2)] == [1, 2]
    assert plan_listing(plans[1]) == [plans[1]]  # one plan object
    assert plan_listing("text") is None and plan_listing({"plans": "x"}) is None
    for pick in (0, 3, -1):
        with pytest.raises(BerthError) as err:
            pick_plan(plans, pick, "the file")
        assert err.value.field == "pick" and err.value.value == pick
        assert err.value.problem == "the file holds 2 plans (numbered 1..2)"
    with pytest.raises(BerthError, match="holds 0 plans$"):
        pick_plan([], 1, "plan abc")
    broken = {**plans[0], "layout": {**plans[0]["layout"], "tp": "eight"}}
    with pytest.raises(BerthError) as err:
        pick_plan([broken], 1, "the file")
    assert err.value.field == "plan.layout.tp"


def test_the_cli_and_the_api_refuse_a_pick_alike(plans, tmp_path, capsys):
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"plans": plans}))
    with pytest.raises(SystemExit) as code:
        main(["launch", str(path), "--pick", "3", "--out", str(tmp_path / "out")])
    assert code.value.code == 2
    cli = capsys.readouterr().err.strip()
    assert cli.endswith("pick=3: the file holds 2 plans (numbered 1..2)"), cli
    with TestClient(create_app(Settings(store_path=str(tmp_path / "api.sqlite")))) as client:
        r = client.post(
            "/v1/plans",
            json={
                "model": "tiny-gpt",
                "training": {"seq_len": 128, "global_batch_size": 16},
                "cluster": {"preset": "dgx-h100"},
                "search": {"top": 2},
            },
        )
        assert r.status_code == 200, r.text
        plan_id, n = r.json()["id"], len(r.json()["plans"])
        r = client.post("/v1/launch", json={"plan_id": plan_id, "pick": n + 1, "format": "slurm"})
        assert r.status_code == 422, r.text
        (detail,) = r.json()["detail"]
        assert detail["loc"] == ["body", "pick"] and detail["input"] == n + 1
        assert detail["msg"] == f"plan {plan_id} holds {n} plans (numbered 1..{n})"
        r = client.post("/v1/launch", json={"plan_id": plan_id, "pick": n, "format": "slurm"})
        assert r.status_code == 200 and "berth.sbatch" in r.json()["files"]
