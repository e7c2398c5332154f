"""``flexpipe run --predict`` replays the measured last step with its ops' own durations: the
report carries the replayed makespan next to the predicted and measured ones, and the
profiled posting cost the prediction charged (the replay
itself is checked against hand-worked and simulated steps in ``tests/test_replay.py``)."""

from __future__ import annotations

import json

import pytest

from flexpipe.cli.main import main
from flexpipe.runtime.measurement.then_profile import train_then_profile_task
from flexpipe.runtime.processes import launch


def test_run_predict_reports_the_replayed_step(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One launch: the ranks that trained profile the stages (``then_profile``)."""
    starts: list[object] = []
    once = launch._launch_once
    monkeypatch.setattr(launch, "_launch_once", lambda task, *a: starts.append(task) or
                        once(task, *a))
    code = main(["run", "zb-h1", "-p", "2", "-m", "4", "--steps", "2", "--predict", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert starts == [train_then_profile_task]
    report = json.loads(out[out.index("{"):])
    replayed, measured = report["replayed_makespan_ms"], report["measured_makespan_ms"]
    predicted = report["predicted_makespan_ms"]
    assert 0.0 < predicted and 0.0 < replayed < 3 * measured
    assert 0.0 <= report.get("profiled_post_ms", 0.0) < float("inf")  # gloo: the posting cost


def test_run_predict_with_ep_costs_the_run_s_own_last_step(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--predict --ep 2``: the passes are costed from the run's last step (their all-to-alls
    with the other ``ep`` rank inside), no activation peak predicted; a schedule whose pairs
    run their passes at once is refused by name before anything starts."""
    code = main(["run", "1f1b", "-p", "2", "-m", "4", "--model", "moe", "--ep", "2",
                 "--experts", "4", "--steps", "2", "--predict", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out[out.index("{"):])
    predicted, measured = report["predicted_makespan_ms"], report["measured_makespan_ms"]
    assert 0.0 < predicted < 3 * measured and 0.0 < report["replayed_makespan_ms"]
    assert "predicted_activation_peak_bytes" not in report
    code = main(["run", "dualpipev", "-p", "2", "-m", "4", "--model", "moe", "--ep", "2",
                 "--experts", "4", "--predict", "--dry-run"])
    assert code == 2
    assert "dualpipev's overlapped pairs run their passes at once" in capsys.readouterr().err
