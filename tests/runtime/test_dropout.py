"""Dropout under the pipeline (2 ranks, gloo): with a run seed every schedule — recompute and
the B/W split included — trains exactly like one device with the same seed; without one, a
recompute replays its forward's random numbers, so 1F1B with recompute equals plain 1F1B. The jobs
run in the 2-process launch every runtime test file shares (``shared_launch``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import shared_launch
import torch

from flexpipe.runtime.measurement.compare import by_name, worst_relative_error
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.reference import reference_run
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.schedules import registry

GPT = ModelSpec("gpt", layers=4, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2,
                dtype="float64", dropout=0.2)
SEEDED = TrainConfig(steps=2, capture=True, timeout_s=60, seed=7)
UNSEEDED = replace(SEEDED, seed=None)
SCHEDULES = ("1f1b", "1f1b-recompute", "zb-h1", "zb-v")
P, M = 2, 4


def _jobs() -> list[Job]:
    jobs = [Job(registry.build(n, P, M), GPT, SEEDED) for n in SCHEDULES]
    return jobs + [Job(registry.build(n, P, M), GPT, UNSEEDED)
                   for n in ("1f1b", "1f1b-recompute")]


shared_launch.register(P, "dropout", lambda: shared_launch.jobs(_jobs(), P))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_dropout_is_exact_under_every_schedule_and_recompute() -> None:
    results = shared_launch.job_results(P, "dropout")
    assert len(results) == len(SCHEDULES) + 2
    ref = reference_run(GPT, SEEDED, M)
    for name, ranks in zip(SCHEDULES, results, strict=False):
        grads = by_name(ranks, "grads")
        assert worst_relative_error(grads, ref.grads)[1] < 1e-9, name
        assert worst_relative_error(by_name(ranks, "params"), ref.params)[1] < 1e-9, name
    plain, recomputed = (by_name(r, "grads") for r in results[len(SCHEDULES):])
    assert all(torch.equal(plain[k], recomputed[k]) for k in plain)
    unseeded_ref = reference_run(GPT, UNSEEDED, M)  # another stream: dropout really acts
    assert worst_relative_error(plain, unseeded_ref.grads)[1] > 1e-6
