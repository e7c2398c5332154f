"""Hugging Face models through FlexPipe, fast and predicted: GPT-2 (its own ``Conv1D``) and a
Llama, exported by torch.export and cut into stages, trained on 2 gloo ranks with 1F1B, ZB-H1
and ZB-V. Per model it prints W's deferred share per stage (the trainable weight elements whose
gradient W computes), each schedule's speed relative to 1F1B's (the median over step pairs, see
below), the simulator's predicted makespan from the profiled costs against the measured one
(medians over the rounds), the measured step replayed by the simulator with its ops' own
measured durations (``flexpipe.sim.replay``: how much of the error the op times account for,
and how much the time between ops), the activation peak per rank, predicted vs measured, and
the ranking of the three, predicted, replayed and measured (times within 1% are a tie:
``TIE``).

A round is two launches: one profiling both placements together (1F1B's and ZB-H1's, ZB-V's:
their stages timed in turn, so a drift of the shared machine's speed moves the predictions of
the three schedules alike; ``profile_round``), then one training the three schedules side by
side in the same processes, step k of each in turn with a different one first at each k
(``launch(interleave=True)``; ``measure``). Two schedules are compared step pair by step pair
(step k of each, seconds apart): the speed is the median of those ratios over every round, and
a measured order counts as resolved only when a signed-rank test over the pairs says so
(p < ``SIGNIFICANCE``).

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/hf_models.py --quick --hidden 512  # ~13 min
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/hf_models.py --quick   # hidden 256, ~6 min
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/hf_models.py --rounds 5 --steps 6
    PYTHONPATH=benchmarks python benchmarks/hf_models.py --device cuda --models gpt2
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/hf_models.py --ranks 4 --layers 8

``--ranks p`` trains on p gloo ranks: 1F1B and ZB-H1 in p stages, ZB-V in a V of 2p (each
model cut for its placement: ``factory``); on this 2-core machine more than 2 ranks share
cores, so their times say little.

On a GPU (``--device cuda``) it is one rank over NCCL in bfloat16 with a GPT-1.3B-wide model
(hidden 2048, 16 heads, seq 2048, vocabulary 50257, micro-batch 2; ``--hidden`` and the other
size options change it): 1F1B and ZB-H1 on one stage, ZB-V on two stages of that rank, and the
split's cost per micro-batch size ((T_B + T_W) / T_BW of the model's blocks, CUDA events;
``hf_split.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch
from hf_common import GPU, PREFIX, SIZE_ENV, Size, causal_lm, lm_loss, size, token_batch
from hf_split import split_table

import flexpipe
from flexpipe.cost.model import CostModel
from flexpipe.demo.verdict import op_time_ratio
from flexpipe.ir.lower import lower
from flexpipe.runtime.measurement.measure import measured_trace
from flexpipe.runtime.measurement.profile import profile_together
from flexpipe.runtime.measurement.shares import deferred_shares
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.runtime.transport import comm
from flexpipe.runtime.user.autocut import auto_points
from flexpipe.runtime.user.tracing import split_points
from flexpipe.sim.engine import simulate
from flexpipe.sim.replay import replay
from flexpipe.sim.stats import ratio_interval, signed_rank_p
from flexpipe.specs import load

SCHEDULES = ("1f1b", "zb-h1", "zb-v")

Placed = tuple[int, ...]
"""Stages -> their ranks (a placement's ``stage_rank``): (0, 1) for 1F1B and ZB-H1 on 2 ranks,
(0, 1, 1, 0) for ZB-V's V; (0, 0) for ZB-V's 2 stages on one GPU's one rank."""


def balanced_over(placed: Placed) -> Placed:
    """What the automatic cut balances: the ranks; on one rank with several stages, the
    stages (they share it, so balancing the rank balances nothing)."""
    return tuple(range(len(placed))) if len(set(placed)) == 1 else placed


def points(name: str, placed: Placed) -> tuple[str, ...]:
    """Where stages 2.. start: FlexPipe's automatic split points (``cut`` "auto": the counted
    FLOPs balanced over ``balanced_over(placed)``, as ``flexpipe.pipeline`` does without split
    points), or even blocks (``cut`` "blocks")."""
    at, stages = size(), len(placed)
    if stages == 1:
        return ()
    if at.cut == "blocks":
        if at.layers < stages:
            raise SystemExit(f"--cut blocks: {at.layers} layers cannot make {stages} stages")
        return tuple(f"{PREFIX[name]}{k * at.layers // stages}" for k in range(1, stages))
    return auto_points(causal_lm(name), balanced_over(placed), (token_batch(0)[0],))


def _user(name: str, placed: Placed) -> flexpipe.UserModel:
    x, y = token_batch(0)
    return flexpipe.UserModel(causal_lm(name), lm_loss, ((x,), y),
                              split_points=points(name, placed))


def gpt2_2() -> flexpipe.UserModel:
    """GPT-2 cut into 2 stages for 2 ranks (``--model hf_models:gpt2_2``)."""
    return _user("gpt2", (0, 1))


def llama_2() -> flexpipe.UserModel:
    """Llama cut into 2 stages for 2 ranks (``--model hf_models:llama_2``)."""
    return _user("llama", (0, 1))


def factory(name: str, placed: Placed) -> str:
    """The ``--model`` factory of ``name`` cut for the placement ``placed``:
    ``hf_models:gpt2_on_0_1_1_0`` is GPT-2 in 4 stages of a V over 2 ranks."""
    return f"hf_models:{name}_on_{'_'.join(map(str, placed))}"


def __getattr__(attr: str) -> Callable[[], flexpipe.UserModel]:
    """The factories ``factory`` names (the rank processes import them by name)."""
    name, on, ranks = attr.partition("_on_")
    if on and name in PREFIX and all(r.isdigit() for r in ranks.split("_")):
        placed = tuple(int(r) for r in ranks.split("_"))
        return lambda: _user(name, placed)
    raise AttributeError(f"module 'hf_models' has no attribute {attr!r}")


def shares(name: str, placed: Placed, device: str = "cpu") -> list[float]:
    """W's deferred share of every stage: one recorded forward of one micro-batch."""
    x, _ = token_batch(0)
    traced = split_points(causal_lm(name), points(name, placed), (x,))
    return deferred_shares(traced.segments, (x,), len(placed), device)


def _job(name: str, schedule: str, ranks: int, m: int, steps: int) -> tuple[Job, ModelSpec]:
    sched = load(schedule, ranks, m)
    spec = ModelSpec("user", factory=factory(name, sched.placement.stage_rank))
    return Job(sched, spec, TrainConfig(steps=steps, measure_memory=True)), spec


def _measured(job: Job, results: Sequence[Any]) -> dict[str, Any]:
    """One job's median step (ms), best step, and its last step's measured makespan and
    activation peaks."""
    step_ms = statistics.median(t for r in results for t in r.step_times[1:]) * 1e3
    steps_ms = [max(ts) * 1e3 for ts in zip(*(r.step_times[1:] for r in results), strict=True)]
    trace = measured_trace(job.schedule, results)  # skip edges carry stage 0's masks
    got = trace.metrics()
    return {"step_ms": step_ms, "best_ms": min(steps_ms), "steps_ms": steps_ms,
            "makespan": got.makespan, "peaks": list(got.peak_activation), "trace": trace}


def measure(name: str, schedules: Sequence[str], ranks: int, m: int,
            steps: int) -> dict[str, dict[str, Any]]:
    """One launch training ``schedules`` side by side, ``steps`` steps each, step k of each in
    turn (``launch(interleave=True)``: one process group, one allocator, the same minute of the
    machine for step k of each); ``_measured`` of each."""
    jobs = [_job(name, s, ranks, m, steps)[0] for s in schedules]
    return {sched: _measured(job, results) for sched, job, results
            in zip(schedules, jobs, launch(jobs, world=ranks, interleave=True), strict=True)}


def profile_round(name: str, ranks: int, m: int) -> dict[Any, CostModel]:
    """The cost model of every placement the schedules take, profiled together in one launch
    (their stages timed in turn), so that the ranking of their predictions is the schedules'
    and not the machine's drift between two profiles."""
    specs: dict[Any, tuple[ModelSpec, Any]] = {}
    for schedule in SCHEDULES:
        job, spec = _job(name, schedule, ranks, m, 1)
        specs.setdefault(job.schedule.placement.stage_rank, (spec, job.schedule.placement))
    costs = profile_together([(spec, placement, None) for spec, placement in specs.values()])
    return dict(zip(specs, costs, strict=True))


def predict(name: str, schedule: str, ranks: int, m: int,
            costs: dict[Any, CostModel]) -> dict[str, Any]:
    """The simulator's makespan and activation peaks from the round's profiled ``costs`` (one
    per placement: 1F1B and ZB-H1 share theirs)."""
    job, _ = _job(name, schedule, ranks, m, 1)
    sched = job.schedule
    cost = costs[sched.placement.stage_rank]
    trace = simulate(lower(sched), cost)
    want = trace.metrics()
    return {"pred_makespan": want.makespan, "pred_peaks": list(want.peak_activation),
            "costs": cost, "pred_trace": trace, "placed": sched.placement.stage_rank}


TIE = 0.01
"""Two times closer than this (relative) are a tie: the simulator does not claim an order
finer than that, nor the medians of 3 rounds on a shared machine."""


def report(name: str, runs: dict[str, list[dict[str, Any]]], device: str) -> None:
    """Print one model's table."""
    at = size()
    print(f"\n{name} (hidden {at.hidden}, {at.layers} layers, {at.heads} heads, seq {at.seq}, "
          f"vocabulary {at.vocab}, micro-batch {at.micro}, {at.dtype}, {device})")
    for placed in dict.fromkeys(rs[0]["placed"] for rs in runs.values()):
        k = f"{len(placed)} stages on ranks {','.join(map(str, placed))}"
        print(f"  split points ({k}, cut {at.cut}): {', '.join(points(name, placed)) or '-'}")
        print(f"  deferred share per stage ({k}): "
              + " ".join(f"{s:.3f}" for s in shares(name, placed, device)))
    for sched in ("1f1b", "zb-v"):
        stages = runs[sched][0]["costs"].stages
        print(f"  profiled ms per stage in round 0, F/B/W/BW ({sched}'s placement): " + ", ".join(
            "/".join(f"{c.times[k]:.1f}" for k in ("F", "B", "W", "BW")) for c in stages))
        if sched == "zb-v" and any(c.cold for c in stages):  # the V alternates its 2 stages
            print("    cold, another stage having run on the rank since: " + ", ".join(
                "/".join(f"{c.switched_time(k):.1f}" for k in ("F", "B", "W", "BW"))
                for c in stages))
        if sched == "1f1b" and any(c.fused or c.after_w for c in stages):
            print("    F of a fused micro-batch (1F1B's) / F right after its W (ZB-H1's): "
                  + ", ".join(f"{c.timer('fused')('F'):.1f}/{c.timer('after_w')('F'):.1f}"
                              for c in stages))
    posts = [r["costs"].comm.post for r in runs["1f1b"]]
    if any(posts):
        print("  compute thread's time per send or receive (profiled, each round): "
              + ", ".join(f"{v:.3f}" for v in posts) + " ms")
    base = statistics.median(r["step_ms"] for r in runs["1f1b"])
    best = min(r["best_ms"] for r in runs["1f1b"])
    for sched, rs in runs.items():
        med, low = statistics.median(r["step_ms"] for r in rs), min(r["best_ms"] for r in rs)
        speed = 1 / statistics.median(paired(rs, runs["1f1b"]))
        first, span = rs[0], statistics.median(r["makespan"] for r in rs)
        want = statistics.median(r["pred_makespan"] for r in rs)
        err = 100 * (want - span) / span
        worst = max((abs(r["pred_makespan"] / r["makespan"] - 1) for r in rs), default=0.0)
        ops = statistics.median(op_time_ratio(r["pred_trace"], r["trace"]) or 0.0 for r in rs)
        again = statistics.median(r["replayed"] for r in rs)
        peaks = ", ".join(f"rank {i}: {p / 2**20:.2f} vs {q / 2**20:.2f} MiB "
                          f"({100 * (p - q) / q:+.1f}%)"
                          for i, (p, q) in enumerate(zip(first["pred_peaks"], first["peaks"],
                                                         strict=True)))
        print(f"  {sched:6s} step {med:7.1f} ms (best {low:.1f})  speed vs 1F1B "
              f"{speed:.3f}x (median of step pairs; best {best / low:.3f}x)  makespan predicted "
              f"{want:.1f} vs measured {span:.1f} ms ({err:+.1f}%; worst round "
              f"{100 * worst:.1f}% off; compute ops {ops:.2f}x profiled; replayed with the "
              f"measured op times {again:.1f} ms: op times {again - want:+.1f}, between ops "
              f"{span - again:+.1f})  activation peak predicted vs measured: {peaks}")
    rank = {"paired": lambda s: base * statistics.median(paired(runs[s], runs["1f1b"])),
            "best": lambda s: min(r["best_ms"] for r in runs[s]),
            "predicted": lambda s: statistics.median(r["pred_makespan"] for r in runs[s]),
            "replayed": lambda s: statistics.median(r["replayed"] for r in runs[s])}
    direct = {"paired": lambda a, b: statistics.median(paired(runs[b], runs[a])),
              "predicted": lambda a, b: statistics.median(
                  y["pred_makespan"] / x["pred_makespan"] for x, y in zip(runs[a], runs[b],
                                                                           strict=True)),
              "replayed": lambda a, b: statistics.median(
                  y["replayed"] / x["replayed"] for x, y in zip(runs[a], runs[b], strict=True))}
    told = {"paired": lambda a, b: direct["paired"](a, b) > 1
            and signed_rank_p(paired(runs[b], runs[a])) < SIGNIFICANCE}
    print("  ranking " + "; ".join(f"{k} {order(list(runs), f, direct.get(k), told.get(k))}"
                                   for k, f in rank.items())
          + f" ('~': a tie, within {100 * TIE:.0f}%; paired: not resolved by the signed-rank "
            f"test at p < {SIGNIFICANCE})")
    for a, b in ((a, b) for i, a in enumerate(runs) for b in list(runs)[i + 1:]):
        print("  " + pair_line(a, b, runs[a], runs[b]))


def replayed(run: dict[str, Any]) -> float:
    """The makespan of a round's measured (last) step replayed by the simulator with its ops'
    own measured durations under that round's profiled costs (``flexpipe.sim.replay``): what
    the simulator predicts once the op times are right."""
    return replay(run["trace"], run["costs"]).metrics().makespan


def order(names: Sequence[str], time: Callable[[str], float],
          ratio: Callable[[str, str], float] | None = None,
          apart: Callable[[str, str], bool] | None = None) -> str:
    """``names`` fastest first, '<' between two told apart, else '~'.
    ``ratio(a, b)``: b's time over a's as the two compare directly (default from ``time``;
    measured side by side, the median of their own step pairs): the order is by how many
    others each beats that way, then by ``time``. ``apart(a, b)``: whether a is claimed
    faster than b (default: more than ``TIE`` apart; measured pairs: resolved by the test)."""
    vs = ratio or (lambda a, b: time(b) / time(a))
    told = apart or (lambda a, b: vs(a, b) > 1 + TIE)
    ranked = sorted(names, key=lambda n: (-sum(vs(n, o) > 1 for o in names if o != n), time(n)))
    out = ranked[0]
    for prev, name in itertools.pairwise(ranked):
        out += f" {'<' if told(prev, name) else '~'} {name}"
    return out


def paired(ra: list[dict[str, Any]], rb: list[dict[str, Any]]) -> list[float]:
    """Step k of one schedule over step k of another, for every k of every round (run side by
    side, so each pair shares the machine's state)."""
    return [x / y for one, two in zip(ra, rb, strict=True)
            for x, y in zip(one["steps_ms"], two["steps_ms"], strict=True)]


SIGNIFICANCE = 0.05
"""A measured order is resolved when a two-sided Wilcoxon signed-rank test over the step pairs'
log ratios rejects "neither is faster" at this level."""


def pair_line(a: str, b: str, ra: list[dict[str, Any]], rb: list[dict[str, Any]]) -> str:
    """How two schedules compare, predicted (round by round, from each round's profile) and
    measured (step pair by step pair): the measured order is claimed only when the signed-rank
    test over the pairs gives p below ``SIGNIFICANCE``, and the prediction is held against the
    measured ratio's 95% interval (``ratio_interval``), which says how far apart the two can be
    when the order is not resolved."""
    pred = statistics.median(x["pred_makespan"] / y["pred_makespan"]
                             for x, y in zip(ra, rb, strict=True))
    again = statistics.median(x["replayed"] / y["replayed"] for x, y in zip(ra, rb, strict=True))
    meas = paired(ra, rb)
    mid, ahead, p = statistics.median(meas), sum(r < 1 for r in meas), signed_rank_p(meas)
    lo, hi = ratio_interval(meas)
    return (f"{a} vs {b}: predicted {pred:.3f}x the time, replayed with the measured op times "
            f"{again:.3f}x, measured {mid:.3f}x by the median of step pairs "
            f"(95% interval {lo:.3f}-{hi:.3f}; {a} faster in {ahead} of {len(meas)}, "
            f"p = {p:.3f}): {verdict(pred, mid, p, (lo, hi))}\n"
            f"    step pairs: {' '.join(f'{r:.3f}' for r in meas)}")


def verdict(pred: float, meas: float, p: float, interval: tuple[float, float]) -> str:
    """The predicted ratio against the measured one: the order (claimed on either side only
    beyond a tie, and on the measured side only when resolved), then whether the prediction
    lies in the measured 95% interval."""
    lo, hi = interval
    if abs(pred - 1) < TIE:
        order_part = f"predicted a tie (within {100 * TIE:.0f}%), so no order is claimed"
    elif p < SIGNIFICANCE:
        order_part = "agrees" if (pred < 1) == (meas < 1) else "disagrees"
    else:
        order_part = "the measured order is not resolved (signed-rank test over the pairs)"
    where = "inside" if lo <= pred <= hi else "outside"
    return f"{order_part}; the prediction is {where} the measured 95% interval"


def machine_load() -> str:
    """The machine's load averages (1, 5, 15 min) and core count, as ``uptime`` gives them."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 15 steps, m = 8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("-m", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=list(PREFIX))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: 2 gloo ranks; cuda: one rank over NCCL on this GPU")
    ap.add_argument("--ranks", type=int, default=0, help="pipeline ranks (default 2; cuda 1)")
    ap.add_argument("--split-batches", type=int, nargs="*", default=None,
                    help="micro-batch sizes of the split-cost table (default: 1 2 4 on cuda, "
                         "none on cpu; hf_split.py)")
    for field, value in asdict(Size()).items():
        ap.add_argument(f"--{field}", type=type(value), default=None,
                        help=f"model {field} (cpu {value}, cuda {getattr(GPU, field)})")
    return ap.parse_args(argv)


def _setup(args: argparse.Namespace) -> int:
    """Size (into the environment the ranks inherit), backend and threads; the rank count."""
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    chosen = {k: v for k, v in vars(args).items() if k in asdict(Size()) and v is not None}
    os.environ[SIZE_ENV] = json.dumps(asdict(replace(GPU if cuda else Size(), **chosen)))
    os.environ[comm.BACKEND_ENV] = "nccl" if cuda else "gloo"
    torch.set_num_threads(1)
    return args.ranks or (1 if cuda else 2)


def main(argv: list[str] | None = None) -> None:
    """Parse, run every model and schedule in alternating rounds, print the tables."""
    args = _arguments(argv)
    ranks = _setup(args)
    rounds, steps, m = (3, 15, 8) if args.quick else (args.rounds, args.steps, args.m)
    batches = args.split_batches
    if batches is None:
        batches = [1, 2, 4] if args.device == "cuda" else []
    t0 = time.perf_counter()
    backend = os.environ[comm.BACKEND_ENV]
    print(f"{' '.join(sys.argv)}: {rounds} rounds of {steps} steps, m = {m}, {ranks} "
          f"{backend} rank(s); at the start {machine_load()}")
    for name in args.models:
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SCHEDULES}
        for k in range(rounds):
            lead = k % len(SCHEDULES)  # each schedule leads a round in turn
            turn = SCHEDULES[lead:] + SCHEDULES[:lead]
            costs = profile_round(name, ranks, m)  # each round profiles again, before its runs
            for sched, got in measure(name, turn, ranks, m, steps).items():
                run = got | predict(name, sched, ranks, m, costs)
                runs[sched].append(run | {"replayed": replayed(run)})
                print(f"  {name} round {k} {sched}: {got['step_ms']:.1f} ms",
                      file=sys.stderr, flush=True)
        report(name, runs, args.device)
        if batches:
            split_table(name, batches, args.device)
    print(f"\nat the end {machine_load()}; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
