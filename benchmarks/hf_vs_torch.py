"""FlexPipe vs torch.distributed.pipelining on Hugging Face models, as each is used out of the
box: the same HF GPT-2 (its embeddings tied to the LM head, as HF ships it) and Llama, the same
split points, 2 gloo ranks, 1F1B and ZB-V. torch's side is ``pipeline()`` (torch.export) and
``pipe.build_stage`` with ``Schedule1F1B`` / ``ScheduleZBVZeroBubble``; FlexPipe's is
``flexpipe.pipeline`` with the same split points. Per model and schedule it prints:

- the gradients of the first step against one process training the whole batch (the mean of
  the micro-batches' losses): the worst relative error over the parameters, and the parameter
  where it is (a weight that several stages use gets one gradient per stage holding it);
- how far each framework's copies of a weight used on several ranks are apart after the steps
  (FlexPipe keeps one weight; torch keeps one copy per stage and steps each with its part);
- the median step time of each (alternating rounds, AdamW step included) and their ratio.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/hf_vs_torch.py            # ~3 min
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/hf_vs_torch.py --rounds 3 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import hf_common as common
import hf_models as hf
import torch
from torch import nn
from torch.distributed import pipelining as pp

import flexpipe
from flexpipe.runtime.processes.launch import LaunchError, launch_task

TIED_ENV = "FLEXPIPE_HF_TIED"
"""Whether the ranks build GPT-2 with its embeddings tied (HF's default), as ``hf_models``
passes its size: the ranks are spawned and read it here."""
SCHEDULES = {"1f1b": ("Schedule1F1B", (0, 1)), "zb-v": ("ScheduleZBVZeroBubble", (0, 1, 1, 0))}
"""FlexPipe library name -> (torch's schedule class, its stages' ranks)."""


def model(name: str) -> nn.Module:
    """The model both frameworks train (seeded: every rank builds the same weights)."""
    lm = common.causal_lm(name)
    if name == "gpt2" and os.environ.get(TIED_ENV, "1") == "1":
        inner = lm.model  # type: ignore[union-attr]
        inner.config.tie_word_embeddings = True
        inner.lm_head.weight = inner.transformer.wte.weight
    return lm


def batch(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step``: m micro-batches, concatenated."""
    xs, ys = zip(*(common.token_batch(1000 * step + k) for k in range(m)), strict=True)
    return torch.cat(xs), torch.cat(ys)


def _mine(rank: int, stages: int) -> list[int]:
    return [rank] if stages == 2 else [rank, stages - 1 - rank]


def _grads(named: list[tuple[str, nn.Parameter]], where: int) -> dict[str, Any]:
    return {f"{n}@{where}": p.grad.detach().clone() for n, p in named if p.grad is not None}


def _weights(named: list[tuple[str, nn.Parameter]], where: int) -> dict[str, Any]:
    return {f"{n}@{where}": p.detach().clone() for n, p in named}


def _train(step_fn: Callable[[int], None], params: list[nn.Parameter],
           grab: Callable[[], dict[str, Any]], steps: int) -> dict[str, Any]:
    """Run ``steps`` steps with AdamW; the first step's gradients and every step's time."""
    opt = torch.optim.AdamW(params, lr=1e-3)
    times, grads = [], {}
    for k in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step_fn(k)
        if k == 0:
            t_grab = time.perf_counter()
            grads = grab()
            t0 += time.perf_counter() - t_grab
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"grads": grads, "times": times}


