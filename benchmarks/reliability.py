"""Reliability figures of the runtime: how long after a rank is killed (or stalls, or quits
with exit code 0) the launch fails naming it with every process gone, what writing and loading
a checkpoint costs, and issue #28's categories replayed (``reliability_cases.py``).

    .venv/bin/python benchmarks/reliability.py [--timeout 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from flexpipe.runtime.execution.segments import build_stages
from flexpipe.runtime.models.kinds import build_model
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes import checkpoint as ck
from flexpipe.runtime.processes.faults import forward_fault
from flexpipe.runtime.processes.launch import LaunchError, launch_task
from flexpipe.runtime.processes.train import Job, TrainConfig, make_optimizer, run_job
from flexpipe.schedules import registry

MODEL = ModelSpec("gpt", layers=2, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2)


def fault_task(rank: int, world: int, victim: int, fault: str, stamp: str,
               timeout_s: float) -> list[object]:
    """1F1B for 4 steps; rank ``victim`` is killed or stalls at its 6th forward (step 1),
    writing the time of the fault to ``stamp`` first."""
    hooked = forward_fault(fault, 6, stamp=stamp, stall_s=3600) if rank == victim else None
    job = Job(registry.build("1f1b", world, 4), MODEL, TrainConfig(steps=4, timeout_s=timeout_s))
    return [run_job(job, rank, world, handlers=hooked)]


def fault_row(world: int, fault: str, timeout_s: float) -> list[str]:
    """Seconds from the fault to the LaunchError, the verdict, and whether all exited."""
    with tempfile.TemporaryDirectory() as tmp:
        stamp = str(Path(tmp) / "t")
        try:
            launch_task(fault_task, (world - 1, fault, stamp, timeout_s), world,
                        timeout_s=timeout_s, deadline_s=300)
            return [str(world), fault, "-", "no failure?", "-"]
        except LaunchError as err:
            if not Path(stamp).exists():
                return [str(world), fault, "-", f"failed before the fault: {err}".splitlines()[0],
                        "-"]
            delay = time.time() - float(Path(stamp).read_text())
            gone = all(_gone(pid) for pid in err.pids)
            nonzero = all(code not in (None, 0) for r, code in err.exit_codes.items()
                          if fault != "exit0" or r != world - 1)  # exit0: the victim quit 0
            return [str(world), fault, f"{delay:.2f}", str(err).splitlines()[0],
                    "yes" if gone and nonzero else "NO"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def checkpoint_row(hidden: int, layers: int) -> list[str]:
    """Write and read one checkpoint (DCP) of a 2-stage GPT with AdamW state, in one process:
    its size, and the ms to write (every file hashed, renamed into place) and to load it
    (every file's SHA-256 checked first)."""
    model = ModelSpec("gpt", layers=layers, hidden=hidden, heads=4, vocab=256, seq=32)
    built, _ = build_model(model)
    stages = build_stages(built, None, 2)
    params = [q for s in stages.values() for q in s.parameters()]
    opt = make_optimizer(params, TrainConfig(optimizer="adamw"))
    for q in params:
        q.grad = torch.ones_like(q)
    opt.step()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = ck.save(tmp, 1, stages, opt, meta=ck.describe(model, "adamw"))
        t1 = time.perf_counter()
        manifest = ck.latest(tmp)
        assert manifest is not None
        ck.load(manifest, stages, opt, {})
        t2 = time.perf_counter()
        size = sum(f.stat().st_size for f in folder.iterdir())
    count = sum(q.numel() for q in params)
    return [f"{count / 1e6:.2f} M", f"{size / 2**20:.1f} MiB", f"{(t1 - t0) * 1e3:.0f}",
            f"{(t2 - t1) * 1e3:.0f}"]


def main() -> None:
    """Print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="transfer timeout (s)")
    parser.add_argument("--cases", action=argparse.BooleanOptionalAction, default=True,
                        help="also replay issue #28's cases (reliability_cases.py)")
    args = parser.parse_args()
    console = Console(width=130)
    table = Table(title=f"failure detection (transfer timeout {args.timeout:g} s)")
    for col in ("ranks", "fault", "fault -> error (s)", "verdict", "all exited non-zero"):
        table.add_column(col)
    for world, fault in ((2, "kill"), (4, "kill"), (2, "stall"), (4, "stall"), (2, "exit0")):
        table.add_row(*fault_row(world, fault, args.timeout))
    console.print(table)
    cost = Table(title="one checkpoint of a 2-stage GPT with AdamW state (one process)")
    for col in ("parameters", "on disk", "write ms", "load ms"):
        cost.add_column(col)
    for hidden, layers in ((128, 2), (512, 4), (768, 8)):
        cost.add_row(*checkpoint_row(hidden, layers))
    console.print(cost)
    if args.cases:
        from reliability_cases import run_all

        cases = Table(title="issue #28 categories, replayed through the command line")
        for col in ("category", "cases", "as they should", "slowest (s)", "failed"):
            cases.add_column(col)
        for row in run_all(console.print):
            cases.add_row(*row)
        console.print(cases)


if __name__ == "__main__":
    main()
