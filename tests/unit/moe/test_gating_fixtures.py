"""slipstream.moe.gating.route against real DeepSpeed's gating: the committed numbers in
tests/fixtures/moe_gating/deepspeed_gating.json (written by make_gating_fixtures.py; no DeepSpeed needed), and,
where the peer environment of bench/make_peer_venv.sh exists, the same cases regenerated live.

Every case must give DeepSpeed's capacity, exp_counts, l_aux, and the same (token, expert, slot) nonzeros of
combine_weights with the same weights. One exception, named in its case: top-1 without random token selection
over capacity, where DeepSpeed keeps whichever of an expert's tied tokens `torch.topk` returns (an order torch
leaves unspecified) and Slipstream keeps the first ones; there the kept count per expert must agree."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from slipstream.moe.gating import GateRules, route

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parents[1] / "fixtures" / "moe_gating" / "deepspeed_gating.json"


def slipstream_decision(case: dict) -> tuple[dict, list[list]]:
    """Slipstream's gate on the case's logits, in the fixture's terms; and its routes as [token, expert, slot,
    weight], sorted."""
    logits = torch.tensor(case["logits"], dtype=torch.float32)
    torch.manual_seed(case["seed"])  # DeepSpeed was called right after the same seeding
    rules = GateRules(
        k=case["k"],
        capacity_factor=case["capacity_factor"],
        min_capacity=case["min_capacity"],
        drop_tokens=case["drop_tokens"],
        use_rts=case["use_rts"],
        top2_2nd_expert_sampling=False,
    )
    routes = route(logits, rules)
    kept = (routes.experts >= 0).nonzero().tolist()  # [route, token]
    nonzeros = sorted(
        [s, int(routes.experts[r, s]), int(routes.slots[r, s]), float(routes.weights[r, s])] for r, s in kept
    )
    summary = {"l_aux": float(routes.l_aux), "capacity": routes.capacity, "exp_counts": routes.exp_counts.tolist()}
    return summary, nonzeros


def tie_order_unspecified(case: dict) -> bool:
    """Top-1 without random token selection that drops tokens (see the module docstring)."""
    expected = case["deepspeed"]
    return case["k"] == 1 and not case["use_rts"] and len(expected["routes"]) < sum(expected["exp_counts"])


def assert_matches_deepspeed(case: dict) -> None:
    name, expected = case["name"], case["deepspeed"]
    summary, nonzeros = slipstream_decision(case)
    assert summary["capacity"] == expected["capacity"], f"{name}: capacity {summary['capacity']} != DeepSpeed's"
    assert summary["exp_counts"] == expected["exp_counts"], f"{name}: exp_counts {summary['exp_counts']}"
    assert math.isclose(summary["l_aux"], expected["l_aux"], rel_tol=1e-5), (
        f"{name}: l_aux {summary['l_aux']} != DeepSpeed's {expected['l_aux']}"
    )
    if tie_order_unspecified(case):
        per_expert = [sum(1 for n in nonzeros if n[1] == e) for e in range(len(expected["exp_counts"]))]
        want = [sum(1 for n in expected["routes"] if n[1] == e) for e in range(len(expected["exp_counts"]))]
        assert per_expert == want, f"{name}: kept per expert {per_expert} != DeepSpeed's {want}"
        return
    got_places = [n[:3] for n in nonzeros]
    want_places = [n[:3] for n in expected["routes"]]
    missing = [p for p in want_places if p not in got_places][:5]
    extra = [p for p in got_places if p not in want_places][:5]
    assert got_places == want_places, f"{name}: (token, expert, slot) only DeepSpeed's {missing}, only ours {extra}"
    for got, want in zip(nonzeros, expected["routes"]):
        assert math.isclose(got[3], want[3], rel_tol=1e-5), f"{name}: weight of {got[:3]} {got[3]} != {want[3]}"


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cases"]


def test_the_fixtures_cover_k_1_to_4_with_drops_and_dropless() -> None:
    cases = load(FIXTURE)
    assert {c["k"] for c in cases} == {1, 2, 3, 4}
    for k in (1, 2, 3):
        mine = [c for c in cases if c["k"] == k]
        assert any(len(c["deepspeed"]["routes"]) < sum(c["deepspeed"]["exp_counts"]) for c in mine), k
        assert any(not c["drop_tokens"] for c in mine), k


@pytest.mark.parametrize("case", load(FIXTURE), ids=lambda c: c["name"])
def test_routes_and_l_aux_match_deepspeeds_committed_outputs(case: dict) -> None:
    assert_matches_deepspeed(case)


def peer_python() -> str | None:
    """The DeepSpeed peer interpreter (SLIPSTREAM_PEER_PYTHON, else .bench-venv), if it imports deepspeed."""
    candidate = os.environ.get("SLIPSTREAM_PEER_PYTHON") or str(HERE.parents[2] / ".bench-venv/bin/python")
    if not Path(candidate).is_file():
        return None
    probe = subprocess.run([candidate, "-c", "import deepspeed"], capture_output=True, timeout=300)
    return candidate if probe.returncode == 0 else None


def test_routes_and_l_aux_match_deepspeed_regenerated_live(tmp_path: Path) -> None:
    """make_gating_fixtures.py run now in DeepSpeed's environment: its outputs equal the committed ones for the
    same logits, and Slipstream matches them."""
    peer = peer_python()
    if peer is None:
        pytest.skip("DeepSpeed peer environment absent (bench/make_peer_venv.sh creates it)")
    out = tmp_path / "live.json"
    done = subprocess.run(
        [peer, str(HERE / "make_gating_fixtures.py"), str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    committed = {c["name"]: c for c in load(FIXTURE)}
    for case in load(out):
        assert_matches_deepspeed(case)
        before = committed.get(case["name"])
        if before is not None and before["logits"] == case["logits"]:  # DeepSpeed still gives the committed outputs
            now, then = case["deepspeed"], before["deepspeed"]
            assert [now[key] for key in ("capacity", "exp_counts")] == [then[key] for key in ("capacity", "exp_counts")]
            assert [r[:3] for r in now["routes"]] == [r[:3] for r in then["routes"]], case["name"]
            torch.testing.assert_close(
                torch.tensor([now["l_aux"]] + [r[3] for r in now["routes"]]),
                torch.tensor([then["l_aux"]] + [r[3] for r in then["routes"]]),
            )
