"""``--exact`` says what it proves; ``exact_placements`` proves across placements."""

from __future__ import annotations

from flexpipe.search import search


def test_exact_claim_names_the_placement_and_split_mode() -> None:
    res = search(None, 2, 4, 2.0, exact=True, time_limit=10)
    assert res.exact is not None
    claim = str(res.exact["claim"])
    assert claim.startswith("proven optimal for the") and "split B/W" in claim
    assert "other placements and split modes were not searched" in claim


def test_exact_placements_proves_across_every_simulated_placement() -> None:
    res = search(None, 2, 4, 2.0, exact=True, time_limit=10, exact_placements=True,
                 objective="span")  # CP-SAT proves the span optimal
    assert res.exact is not None
    across = res.exact["across"]
    assert isinstance(across, dict) and len(across) >= 2
    assert all(v["status"] == "OPTIMAL" for v in across.values())
    assert str(res.exact["across_claim"]).startswith("proven optimal across")
    best = min(float(v["objective"]) for v in across.values())
    assert res.best_trial is not None and res.best_trial.span is not None
    assert res.best_trial.span <= best * (1 + 1e-2)
