"""Issue #28's categories and their neighbours, replayed through the command line (one
subprocess per case, as a user would run them): non-finite numbers, ranks given different jobs
(two torchrun "nodes" on this machine), size guards, the checkpoint directory, exit codes,
silent acceptances, and resumes (a nearly full disk, non-finite state in a checkpoint), per-rank
factory weights, blocked step folders, a key set twice in a job file, outputs that are inputs.
Each case passes when the run ends as it should (exit code, the words of the message, no
Python traceback from FlexPipe, no non-finite checkpoint); ``run_all`` returns one row per
category with its counts and the slowest case's seconds. ``reliability.py`` prints them."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TINY = ["--seq", "8", "--vocab", "32", "--hidden", "16", "--timeout", "20"]
MODELS = ROOT / "tests" / "runtime"  # nan_models.py: user models for the numerics cases
PATH = f"{ROOT / 'src'}{os.pathsep}{MODELS}"
"""The FlexPipe of this tree (not whichever is installed), and the test models."""


@dataclass(frozen=True)
class Outcome:
    """How one command ended: exit code, output, seconds."""

    code: int
    text: str
    seconds: float


@dataclass(frozen=True)
class Case:
    """A command (built in a scratch folder) and what must hold of its outcome."""

    name: str
    run: Callable[[Path], Outcome]
    ok: Callable[[Outcome, Path], bool]


def flexpipe(args: list[str], cwd: Path, timeout: float = 180) -> Outcome:
    """``flexpipe ARGS`` in ``cwd``."""
    t0 = time.perf_counter()
    proc = subprocess.run([str(BIN / "flexpipe"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": PATH})
    return Outcome(proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0)


def torchrun_pair(first: list[str], second: list[str], cwd: Path) -> Outcome:
    """Two torchrun 'nodes' of one rank each on this machine, each with its own arguments to
    ``flexpipe run``; the worse exit code and both outputs."""
    port = str(random.randint(20000, 40000))
    t0 = time.perf_counter()
    procs = [subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(r), "--master-addr", "127.0.0.1",
                               "--master-port", port, "-m", "flexpipe", "run", "--steps", "2",
                               *TINY, *args], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": PATH})
             for r, args in enumerate((first, second))]
    texts = [p.communicate(timeout=180)[0] for p in procs]
    codes = [p.returncode for p in procs]
    return Outcome(max(codes, key=abs), "\n".join(texts), time.perf_counter() - t0)


def clean(out: Outcome, *words: str) -> bool:
    """Failed with every word in the output and no traceback through FlexPipe's files (the
    torchrun agent's own report of a failed worker is not ours)."""
    return out.code != 0 and all(w in out.text for w in words) and \
        'flexpipe/' not in "".join(line for line in out.text.splitlines()
                                   if line.strip().startswith("File "))


