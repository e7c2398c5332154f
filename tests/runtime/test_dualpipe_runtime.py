"""DualPipe (the two-way schedule) run for real over gloo trains exactly like one device: each
rank holds model stage r and model stage p-1-r, the way down trains on micro-batches 0..m-1 of
the step's 2m and the way up on m..2m-1, the two copies' gradients are summed over the pair of
ranks holding them. Against one process on the same 2m micro-batches: the loss (on both ranks
with a last stage), every gradient of the first step on every rank, every parameter after
three steps, and the two copies of every model stage bit-equal; the built-in GPT and the MoE
at p = 2 (m = 2, 4) and p = 4 (m = 4), with the overlapped pairs' passes at once and in turn
(``flattened``); clipping counts each model parameter once (the same run as 1F1B's, clipped);
p = 2 x 2 data-parallel replicas, and x 2 expert-parallel ranks (the MoE). A checkpoint holds
each model stage once and resumes exactly; on ``--data`` the losses and validation losses are
1F1B's; ``flexpipe.pipeline`` runs it in a training loop of one's own (steps accumulated);
``flexpipe run dualpipe`` prints the losses of its run (the same as ``dualpipev``'s on the same
data, and one process's). The cases run in the shared 2- and 4-rank launches (the command's
runs too: its launch is handed their results)."""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

import pytest
import shared_launch
import torch

from flexpipe.cli import cmd_run
from flexpipe.cli.main import build_parser, main
from flexpipe.errors import ConfigError
from flexpipe.runtime.data.corpus import DataConfig
from flexpipe.runtime.execution.precision import MixedPrecision
from flexpipe.runtime.execution.stage import as_tuple
from flexpipe.runtime.measurement.compare import worst_relative_error
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes import launch
from flexpipe.runtime.processes.launch import check_job
from flexpipe.runtime.processes.progress import StepReport
from flexpipe.runtime.processes.reference import Reference, reference_run
from flexpipe.runtime.processes.train import Job, RankResult, TrainConfig
from flexpipe.schedules import registry

pytestmark = pytest.mark.timeout(shared_launch.TIMEOUT_S)
RTOL = 1e-9
GPT = ModelSpec("gpt", layers=6, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2,
                dtype="float64")
MOE = ModelSpec("moe", layers=2, hidden=16, vocab=32, seq=8, micro_batch=2, experts=4,
                dtype="float64")
MODELS = {"gpt": GPT, "moe": MOE}
TRAIN = TrainConfig(steps=3, capture=True, timeout_s=60)
CLIPPED = TrainConfig(steps=3, capture=True, timeout_s=60, max_norm=1e-3)
MS = {2: (2, 4), 4: (4,)}
SAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_text.txt")
TEXT = ModelSpec("gpt", layers=2, hidden=16, heads=2, vocab=256, seq=16, micro_batch=2)
ON_DATA = TrainConfig(steps=2, data=DataConfig(SAMPLE), val_every=1, timeout_s=60)


def _dualpipe(p: int, m: int, overlapped: bool = True):  # noqa: ANN202
    sched = registry.build("dualpipe", p, m)
    return sched if overlapped else sched.flattened()


@cache
def _jobs(world: int) -> dict[object, Job]:
    jobs: dict[object, Job] = {(name, m, overlapped): Job(_dualpipe(world, m, overlapped), spec,
                                                         TRAIN)
                               for name, spec in MODELS.items() for m in MS[world]
                               for overlapped in (True, False)}
    if world == 2:  # clipped: the same run as 1F1B's on the same 2m micro-batches
        jobs["clipped"] = Job(_dualpipe(2, 2), GPT, CLIPPED)
        jobs["clipped 1f1b"] = Job(registry.build("1f1b", 2, 4), GPT, CLIPPED)
        jobs |= _checkpointed()
        jobs["data"] = Job(_dualpipe(2, 2), TEXT, ON_DATA)
        jobs["data 1f1b"] = Job(registry.build("1f1b", 2, 4), TEXT, ON_DATA)
    if world == 4:  # 2 pipeline ranks x 2 data-parallel replicas, or x 2 expert-parallel
        jobs["dp2"] = Job(_dualpipe(2, 2), GPT, TrainConfig(steps=3, capture=True, dp=2))
        jobs["ep2"] = Job(_dualpipe(2, 2), MOE, TrainConfig(steps=3, capture=True, ep=2))
    return jobs


