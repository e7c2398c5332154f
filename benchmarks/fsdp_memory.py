"""FSDP2 under ZeroPP: parameter and gradient memory per rank, predicted by the simulator vs
measured, on the built-in GPT (float64, CPU, gloo); the last case is HSDP (``rep`` replica
groups, each sharding over dp / rep ranks).

The measurement: after every op of the second step, the bytes of every parameter and gradient
storage the rank holds (FSDP2's shards, the gathered parameters while an AG is open, the
unsharded gradients until their RS), each storage once (``RankResult.param_bytes``); the peak
per rank. The prediction: ``flexpipe.runtime.measurement.fsdp_memory.predicted_param_bytes``
from the stages' parameter bytes (the simulator's AG/RS memory effects, no activations).

    python benchmarks/fsdp_memory.py
"""

from __future__ import annotations

import flexpipe
from flexpipe.runtime.measurement.fsdp_memory import predicted_param_bytes
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.train import Job, TrainConfig, build_rank, run_job
from flexpipe.schedules import registry

GPT = ModelSpec("gpt", layers=8, hidden=64, heads=4, vocab=256, seq=32, micro_batch=2,
                dtype="float64")
CASES = ((2, 8, 1, 1), (2, 8, 2, 1), (4, 8, 1, 1), (2, 8, 4, 2))
"""(pipeline ranks, micro-batches, data-parallel ranks, HSDP replica groups)."""


def _schedule(p: int, m: int) -> object:
    return registry.build("zeropp", p, m, v=2)


def _rank(p: int, m: int, dp: int, rep: int) -> tuple[int, int, float]:
    import torch.distributed as dist

    train = TrainConfig(steps=2, dp=dp, dp_replicate=rep, measure_memory=True)
    res = run_job(Job(_schedule(p, m), GPT, train), dist.get_rank(), dist.get_world_size())
    return res.pipe_rank, res.replica, max(res.param_bytes)


def _stage_bytes(p: int, m: int) -> list[float]:
    schedule = _schedule(p, m)
    out = []
    for s in range(schedule.num_stages):  # type: ignore[attr-defined]
        stages, _ = build_rank(Job(schedule, GPT), schedule.placement.stage_rank[s])  # type: ignore
        out.append(float(sum(q.numel() * q.element_size() for q in stages[s].parameters())))
    return out


def main() -> None:
    """Print the table."""
    print("zeropp (v=2), GPT 8 blocks h=64 float64; parameter + gradient bytes per rank, peak "
          "over the second step")
    print(f"{'p':>2} {'m':>2} {'dp':>2} {'rep':>3} {'rank':>4} {'predicted MB':>13} "
          f"{'measured MB':>12} {'measured/predicted':>19}")
    for p, m, dp, rep in CASES:
        predicted = predicted_param_bytes(_schedule(p, m), _stage_bytes(p, m), dp,  # type: ignore
                                          rep)
        for pipe_rank, replica, measured in flexpipe.spawn(_rank, p * dp, p, m, dp, rep,
                                                           timeout_s=300):
            if replica == 0:
                want = predicted[pipe_rank]
                print(f"{p:>2} {m:>2} {dp:>2} {rep:>3} {pipe_rank:>4} {want / 1e6:>13.3f} "
                      f"{measured / 1e6:>12.3f} {measured / want:>19.3f}")


if __name__ == "__main__":
    main()