def checkpoint_tensors(step: Path) -> dict[str, object]:
    """Every entry of the DCP checkpoint folder ``step`` (tensors whole), read back through
    torch's own converter."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(step, Path(tmp) / "whole.pt")
        return dict(torch.load(Path(tmp) / "whole.pt", weights_only=True))


def finite_checkpoints(folder: Path) -> bool:
    """Every checkpoint under ``folder`` holds finite parameters only."""
    import torch

    for step in folder.glob("step-*"):
        params = [t for k, t in checkpoint_tensors(step).items() if k.startswith("model.")]
        if not params or not all(bool(torch.isfinite(t).all()) for t in params):  # type: ignore[arg-type]
            return False
    return True


def _nan(args: list[str]) -> Case:
    def run(tmp: Path) -> Outcome:
        return flexpipe(["run", "1f1b", "-p", "2", "-m", "4", "--steps", "4",
                         "--checkpoint-dir", "ck", "--checkpoint-every", "1", *args], tmp)
    return Case(" ".join(args), run, lambda o, tmp: clean(o, "non-finite numbers at step")
                and finite_checkpoints(tmp / "ck"))


NUMERICS = [_nan(["--lr", "1e30", *TINY]), _nan(["--model", "nan_models:inf_data"]),
            _nan(["--model", "nan_models:nan_loss"]),
            _nan(["--lr", "1e30", "--optimizer", "sgd", *TINY])]


def _pair(name: str, first: list[str], second: list[str], word: str) -> Case:
    return Case(name, lambda tmp: torchrun_pair(first, second, tmp),
                lambda o, tmp: clean(o, "the ranks were given different jobs", word))


BASE = ["1f1b", "-p", "2", "-m", "4"]
JOBS = [
    _pair("--seed", [*BASE, "--seed", "0"], [*BASE, "--seed", "1"], "--seed: 0 on rank 0"),
    _pair("--lr", [*BASE, "--lr", "0.001"], [*BASE, "--lr", "0.01"], "--lr:"),
    _pair("-m", [*BASE], ["1f1b", "-p", "2", "-m", "6"], "-m: 4 on rank 0; 6 on rank 1"),
    _pair("schedule", [*BASE], ["zb-h1", "-p", "2", "-m", "4"], "schedule: 1f1b"),
    _pair("--steps", [*BASE, "--steps", "2"], [*BASE, "--steps", "3"], "--steps:"),
    _pair("--hidden", [*BASE, "--hidden", "16"], [*BASE, "--hidden", "32"], "--hidden:"),
    _pair("--dtype", [*BASE], [*BASE, "--dtype", "float64"], "--dtype:"),
    _pair("factory", ["1f1b", "-p", "2", "-m", "2", "--model", "nan_models:per_rank_width"],
          ["1f1b", "-p", "2", "-m", "2", "--model", "nan_models:per_rank_width"],
          "model shapes:"),
    _pair("--checkpoint-dir", [*BASE, "--checkpoint-dir", "a"],
          [*BASE, "--checkpoint-dir", "b"], "--checkpoint-dir:"),
    _pair("--dp (another world size)", [*BASE], [*BASE, "--dp", "2"], "--dp: 1 on rank 0"),
    _pair("--optimizer", [*BASE], [*BASE, "--optimizer", "sgd"], "--optimizer:"),
]


def _refused(name: str, args: list[str], *words: str, files: dict[str, str] | None = None,
             code: int = 2) -> Case:
    def run(tmp: Path) -> Outcome:
        for file, text in (files or {}).items():
            (tmp / file).write_text(text)
        return flexpipe(args, tmp)
    return Case(name, run, lambda o, tmp: o.code == code and clean(o, *words))


HUGE = "import torch\nfrom torch import nn\ndef big():\n    return (nn.Sequential(" \
    "nn.Linear(100000, 100000)), (torch.randn(2, 100000), torch.randn(2, 100000)), " \
    "nn.functional.mse_loss)\n"
SIZES = [
    _refused("--hidden 4000000", ["run", *BASE, "--hidden", "4000000"], "needs about"),
    _refused("--layers 1000000000", ["run", *BASE, "--layers", "1000000000"], "needs about"),
    _refused("job file hidden", ["run", *BASE, "--config", "j.toml"], "needs about",
             files={"j.toml": "[model]\nhidden = 4000000\n"}),
    _refused("job file layers", ["run", *BASE, "--config", "j.toml"], "needs about",
             files={"j.toml": "[model]\nlayers = 1000000000\n"}),
    _refused("factory of 10 G parameters", ["run", *BASE, "--model", "huge:big"],
             "needs about", files={"huge.py": HUGE}),
    _refused("plan over 1024 devices", ["plan", "--model", "gpt-1.3b", "--cluster",
                                        "nodes:1024"], "minutes", "--no-size-guard"),
]


def _ckdir(name: str, prepare: Callable[[Path], object], args: list[str],
           *words: str) -> Case:
    def run(tmp: Path) -> Outcome:
        keep = prepare(tmp)
        out = flexpipe(["run", *BASE, "--steps", "2", *TINY, *args], tmp)
        del keep
        return out
    return Case(name, run, lambda o, tmp: clean(o, *words) if o.code else all(
        w in o.text for w in words))


def _hold(tmp: Path) -> object:
    from flexpipe.runtime.processes import ckdir

    return ckdir.prepare(tmp / "ck", ckdir.Plan(0), lambda line: None)


def _stale(tmp: Path) -> object:
    (tmp / "ck" / "step-00000009").mkdir(parents=True)
    (tmp / "ck" / ".flexpipe.lock").write_text("pid=999999 host=gone since=0\n")
    (tmp / "ck" / "step-00000009" / ".manifest.json.tmp77").write_bytes(b"half")
    return None


def _file(tmp: Path) -> object:
    (tmp / "f").write_text("x")
    return None


CKDIR = [
    _ckdir("not writable", _file, ["--checkpoint-dir", "f/ck"], "is not usable"),
    _ckdir("held by another run", _hold, ["--checkpoint-dir", "ck"], "in use by another run"),
    _ckdir("stale lock, temporaries", _stale, ["--checkpoint-dir", "ck"],
           "took over the stale lock of pid 999999", "removed 1 temporary file"),
]


def _exit0(tmp: Path) -> Outcome:
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n" \
        "from reliability import fault_row\nprint(fault_row(2, 'exit0', 20))\n"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp, capture_output=True, text=True,
                          timeout=180)
    return Outcome(proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0)


EXITS = [Case("os._exit(0) mid-step", _exit0,
              lambda o, tmp: "rank 1 lost (exit code 0" in o.text)]

SILENT = [
    _refused("duplicate JSON key", ["simulate", "1f1b", "-p", "2", "-m", "4", "--cost",
                                    "c.json"], "'F' is given twice",
             files={"c.json": '{"num_stages": 2, "num_ranks": 2, "default": {"F": -1, '
                    '"F": 1}}'}),
    _refused("--param selective=maybe", ["simulate", "1f1b-recompute", "-p", "2", "-m", "4",
                                         "--param", "selective=maybe"], "true or false"),
    _refused("plan -o X --cost-out X", ["plan", "--model", "gpt-1.3b", "--cluster",
                                        "nodes:4", "-o", "x", "--cost-out", "x"], "both name"),
    _refused("run --cost-out without --predict", ["run", *BASE, "--cost-out", "c.json"],
             "--predict"),
    _refused("[run] checkpoint-dir = 5", ["run", *BASE, "--config", "j.toml"],
             "run.checkpoint-dir: expected a string",
             files={"j.toml": "[run]\ncheckpoint-dir = 5\n"}),
    _refused("[model] name = [\"gpt\"]", ["run", *BASE, "--config", "j.toml"],
             "model.name: expected a string", files={"j.toml": "[model]\nname = [\"gpt\"]\n"}),
    _refused("timeout = -1", ["run", *BASE, "--config", "j.toml"], "run.timeout",
             files={"j.toml": "[run]\ntimeout = -1\n"}),
]

def _inprocess(args: list[str], free: int, cwd: Path) -> Outcome:
    """``flexpipe ARGS`` in a fresh Python whose launcher sees ``free`` bytes free on every
    disk (the ranks it spawns see the real ones)."""
    code = "import collections, shutil, sys\nfrom flexpipe.cli.main import main\n" \
        "U = collections.namedtuple('U', 'total used free')\n" \
        f"shutil.disk_usage = lambda _: U({free} * 10, {free} * 9, {free})\n" \
        f"sys.exit(main({args!r}))\n"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": PATH})
    return Outcome(proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0)


RUN2 = ["run", *BASE, *TINY, "--checkpoint-dir", "ck"]


def _full_resume(name: str, steps: str, *words: str) -> Case:
    def run(tmp: Path) -> Outcome:
        flexpipe([*RUN2, "--steps", "2"], tmp)
        return _inprocess([*RUN2, "--steps", steps], 4096, tmp)
    return Case(name, run, lambda o, tmp: o.code == 0 and all(w in o.text for w in words))


def _poisoned(name: str, optimizer: str, key: str | None) -> Case:
    def run(tmp: Path) -> Outcome:
        flexpipe([*RUN2, "--steps", "2", "--optimizer", optimizer], tmp)
        _poison(tmp / "ck", key)
        return flexpipe([*RUN2, "--steps", "4", "--optimizer", optimizer], tmp)
    return Case(name, run, lambda o, tmp: clean(o, "refused on every rank",
                                                "holds non-finite values")
                and "step 3/" not in o.text)


def _poison(folder: Path, key: str | None) -> None:
    """A NaN in the last optimizer state ``key`` (None: the last parameter) of the newest
    checkpoint, written back as DCP with its manifest rewritten to match, as a hand (or a
    writer without the check) would leave it."""
    import json

    import torch
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    from flexpipe.runtime.processes import checkpoint as ck
    from flexpipe.runtime.processes import saved

    found = ck.latest(folder)
    assert found is not None
    data = checkpoint_tensors(found.path)
    name = sorted(k for k in data if k.startswith("optim.state.") and k.endswith(f".{key}")
                  or key is None and k.startswith("model."))[-1]
    data[name].view(-1)[0] = float("nan")  # type: ignore[attr-defined]
    for old in [*found.path.glob("*.distcp"), found.path / ".metadata"]:
        old.unlink()
    torch.save(data, folder / "poisoned.pt")
    torch_save_to_dcp(folder / "poisoned.pt", found.path)
    (folder / "poisoned.pt").unlink()
    body = json.loads((found.path / saved.MANIFEST).read_text())
    body["files"] = {f.name: {"rank": 0, "bytes": f.stat().st_size, "sha256": saved.sha256(f)}
                     for f in [*found.path.glob("*.distcp"), found.path / ".metadata"]}
    (found.path / saved.MANIFEST).write_text(json.dumps(body))


def _blocked(name: str, blocker: str) -> Case:
    def run(tmp: Path) -> Outcome:
        path = tmp / "ck" / blocker
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if blocker.endswith(".distcp") else path.write_text("x")
        return flexpipe([*RUN2, "--steps", "3", "--checkpoint-every", "2"], tmp)
    return Case(name, run, lambda o, tmp: o.code == 2 and clean(o, blocker, "before training")
                and "step 1/" not in o.text)


PER_RANK = ["1f1b", "-p", "2", "-m", "2", "--model", "nan_models:per_rank_values"]
COST = '{"num_stages": 2, "num_ranks": 2, "default": {"F": 1, "B": 2, "W": 1}}'


def _linked(name: str, args: list[str], *words: str) -> Case:
    def run(tmp: Path) -> Outcome:
        (tmp / "c.json").write_text(COST)
        flexpipe(["export", *BASE, "-o", "s.txt"], tmp)
        (tmp / "soft.json").symlink_to(tmp / "c.json")
        os.link(tmp / "c.json", tmp / "hard.json")
        return flexpipe(args, tmp)
    return Case(name, run, lambda o, tmp: o.code == 2 and clean(o, *words)
                and (tmp / "c.json").read_text() == COST)


NEIGHBOURS = [
    _full_resume("resume on a nearly full disk, every step done", "2", "resuming from",
                 "every step already done"),
    _full_resume("resume on a nearly full disk, one more step", "3", "all the same",
                 "resuming from"),
    _poisoned("NaN in AdamW's exp_avg_sq", "adamw", "exp_avg_sq"),
    _poisoned("NaN in SGD's momentum", "sgd", "momentum_buffer"),
    _poisoned("NaN in a parameter", "adamw", None),
    Case("factory: same shapes, per-rank values", lambda tmp: flexpipe(
        ["run", "gpipe", "-p", "2", "-m", "2", "--steps", "1", "--model",
         "nan_models:per_rank_values", "--timeout", "20"], tmp),
        lambda o, tmp: clean(o, "rank 1 built other initial weights", "2.bias")),
    Case("factory: same shapes, per-rank values (torchrun)", lambda tmp: torchrun_pair(
        PER_RANK, PER_RANK, tmp), lambda o, tmp: clean(o, "built other initial weights")),
    _blocked("a file at step-00000002", "step-00000002"),
    _blocked("a folder at step-00000002/__1_0.distcp", "step-00000002/__1_0.distcp"),
    _refused("[model] hidden vs [run] hidden", ["run", *BASE, "--config", "j.toml"],
             "model.hidden = 16 and run.hidden = 32 both set --hidden",
             files={"j.toml": "[model]\nhidden = 16\n[run]\nhidden = 32\n"}),
    _refused("[parallelism] degree vs [search] ranks", ["search", "-m", "4", "--mem", "4",
                                                        "--config", "j.toml"], "both set --ranks",
             files={"j.toml": "[parallelism]\npipeline_parallel_degree = 2\n[search]\n"
                    "ranks = 4\n"}),
    _linked("search -o a link to its --cost", ["search", "--cost", "c.json", *BASE[1:],
                                               "--mem", "4", "-o", "soft.json", "--force"],
            "--cost and -o both name"),
    _linked("draw -o a hard link to its --cost", ["draw", *BASE, "--cost", "c.json", "-o",
                                                  "hard.json", "--force"], "--cost and -o"),
    _linked("export -o its schedule", ["export", "s.txt", "-o", "./s.txt", "--force"],
            "the schedule and -o both name"),
]

CATEGORIES: dict[str, list[Case]] = {
    "non-finite loss/gradients": NUMERICS, "ranks with different jobs (torchrun)": JOBS,
    "size guards": SIZES, "checkpoint directory": CKDIR, "exit codes": EXITS,
    "silent acceptances": SILENT, "resume, weights, step folders, job files, outputs": NEIGHBOURS,
}


def run_all(say: Callable[[str], None] = print) -> list[list[str]]:
    """One row per category: name, cases, passed, slowest seconds, the failed cases."""
    rows = []
    for category, cases in CATEGORIES.items():
        passed, slowest, failed = 0, 0.0, []
        for case in cases:
            with tempfile.TemporaryDirectory() as tmp:
                out = case.run(Path(tmp))
                good = case.ok(out, Path(tmp))
            passed += good
            slowest = max(slowest, out.seconds)
            if not good:
                failed.append(case.name)
                say(f"FAILED {category} / {case.name} (exit {out.code}):\n{out.text[-1500:]}")
        rows.append([category, str(len(cases)), str(passed), f"{slowest:.1f}",
                     ", ".join(failed) or "-"])
    return rows
