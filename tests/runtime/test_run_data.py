"""``flexpipe run`` as a training job, end to end on 2 gloo ranks: the shipped text sample
(bytes), a warm-up and cosine decay of the lr, clipping, the validation loss and the metrics
file; the loss falls, and a run resumed from its own checkpoint repeats the uninterrupted run's
losses exactly (the data position and the lr are the step's); resumed at another (pp, dp), it
continues an uninterrupted run there (slow; ``test_checkpoint_reshard.py`` runs by default)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flexpipe.cli.main import main

SAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_text.txt")
STEPS = 8
RUN = ["run", "1f1b", "-p", "2", "-m", "2", "--micro-batch-size", "4", "--data", SAMPLE,
       "--lr", "3e-3", "--warmup-steps", "2", "--decay-type", "cosine", "--max-norm", "1.0",
       "--steps", str(STEPS), "--json", "--timeout", "120"]


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    """The JSON report of ``flexpipe run`` with ``RUN`` and ``argv``."""
    assert main([*RUN, *argv]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_a_run_on_the_sample_learns_logs_and_resumes_exactly(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, run_dir = tmp_path / "ck", tmp_path / "run"
    whole = report(capsys, "--checkpoint-dir", str(folder), "--checkpoint-every", "4",
                   "--run-dir", str(run_dir), "--val-every", "4", "--log-every", "2")
    losses = whole["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, losses
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    head, steps = lines[0], lines[1:]
    assert head["event"] == "run" and head["step_flops"] > 0 and head["world"] == 2
    assert [r["step"] for r in steps] == [2, 4, 6, 8]
    assert [r["loss"] for r in steps] == [losses[k - 1] for k in (2, 4, 6, 8)]
    assert steps[0]["lr"] == pytest.approx(3e-3 * 2 / 3)  # torchtitan's warm-up, step 2 of 2
    assert 3e-3 > steps[1]["lr"] > steps[2]["lr"] > steps[3]["lr"]  # cosine decay
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["peak_memory_bytes"] > 0
               for r in steps)
    vals = [r.get("val_loss") for r in steps]
    assert vals[0] is None and vals[1] is not None and vals[3] is not None
    assert vals[3] < vals[1] and whole["val_loss"] == vals[3]

    shutil.rmtree(folder / f"step-{STEPS:08d}")  # back to the checkpoint before step 5
    resumed = report(capsys, "--checkpoint-dir", str(folder), "--checkpoint-every", "4")
    assert resumed["first_step"] == 4
    assert resumed["losses"] == losses[4:]  # bit for bit


def test_a_checkpoint_of_other_data_is_refused(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder, other = tmp_path / "ck", tmp_path / "other.txt"
    report(capsys, "--checkpoint-dir", str(folder), "--steps", "1")
    other.write_text(Path(SAMPLE).read_text(encoding="utf-8")[::-1], encoding="utf-8")
    code = main([*RUN, "--steps", "2", "--checkpoint-dir", str(folder), "--data", str(other)])
    assert code != 0
    assert "was written for data" in capsys.readouterr().err
    synthetic = [a for a in RUN if a not in ("--data", SAMPLE)]  # the synthetic text instead
    assert main([*synthetic, "--steps", "2", "--checkpoint-dir", str(folder)]) != 0
    assert "was written for data" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_resumes_its_checkpoint_at_another_pp_and_dp(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Trained 2 steps at pp 2 x dp 1 (m 2), resumed at pp 1 x dp 2 (m 1: the same 8
    sequences a step) to step 4: the losses of steps 3 and 4 are an uninterrupted pp 1 x dp 2
    run's to rtol 1e-12 in float64 (the first steps' gradient sums ran in another order; the
    state and the data position carry over exactly: docs/runtime.md, Checkpoints)."""
    folder = tmp_path / "ck"
    base = [*RUN, "--dtype", "float64", "--layers", "2", "--steps", "4"]
    other = [*base, "--dp", "2"]
    other[other.index("-p") + 1] = other[other.index("-m") + 1] = "1"

    def run(argv: list[str]) -> tuple[dict, str]:  # type: ignore[type-arg]
        assert main(argv) == 0
        out, err = capfd.readouterr()
        return json.loads(out), err

    run([*base, "--steps", "2", "--checkpoint-dir", str(folder)])
    resumed, err = run([*other, "--checkpoint-dir", str(folder)])
    assert resumed["first_step"] == 2, err
    assert "written at pp 2, dp 1, tp 1, resharded onto pp 1, dp 2, tp 1" in err, err
    whole, _ = run(other)
    assert resumed["losses"] == pytest.approx(whole["losses"][2:], rel=1e-12, abs=0)
    assert whole["losses"][3] < whole["losses"][0]
