"""W's share and the activation memory prediction on every model family of the matrix:
Hugging Face GPT-2, BERT, ViT, T5, Llama and a Mixtral mixture of experts (its experts batched,
and grouped as Hugging Face builds them by default; exported by torch.export) and a user's CNN
with BatchNorm and residuals (traced by torch.fx), tiny float64 (``mixtral-kernel``: the
grouped Mixtral in bfloat16, whose products are torch's grouped kernel) configs of
``tests/runtime/tiny_models.py``, cut at their blocks (2 stages; 4 for ZB-V) and trained
one step of m = 4 on 2 gloo ranks under 1F1B, ZB-H1 and ZB-V. Per model it prints W's
deferred share of each stage (the trainable weight elements whose gradient W computes) at 2
and 4 stages; per case the activation peak of each rank as the simulator predicts it from the
profiled M_B and M_W (what ``flexpipe run --predict`` prints) against the one the run measures
(live saved tensors, outputs kept for the next stage, W's inputs and output gradients, after
every op), and the worst error.

    PYTHONPATH=benchmarks:tests/runtime .venv/bin/python benchmarks/matrix_memory.py
        [--models gpt2 llama ...] [--schedules 1f1b zb-h1 zb-v] [--families [falcon ...]]

``--families`` runs the 51 further Hugging Face families of ``tests/runtime/hf_families.py``
(Qwen, Mistral, Gemma, Phi, Falcon, OPT, BLOOM, the MoEs, RoBERTa, BART, Swin, ...) instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "tests" / "runtime"
sys.path.insert(0, str(HERE))

import hf_families as hf  # noqa: E402
import tiny_models as tm  # noqa: E402

import flexpipe  # noqa: E402
from flexpipe.ir.lower import lower  # noqa: E402
from flexpipe.runtime.measurement.measure import measured_trace  # noqa: E402
from flexpipe.runtime.measurement.profile import profile  # noqa: E402
from flexpipe.runtime.measurement.shares import deferred_shares  # noqa: E402
from flexpipe.runtime.models.spec import ModelSpec  # noqa: E402
from flexpipe.runtime.processes.launch import launch  # noqa: E402
from flexpipe.runtime.processes.train import Job, TrainConfig  # noqa: E402
from flexpipe.runtime.user.tracing import split_points  # noqa: E402
from flexpipe.sim.engine import simulate  # noqa: E402
from flexpipe.specs import load  # noqa: E402

M, RANKS, MICRO = 4, 2, 4
SCHEDULES = ("1f1b", "zb-h1", "zb-v")


def shares(name: str, stages: int) -> list[float]:
    """W's deferred share of every stage of model ``name`` cut into ``stages``."""
    case = tm.MODELS[name]
    inputs, _ = case.batch(0, MICRO)
    points = case.points4 if stages == 4 else case.points2
    return deferred_shares(split_points(case.build(), points, inputs).segments, inputs, stages)


def spec(name: str, stages: int) -> ModelSpec:
    """Model ``name`` of ``tiny_models.MODELS`` cut into ``stages`` at its blocks."""
    case = tm.MODELS[name]
    points = case.points4 if stages == 4 else case.points2
    user = flexpipe.UserModel(case.build(), case.loss, case.batch(0, MICRO),
                              split_points=points)
    return ModelSpec("user", user=user)


def peaks(name: str, schedule: str) -> list[tuple[float, float]]:
    """(predicted, measured) activation peak of each rank, in bytes."""
    chain = load(schedule, RANKS, M)
    model = spec(name, chain.placement.num_stages)
    job = Job(chain, model, TrainConfig(steps=1, measure_memory=True))
    sched = job.schedule  # on the model's stage graph: skip edges from stage 0
    cost = profile(model, sched.placement, reps=1)
    predicted = simulate(lower(sched), cost).metrics().peak_activation
    measured = measured_trace(sched, launch([job], RANKS)[0]).metrics().peak_activation
    return list(zip(predicted, measured, strict=True))


def main() -> None:
    """Print one row per model and schedule, then the worst error."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=None, choices=list(tm.MODELS))
    ap.add_argument("--families", nargs="*", default=None, choices=list(hf.TABLE),
                    help="the families of tests/runtime/hf_families.py (all if none named) "
                         "instead of the matrix's models (both with --models)")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    args = ap.parse_args()
    families = [] if args.families is None else args.families or list(hf.TABLE)
    args.models = (args.models or ([] if families else list(tm.MODELS))) + families
    hf.register(tuple(families))
    t0, worst = time.perf_counter(), 0.0
    print(f"activation peak per rank, predicted vs measured: {RANKS} gloo ranks, m = {M}, "
          f"micro-batch {MICRO}, float64 (mixtral-kernel bfloat16)")
    print(f"{'model':<16}{'schedule':<8}  rank 0 (KiB)             rank 1 (KiB)")
    for name in args.models:
        for stages in (2, 4):
            got = " / ".join(f"{x:.3f}" for x in shares(name, stages))
            print(f"{name:<16}W's deferred share per stage ({stages} stages): {got}")
        for schedule in args.schedules:
            got = peaks(name, schedule)
            errs = [(p - q) / q for p, q in got]
            worst = max([worst] + [abs(e) for e in errs])
            cells = "   ".join(f"{p / 1024:8.1f} vs {q / 1024:8.1f} ({e:+.1%})"
                               for (p, q), e in zip(got, errs, strict=True))
            print(f"{name:<16}{schedule:<8}  {cells}", flush=True)
    print(f"worst {worst:.1%} over {len(args.models) * len(args.schedules)} cases in "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