def _no_self_warmup(stage: Any) -> None:
    """torch 2.13's ``pipe.build_stage`` stages open their links by sending to the ranks of
    their neighbour stages, their own rank included where a V puts two on one rank, which gloo
    refuses (``Pair is not connected``); drop those sends to self (nothing else changes)."""
    ops = stage._get_init_p2p_neighbors_ops

    def others() -> list[Any]:
        return [op for op in ops() if op.group_peer != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = others


def torch_task(rank: int, world: int, name: str, sched: str, m: int,
               steps: int) -> list[dict[str, Any]]:
    """Launch task: torch.distributed.pipelining as its docs use it on an HF model."""
    cls, placed = SCHEDULES[sched]
    stages = len(placed)
    x, _ = batch(0, m)
    split = {p: pp.SplitPoint.BEGINNING for p in hf.points(name, placed)}
    pipe = pp.pipeline(model(name), (x[:common.size().micro],), split_spec=split)
    mine = _mine(rank, stages)
    built = [pipe.build_stage(s, torch.device("cpu")) for s in mine]
    for stage in built:
        _no_self_warmup(stage)
    schedule = getattr(pp, cls)(built[0] if stages == 2 else built, m, loss_fn=common.lm_loss)
    named = {s: list(b.submod.named_parameters()) for s, b in zip(mine, built, strict=True)}

    def step(k: int) -> None:
        x, y = batch(k, m)
        args = (x,) if 0 in mine else ()
        kwargs = {"target": y, "losses": []} if stages - 1 in mine else {}
        schedule.step(*args, **kwargs)

    def grab() -> dict[str, Any]:
        return {k: v for s, ps in named.items() for k, v in _grads(ps, s).items()}

    params = [p for ps in named.values() for _, p in ps]
    out = _train(step, params, grab, steps)
    out["weights"] = {k: v for s, ps in named.items() for k, v in _weights(ps, s).items()}
    return [out]


def flexpipe_task(rank: int, world: int, name: str, sched: str, m: int,
                  steps: int) -> list[dict[str, Any]]:
    """Launch task: ``flexpipe.pipeline`` on the same model and split points."""
    _, placed = SCHEDULES[sched]
    x, _ = batch(0, m)
    pipe = flexpipe.pipeline(model(name), sched, m=m, loss_fn=common.lm_loss,
                             split_points=hf.points(name, placed),
                             example=(x[:common.size().micro],))
    named = list(pipe.named_parameters())

    def step(k: int) -> None:
        x, y = batch(k, m)
        pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)

    out = _train(step, pipe.parameters(), lambda: _grads(named, rank), steps)  # type: ignore
    out["weights"] = _weights(named, rank)  # type: ignore[arg-type]
    return [out]


def reference(name: str, m: int) -> dict[str, torch.Tensor]:
    """One process, the whole batch: the gradients of the mean of the micro-batches' losses,
    under every name of each parameter (a tied weight under each of its names)."""
    lm = model(name)
    x, y = batch(0, m)
    micro = common.size().micro
    loss = sum(common.lm_loss(lm(x[k * micro:(k + 1) * micro]), y[k * micro:(k + 1) * micro])
               for k in range(m)) / m
    loss.backward()  # type: ignore[union-attr]
    return {n: p.grad.detach().clone() for n, p in lm.named_parameters(remove_duplicate=False)
            if p.grad is not None}


def identities(name: str) -> dict[str, str]:
    """Each parameter name of the model -> the first name of that parameter (a tied weight's
    names map to one); torch.export's stage modules may spell the dots as underscores."""
    first: dict[int, str] = {}
    out = {}
    for key, p in model(name).named_parameters(remove_duplicate=False):
        out[key] = out[key.replace(".", "_")] = first.setdefault(id(p), key)
    return out


def canonical(key: str, names: dict[str, str]) -> str:
    """The parameter a gradient or weight of a rank is (``model.lm_head.weight@3`` ->
    ``model.transformer.wte.weight`` when the two are tied)."""
    base = key.rsplit("@", 1)[0]
    if base not in names:
        raise KeyError(f"{key!r} names no parameter of the model")
    return names[base]


def grad_error(ranks: list[dict[str, Any]], ref: dict[str, torch.Tensor],
               names: dict[str, str]) -> tuple[float, str]:
    """The worst relative error of any gradient any rank holds, and where it is."""
    worst, where = 0.0, ""
    for res in ranks:
        for key, g in res["grads"].items():
            want = ref[canonical(key, names)]
            err = float((g - want).abs().max() / want.abs().max().clamp_min(1e-30))
            if err > worst:
                worst, where = err, key
    return worst, where


def copies_apart(ranks: list[dict[str, Any]], names: dict[str, str]) -> float:
    """The largest difference between two copies of one weight after training (0 when every
    weight has one copy, or its copies agree)."""
    seen: dict[str, torch.Tensor] = {}
    worst = 0.0
    for res in ranks:
        for key, w in res["weights"].items():
            base = canonical(key, names)
            if base in seen:
                worst = max(worst, float((seen[base] - w).abs().max()))
            else:
                seen[base] = w
    return worst