def _folder(name: str) -> str:
    """A checkpoint folder of this test run (made in the launcher, named alike on every rank)."""
    return os.path.join(tempfile.gettempdir(), f"flexpipe-dualpipe-{os.getpid()}-{name}")


def _checkpointed() -> dict[object, Job]:
    """Two steps with a checkpoint after each, then the run resumed to three; 1F1B's
    checkpoint of the same model after one step, to compare sizes with."""
    ck = {"dualpipe": _folder("dualpipe"), "1f1b": _folder("1f1b")}
    for folder in ck.values():
        shutil.rmtree(folder, ignore_errors=True)
    every = dict(steps=3, capture=True, timeout_s=60, checkpoint_dir=ck["dualpipe"],
                 checkpoint_every=1)
    return {"ck first": Job(_dualpipe(2, 2), GPT, TrainConfig(**{**every, "steps": 2})),
            "ck resumed": Job(_dualpipe(2, 2), GPT, TrainConfig(**every)),
            "ck 1f1b": Job(registry.build("1f1b", 2, 4), GPT,
                           TrainConfig(steps=1, checkpoint_dir=ck["1f1b"]))}


for _world in (2, 4):
    shared_launch.register(_world, "dualpipe",
                           lambda w=_world: shared_launch.jobs(_jobs(w).values(), w))


def _pipeline_run() -> dict[str, object]:
    """On every rank: ``flexpipe.pipeline`` of the GPT's layers under DualPipe (p = 2, m = 2
    each way); two steps accumulated, then an SGD update: the losses, the accumulated
    gradients and the parameters after the update, by the model's names."""
    import flexpipe
    from flexpipe.runtime.models.kinds import build_model

    layers, loss_fn = build_model(GPT)
    pipe = flexpipe.pipeline(layers, "dualpipe", m=2, loss_fn=loss_fn)
    losses = []
    for step in range(2):
        x, y = _whole_batch(step)
        losses.append(pipe.step(x if pipe.needs_inputs else None,
                                y if pipe.needs_targets else None))
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    torch.optim.SGD(pipe.parameters(), lr=0.05).step()
    return {"losses": [None if v is None else float(v) for v in losses], "grads": grads,
            "params": {n: p.detach().clone() for n, p in pipe.named_parameters()}}


