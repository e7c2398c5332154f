"""DualPipeV with its F&B pairs run at once against the same order run one pass after the
other, ZB-V and 1F1B: a mixture of experts at pp 2 x ep 2 on 4 gloo processes, in one launch
(step k of each schedule in turn, so the machine's drift reaches all alike).

Per schedule: the median step time (the slowest rank's); for DualPipeV the share of the
all-to-all time the overlap hides, (sequential - overlapped) / the step's all-to-all time
(the slowest rank's, timed around every dispatch and combine of the sequential run; a
backward's reverse exchange taken as long as its forward's); and the simulator's step from a
cost model of the measured passes (ZB-V's F, B and W per stage; the all-to-all parts as
``F_COMM``, ``B_COMM``, ``BW_COMM``) against the measured one.

    .venv/bin/python benchmarks/dualpipe_overlap.py [--steps 6] [--hidden 256] [--experts 8]
        [--blocks 4] [--tokens 256] [--m 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.runtime.transport import experts
from flexpipe.schedules.registry import build
from flexpipe.search import fit_cost
from flexpipe.sim.engine import simulate

EP, VOCAB, TOP_K = 2, 512, 2
RUNS = ("dualpipev", "dualpipev (in turn)", "zb-v", "1f1b")


class Experts(nn.Module):
    """E two-layer MLP experts with Hugging Face's contract (hidden, top-k ids, weights)."""

    def __init__(self, hidden: int, count: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(count))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out = out.index_add(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


class MoE(nn.Module):
    """A residual MoE layer: a linear router's top-k softmax, then the experts."""

    def __init__(self, hidden: int, count: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, count, bias=False)
        self.moe = Experts(hidden, count)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        weights, ids = self.router(flat).softmax(-1).topk(TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return h + self.moe(flat, ids, weights).view_as(h)


def _layers(hidden: int, count: int, blocks: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Embedding(VOCAB, hidden), *(MoE(hidden, count) for _ in range(blocks)),
            nn.Linear(hidden, VOCAB)]


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return fn.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


class CommTimer:
    """Times the experts' all-to-alls by the forward they run in (the counts exchange and the
    two exchanges of tokens); on only while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.op: Any = None
        self.forward: dict[int, list[float]] = defaultdict(list)  # stage -> per F: all
        self.tokens: dict[int, list[float]] = defaultdict(list)  # stage -> per F: exchanges
        self._exchange, self._counts = experts._exchange, dist.all_to_all_single
        experts._exchange = self._timed(self._exchange, True)
        experts.dist.all_to_all_single = self._timed(self._counts, False)  # type: ignore

    def _timed(self, fn_: Any, tokens: bool) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = fn_(*args, **kw)
            if self.on and self.op is not None:
                took = time.perf_counter() - t0
                self.forward[self.op.stage][-1] += took
                if tokens:
                    self.tokens[self.op.stage][-1] += took
            return out
        return run

    def wrap(self, handlers: dict[str, Any]) -> None:
        """Note the forward being run (F handler) so its all-to-alls count to its stage."""
        forward = handlers["F"]

        def run(ex: Any, op: Any) -> None:
            self.op = op
            self.forward[op.stage].append(0.0)
            self.tokens[op.stage].append(0.0)
            forward(ex, op)
            self.op = None
        handlers["F"] = run


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _pipe(name: str, args: argparse.Namespace) -> Any:
    schedule = "dualpipev" if name.startswith("dualpipev") else name
    return flexpipe.pipeline(_layers(args.hidden, args.experts, args.blocks), schedule,
                             loss_fn=_loss, m=args.m, ep=EP, ep_plan={"*.moe": "list"},
                             overlap_pairs=name != "dualpipev (in turn)")


def _batch(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    return pipe._batch(x if pipe.needs_inputs else None, y if pipe.needs_targets else None,
                       True)


def _step(pipe: Any, batch: Any) -> tuple[float, Any]:
    for p in pipe.parameters():
        p.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    out = pipe.worker.run(batch)
    return _slowest(time.perf_counter() - t0), out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every rank: the median steps, the all-to-all time, the predictions."""
    torch.set_num_threads(1)  # 4 processes share the cores: one compute thread each
    pipes = {name: _pipe(name, args) for name in RUNS}
    timer = CommTimer()
    timer.wrap(pipes["dualpipev (in turn)"].worker.executor.handlers)
    gen = torch.Generator().manual_seed(1)
    seq = args.tokens // args.m
    ids = torch.randint(0, VOCAB, (args.m * EP, seq + 1), generator=gen)
    r = pipes["zb-v"].replica
    x, y = ids[:, :-1].chunk(EP)[r], ids[:, 1:].chunk(EP)[r]
    times: dict[str, list[float]] = {n: [] for n in RUNS}
    comm: list[float] = []
    zbv_ops: list[Any] = []
    for k in range(args.steps + 1):
        for name in RUNS:
            timer.on = k > 0 and name == "dualpipev (in turn)"
            took, out = _step(pipes[name], _batch(pipes[name], x, y))
            if k:
                times[name].append(took)
            if timer.on:
                spent = sum(map(sum, timer.forward.values())) + sum(map(sum, timer.tokens.values()))
                comm.append(_slowest(spent))
                timer.forward.clear()
                timer.tokens.clear()
            if k and name == "zb-v":
                zbv_ops.append(out)
    timer.on = True
    _step(pipes["dualpipev (in turn)"], _batch(pipes["dualpipev (in turn)"], x, y))
    timer.on = False
    cost = _cost(pipes["zb-v"], zbv_ops, timer)
    measured = {n: statistics.median(times[n]) for n in RUNS}
    return {"measured": measured, "comm": statistics.median(comm),
            "predicted": _predict(cost, args.m), "concurrent":
            pipes["dualpipev"].worker.executor.pairs.concurrent_runs}


def _cost(pipe: Any, runs: list[Any], timer: CommTimer) -> CostModel:
    """Per stage the median F, B, W of ZB-V's measured steps and the all-to-all parts, over
    every rank (the ep ranks of a stage alike: their means)."""
    ops = pipe.worker.executor.ops
    mine: dict[int, dict[str, float]] = {}
    for s in {op.stage for op in ops if op.kind == "F"}:
        row = {}
        for kind in ("F", "B", "W"):
            spans = [out.ends[i] - out.starts[i] for out in runs
                     for i, op in enumerate(ops) if op.kind == kind and op.stage == s]
            row[kind] = statistics.median(spans)
        f_comm = statistics.mean(timer.forward[s]) if timer.forward.get(s) else 0.0
        t_comm = statistics.mean(timer.tokens[s]) if timer.tokens.get(s) else 0.0
        row.update(F_COMM=min(f_comm, row["F"]), B_COMM=min(t_comm, row["B"]),
                   BW_COMM=min(t_comm, row["B"] + row["W"]))
        mine[s] = row
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    stages = sorted({s for part in every for s in part})
    table = {s: {k: statistics.mean(part[s][k] for part in every if s in part)
                 for k in every[0][next(iter(every[0]))]} for s in stages}
    return CostModel(tuple(StageCost(table[s]) for s in stages), Comm.uniform(2))


def _predict(cost: CostModel, m: int) -> dict[str, float]:
    """The simulator's step of every run from ``cost`` (1F1B's two stages are the V's four
    merged in pairs along the chain)."""
    dual = build("dualpipev", 2, m)
    return {"dualpipev": simulate(dual, cost).metrics().makespan,
            "dualpipev (in turn)": simulate(dual.flattened(), cost).metrics().makespan,
            "zb-v": simulate(build("zb-v", 2, m), cost).metrics().makespan,
            "1f1b": simulate(build("1f1b", 2, m), fit_cost(cost, 2)).metrics().makespan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per replica per step")
    parser.add_argument("--m", type=int, default=8)
    args = parser.parse_args()
    out = flexpipe.spawn(bench, 4, args, deadline_s=3000.0)[0]
    print(f"MoE: hidden {args.hidden}, {args.experts} experts top-{TOP_K}, {args.blocks} "
          f"blocks, {args.tokens} tokens per replica, m {args.m}; pp 2 x ep {EP}, gloo, float32")
    seq, dual = out["measured"]["dualpipev (in turn)"], out["measured"]["dualpipev"]
    print(f"all-to-all per step (slowest rank, in turn): {1e3 * out['comm']:.1f} ms; hidden by "
          f"the overlap: {(seq - dual) / out['comm']:.0%}; pairs run at once on rank 0: "
          f"{out['concurrent']}")
    print(f"{'schedule':<20} {'step ms':>9} {'vs 1f1b':>8} {'predicted ms':>13} {'pred err':>9}")
    for name in RUNS:
        got, pred = out["measured"][name], out["predicted"][name]
        print(f"{name:<20} {1e3 * got:>9.1f} {got / out['measured']['1f1b']:>8.2f} "
              f"{1e3 * pred:>13.1f} {pred / got - 1:>+9.0%}")


if __name__ == "__main__":
    main()