def _step_ms(ranks: list[dict[str, Any]]) -> float:
    steps = zip(*(r["times"][1:] for r in ranks), strict=True)
    return 1e3 * statistics.median(max(ts) for ts in steps)


def _run(task: Callable[..., list[dict[str, Any]]], args: tuple[Any, ...]) -> Any:
    """Every rank's result, or the reason the framework refused (its first error line)."""
    try:
        return [r[0] for r in launch_task(task, args, 2, timeout_s=120.0, deadline_s=900.0)]
    except LaunchError as exc:
        return str(exc).splitlines()[0].split("failed: ", 1)[-1][:240]


def compare(name: str, sched: str, m: int, steps: int, rounds: int) -> dict[str, Any]:
    """Both frameworks on one model and schedule: errors, copies, step times (or the reason
    one refused)."""
    ref, names = reference(name, m), identities(name)
    tasks = {"flexpipe": flexpipe_task, "torch": torch_task}
    times: dict[str, list[float]] = {k: [] for k in tasks}
    out: dict[str, Any] = {"rounds": times}
    for _ in range(rounds):  # alternate: the machine is shared and noisy
        for key, task in tasks.items():
            if isinstance(out.get(key), str):
                continue
            ranks = _run(task, (name, sched, m, steps))
            if isinstance(ranks, str):
                out[key] = ranks
                continue
            times[key].append(_step_ms(ranks))
            out.setdefault(key, {"error": grad_error(ranks, ref, names),
                                 "apart": copies_apart(ranks, names)})
    for key in tasks:
        if not isinstance(out[key], str):
            out[key]["ms"] = statistics.median(times[key])
    return out


def _row(name: str, sched: str, res: dict[str, Any]) -> str:
    cells = []
    for key in ("flexpipe", "torch"):
        if isinstance(res[key], str):
            cells += [f"refused: {res[key]}", "--"]
            continue
        err, where = res[key]["error"]
        at = f" ({where.split('@')[0].removeprefix('model.')})" if err > 1e-4 else ""
        cells += [f"{err:.1e}{at}", f"{res[key]['apart']:.1e}"]
    if any(isinstance(res[k], str) for k in ("flexpipe", "torch")):
        return f"| {name} | {sched} | {' | '.join(cells)} | -- | -- | -- | -- |"
    ms = res["flexpipe"]["ms"], res["torch"]["ms"]
    per = " ".join(f"{a / b:.3f}" for a, b in zip(*res["rounds"].values(), strict=True))
    return (f"| {name} | {sched} | {' | '.join(cells)} | {ms[0]:.1f} | {ms[1]:.1f} | "
            f"{ms[0] / ms[1]:.3f} | {per} |")


def main(argv: list[str] | None = None) -> None:
    """Parse, compare every model and schedule, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("-m", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=list(common.PREFIX))
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--untied", action="store_true", help="GPT-2 with untied embeddings")
    args = ap.parse_args(argv)
    # both pipelines cut at the same block starts (torch splits at a module's beginning)
    os.environ[common.SIZE_ENV] = json.dumps(asdict(replace(common.Size(), cut="blocks")))
    os.environ[TIED_ENV] = "0" if args.untied else "1"
    torch.set_num_threads(1)
    at = common.size()
    print(f"hidden {at.hidden}, {at.layers} layers, seq {at.seq}, vocabulary {at.vocab}, "
          f"micro-batch {at.micro}, m = {args.m}, {at.dtype}, 2 gloo ranks, torch "
          f"{torch.__version__}; GPT-2 embeddings {'untied' if args.untied else 'tied'}; "
          f"{args.rounds} rounds of {args.steps} steps; {hf.machine_load()}")
    print("| model | schedule | FlexPipe grad error | FlexPipe copies apart | torch grad error "
          "| torch copies apart | FlexPipe ms | torch ms | ratio | per-round ratios |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for name in args.models:
        for sched in args.schedules:
            print(_row(name, sched, compare(name, sched, args.m, args.steps, args.rounds)),
                  flush=True)
    print(f"{hf.machine_load()}; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