def _whole_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4 micro-batches of ``step`` as one batch (inputs, targets)."""
    from flexpipe.runtime.models.kinds import make_batch

    batch = make_batch(GPT, step, 4)
    return torch.cat([b[0][0] for b in batch]), torch.cat([b[1] for b in batch])


shared_launch.register(2, "dualpipe pipeline", lambda: (_pipeline_run, ()))

CLI = ("-p", "2", "--steps", "3", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq",
       "8", "--vocab", "32", "--micro-batch-size", "2", "--dtype", "float64", "--json")
CLI_RUNS = {"dualpipe": ("run", "dualpipe", "-m", "2", *CLI),  # 2 each way: 4 micro-batches
            "dualpipev": ("run", "dualpipev", "-m", "4", *CLI)}


@cache
def _cli_job(name: str) -> Job:
    """The job ``flexpipe run`` builds from ``CLI_RUNS[name]``."""
    return cmd_run._jobs(build_parser("run").parse_args(list(CLI_RUNS[name])))


shared_launch.register(2, "dualpipe cli",
                       lambda: shared_launch.jobs([_cli_job(n) for n in CLI_RUNS], 2))


def _runs(world: int) -> dict[object, list[RankResult]]:
    return dict(zip(_jobs(world), shared_launch.job_results(world, "dualpipe"), strict=True))


@cache
def _reference(name: str, microbatches: int, dp: int = 1, ep: int = 1) -> Reference:
    return reference_run(MODELS[name], TrainConfig(steps=3, capture=True, dp=dp, ep=ep),
                         microbatches)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    name, err = worst_relative_error(got, {k: want[k] for k in got})
    assert err <= RTOL, f"{what} {name}: relative diff {err:.3g}"


def _check(ranks: list[RankResult], ref: Reference, p: int) -> None:
    """Losses on the two ranks of each replica with a last stage (0 and p-1), every rank's
    gradients and parameters against ``ref``, the two copies (ranks r, p-1-r of a replica)
    bit-equal."""
    at = {(r.replica, r.pipe_rank): r for r in ranks}
    for r in ranks:
        assert (r.losses[0] is not None) == (r.pipe_rank in (0, p - 1))
        if r.losses[0] is not None:
            assert r.losses == pytest.approx(ref.losses, rel=RTOL)
        _close(r.grads, ref.grads, f"rank {r.rank}: gradient")
        _close(r.params, ref.params, f"rank {r.rank}: parameter after 3 steps")
        twin = at[(r.replica, p - 1 - r.pipe_rank)]
        assert r.params.keys() == twin.params.keys()
        assert all(torch.equal(t, twin.params[k]) for k, t in r.params.items())
    assert set().union(*(r.params for r in ranks)) == set(ref.params)


@pytest.mark.parametrize("overlapped", [True, False], ids=["pairs at once", "in turn"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("world", [2, 4], ids=["p2", "p4"])
def test_dualpipe_matches_one_process(world: int, name: str, overlapped: bool) -> None:
    runs = _runs(world)
    for m in MS[world]:
        _check(runs[(name, m, overlapped)], _reference(name, 2 * m), world)


def test_clipping_counts_each_model_parameter_once() -> None:
    runs = _runs(2)
    dual, chain = runs["clipped"], runs["clipped 1f1b"]
    want = {k: v for r in chain for k, v in r.params.items()}
    for r in dual:
        _close(r.params, want, f"rank {r.rank}: clipped parameter")
    loss = next(r.losses for r in chain if r.losses[0] is not None)
    assert all(r.losses == pytest.approx(loss, rel=RTOL) for r in dual)


def test_data_parallel_replicas() -> None:
    _check(_runs(4)["dp2"], _reference("gpt", 4, dp=2), 2)


def test_expert_parallel_ranks() -> None:
    """The MoE's experts shared out over 2 ranks of each pipeline rank (the data of each its
    own, as replicas'): the two copies of an expert are on the same ep rank of the pair."""
    runs = _runs(4)["ep2"]
    _check(runs, _reference("moe", 4, ep=2), 2)
    names = [set(r.params) for r in runs]
    assert len({frozenset(n) for n in names}) == 2  # each ep rank its own experts


@pytest.mark.parametrize("what,train,pattern", [
    ("tp", TrainConfig(tp=2), "tensor parallelism"),
    ("bf16", TrainConfig(mixed_precision=MixedPrecision()), "mixed precision"),
])
def test_what_does_not_run_yet_is_refused_by_name(what: str, train: TrainConfig,
                                                   pattern: str) -> None:
    job = Job(_dualpipe(2, 2), GPT, train)
    with pytest.raises(ConfigError, match=f"two-way placement yet with {pattern}"):
        check_job(job, job.world)


def test_fsdp_is_refused_by_name() -> None:
    from flexpipe.ir.sharded import shard_per_step

    job = Job(shard_per_step(_dualpipe(2, 2)), GPT, TrainConfig(dp=2))
    with pytest.raises(ConfigError, match=r"with FSDP \(AG/RS ops\)"):
        check_job(job, job.world)


def _cli_report(name: str, capsys: pytest.CaptureFixture[str],
                monkeypatch: pytest.MonkeyPatch) -> dict:  # type: ignore[type-arg]
    """``flexpipe run`` of ``CLI_RUNS[name]``, its launch handed that job's run in the shared
    launch (every rank's step reports replayed, as the ranks send them); the JSON report."""
    import json

    ranks = shared_launch.job_results(2, "dualpipe cli")[list(CLI_RUNS).index(name)]

    def shared(jobs, world, on_update=None, **_):  # noqa: ANN001, ANN003, ANN202
        assert list(jobs) == [_cli_job(name)] and world == 2
        for step in range(jobs[0].train.steps):
            for r in ranks:
                on_update(r.rank, StepReport(r.rank, step, r.losses[step], r.step_times[step],
                                             1))
        return [ranks]

    monkeypatch.setattr(launch, "launch", shared)
    monkeypatch.setenv("FLEXPIPE_BACKEND", "gloo")
    assert main(list(CLI_RUNS[name])) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_flexpipe_run_dualpipe_prints_the_losses_of_dualpipev_and_one_process(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    dual = _cli_report("dualpipe", capsys, monkeypatch)
    assert dual["schedule"] == "dualpipe" and dual["m"] == 2 and dual["global_batch_size"] == 8
    v = _cli_report("dualpipev", capsys, monkeypatch)
    assert len(dual["losses"]) == 3 and dual["losses"] == pytest.approx(v["losses"], rel=RTOL)
    job = _cli_job("dualpipe")
    assert dual["losses"] == pytest.approx(reference_run(job.model, job.train, 4).losses,
                                           rel=RTOL)


def _bytes(folder: str, step: int) -> int:
    return sum(f.stat().st_size for f in Path(folder, f"step-{step:08d}").glob("*.distcp"))


def test_a_checkpoint_holds_each_model_stage_once_and_resumes_exactly() -> None:
    """Resumed after two of three steps, the run ends with the parameters of the run straight
    through, bit for bit; its checkpoint is the size of 1F1B's of the same model (each model
    stage's parameters and momentum written once, not once per copy)."""
    runs = _runs(2)
    straight, resumed = runs[("gpt", 2, True)], runs["ck resumed"]
    assert all(r.start_step == 2 for r in resumed)
    for a, b in zip(straight, resumed, strict=True):
        assert a.params.keys() == b.params.keys()
        assert all(torch.equal(t, b.params[k]) for k, t in a.params.items())
        assert b.losses == a.losses[2:]
    dual, chain = _bytes(_folder("dualpipe"), 3), _bytes(_folder("1f1b"), 1)
    try:
        assert 0.9 * chain < dual < 1.1 * chain, (dual, chain)
    finally:
        for name in ("dualpipe", "1f1b"):
            shutil.rmtree(_folder(name), ignore_errors=True)


def test_the_data_and_the_validation_loss_are_1f1bs() -> None:
    """On ``--data`` (the text sample), DualPipe's losses and validation losses after each
    step are 1F1B's on the same 2m micro-batches (float32)."""
    runs = _runs(2)
    for key in ("losses", "val_losses"):
        want = next(getattr(r, key) for r in runs["data 1f1b"] if r.losses[0] is not None)
        for r in runs["data"]:
            got = getattr(r, key)
            assert got == pytest.approx(want, rel=1e-5), (key, got, want)


def _one_process() -> dict[str, object]:
    """``_pipeline_run`` on one process: the whole model, each micro-batch's loss / 4."""
    from flexpipe.runtime.models.kinds import build_model

    layers, loss_fn = build_model(GPT)
    model = torch.nn.ModuleList(layers)
    losses = []
    for step in range(2):
        x, y = _whole_batch(step)
        total = 0.0
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            out: tuple[torch.Tensor, ...] = (xs,)
            for layer in model:
                out = as_tuple(layer(*out))
            loss = loss_fn(*out, ys) / 4
            loss.backward()
            total += loss.item()
        losses.append(total)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.05).step()
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_flexpipe_pipeline_runs_dualpipe_and_accumulates() -> None:
    """Your own training loop: two ``step`` calls accumulated (each pair's sum adds only its
    step's part), the loss on both last stages, then your optimizer: one process's."""
    ranks, want = shared_launch.results(2, "dualpipe pipeline"), _one_process()
    for r in ranks:
        assert r["losses"] == pytest.approx(want["losses"], rel=RTOL)
        _close(r["grads"], want["grads"], "accumulated gradient")
        _close(r["params"], want["params"], "parameter after the update")
    assert set(ranks[0]["params"]) == set(want["params"])
