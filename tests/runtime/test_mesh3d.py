"""Pipeline x data parallel (FSDP2) x tensor parallel on torch's own engines, against one process.

Every case trains 3 SGD steps in float64 and compares, gathered to full tensors, the losses, the
first step's gradients and the final parameters with the single-process run on the same data
(``reference_run``): pp 2 x dp 2 and pp 2 x tp 2 (4 ranks; the latter ``slow``, as
pp 2 x dp 2 x tp 2 covers tp) under 1F1B, ZB-H1, ZB-V and ZeroPP (whose AG/RS drive FSDP2's
unshard and reduce-scatter), and pp 2 x dp 2 x tp 2 (8 ranks) under ZeroPP (the other schedules
``slow``); ZeroPP's parameter and gradient
memory per rank is the simulator's prediction. A Hugging Face Llama given as its list of decoder
layers runs at pp 2 x dp 2 x tp 2 with its projections split by a user plan (ZB-V in CI, the
other schedules ``slow``, where the GPT runs every schedule in 3D); the
exported Llama runs under FSDP2 at pp 2 x dp 2; a checkpoint written at pp 2 x tp 2 loads at
pp 2 x dp 2 (FSDP2, the user's own mesh) exactly; a ``UserModel``'s own ``tp_plan`` splits its
layers at pp 2 x tp 2 like one process; the mesh and plan errors name what is wrong.
The 4-rank cases run in the shared 4-rank launch (``shared_launch``: one process group for the
4-rank cases of every file), and the 8-rank ones in the shared 8-rank launch, with them the
``main`` of ``examples/train_3d.py``, which must print that its parameters equal one process's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import shared_launch
import torch
import user_models as um

import flexpipe
from flexpipe.cli.main import main
from flexpipe.errors import ConfigError
from flexpipe.runtime.measurement.fsdp_memory import predicted_param_bytes
from flexpipe.runtime.models.gpt import TP_PLAN, GPTConfig, gpt_layers, lm_loss
from flexpipe.runtime.models.kinds import tp_plan
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.reference import reference_run
from flexpipe.runtime.processes.train import Job, TrainConfig, build_rank, run_job
from flexpipe.runtime.transport.engines import tensor_parallel
from flexpipe.schedules import registry

GPT = ModelSpec("gpt", layers=4, hidden=16, heads=4, vocab=32, seq=8, micro_batch=2,
                dtype="float64")
M, STEPS, RTOL = 4, 3, 1e-9
SCHEDULES = ("1f1b", "zb-h1", "zb-v", "zeropp")
LLAMA_CI = ("zb-v", "zeropp")
GPT_3D_CI = ("zeropp",)
"""The GPT's schedules at pp 2 x dp 2 x tp 2 in CI (FSDP2 driven by ZeroPP's AG/RS, with tensor
parallelism); the Llama's layers add ZB-V in 3D, pp 2 x dp 2 runs every schedule, and the other
schedules in 3D are ``slow``."""
"""The Llama's schedules in 3D in CI (the W split on a V, and FSDP2 under ZeroPP); the others
are ``slow``."""


def _schedule(name: str) -> Any:
    return registry.build(name, 2, M, **({"v": 2} if name == "zeropp" else {}))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _rank_cases(dp: int, tp: int, schedules: tuple[str, ...] = SCHEDULES) -> list[Any]:
    """Each schedule in turn on this rank (one process group for all of them)."""
    import torch.distributed as dist

    out = []
    for name in schedules:
        train = TrainConfig(steps=STEPS, dp=dp, tp=tp, capture=True, timeout_s=120,
                            measure_memory=name == "zeropp")
        out.append(run_job(Job(_schedule(name), GPT, train), dist.get_rank(),
                           dist.get_world_size()))
    return out


def _worst(results: list[list[Any]], dp: int, schedules: tuple[str, ...] = SCHEDULES
           ) -> dict[str, float]:
    """Per schedule, the worst relative error over ranks of loss, gradients and parameters."""
    ref = reference_run(GPT, TrainConfig(steps=STEPS, dp=dp), M)
    out = {}
    for i, name in enumerate(schedules):
        errs = [0.0]
        for rank in results:
            res = rank[i]
            errs += [_rel(g, ref.grads[k]) for k, g in res.grads.items()]
            errs += [_rel(p, ref.params[k]) for k, p in res.params.items()]
            errs += [abs(a - b) / abs(b) for a, b in zip(res.losses, ref.losses, strict=True)
                     if a is not None]
            assert set(res.params) <= set(ref.params)
        out[name] = max(errs)
    return out


def _four_ranks(path: str, hf: bool) -> dict[str, Any]:
    """The 4-rank cases in one process group: the GPT at pp 2 x dp 2 under every schedule, the
    exported Llama under FSDP2 (with ``hf``) and the checkpoint moved between meshes."""
    import matrix_models as mm

    out: dict[str, Any] = {"gpt": _rank_cases(2, 1)}
    if hf:  # ZeroPP at p = 2 has 4 stages (v = 2)
        out["llama"] = mm.under_dp("llama", "zeropp", 4, STEPS, {"v": 2})
    out["checkpoint"] = _checkpoint_across_meshes(path)
    out["user-tp"] = _user_model_tp()
    return out


def _example(name: str) -> str:
    """What ``examples/<name>``'s ``main()`` prints on this rank (run in this process group,
    as the script's own ``flexpipe.spawn(main, ...)`` runs it)."""
    import contextlib
    import io
    import runpy
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).parents[2] / "examples" / name))
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        script["main"]()
    return text.getvalue()


def _eight_ranks(hf: bool) -> dict[str, Any]:
    """The 8-rank cases in one process group: the GPT at pp 2 x dp 2 x tp 2 under
    ``GPT_3D_CI``, the Llama's layers in 3D (with ``hf``, under ``LLAMA_CI``) and
    ``examples/train_3d.py``."""
    out: dict[str, Any] = {"gpt": _rank_cases(2, 2, GPT_3D_CI)}
    if hf:
        out["llama"] = _llama_layers_3d(LLAMA_CI)
    out["example"] = _example("train_3d.py")
    return out


def _four_ranks_part() -> shared_launch.Part:
    """The 4-rank part, its checkpoint in a folder removed when the test process ends."""
    return _four_ranks, (f"{shared_launch.folder('flexpipe-mesh3d-')}/ck",
                         um.installed("transformers"))


shared_launch.register(4, "mesh3d", _four_ranks_part)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    """The 4-rank cases' part of the shared 4-rank launch."""
    return shared_launch.results(4, "mesh3d")


shared_launch.register(8, "mesh3d", lambda: (_eight_ranks, (um.installed("transformers"),)))


@pytest.fixture(scope="module")
def eight_ranks() -> list[dict[str, Any]]:
    """The 8-rank cases' part of the shared 8-rank launch."""
    return shared_launch.results(8, "mesh3d")


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
@pytest.mark.parametrize(("dp", "tp"), [
    (2, 1), pytest.param(1, 2, marks=pytest.mark.slow), (2, 2)],
    ids=["pp2xdp2", "pp2xtp2", "pp2xdp2xtp2"])  # pp2xdp2xtp2 covers tp in CI
def test_gpt_equals_one_process(dp: int, tp: int, request: pytest.FixtureRequest) -> None:
    schedules = GPT_3D_CI if (dp, tp) == (2, 2) else SCHEDULES
    if (dp, tp) == (2, 1):
        results = [r["gpt"] for r in request.getfixturevalue("four_ranks")]
    elif (dp, tp) == (2, 2):
        results = [r["gpt"] for r in request.getfixturevalue("eight_ranks")]
    else:
        results = flexpipe.spawn(_rank_cases, 2 * dp * tp, dp, tp, timeout_s=300,
                                 deadline_s=800)
    _check_gpt(results, dp, tp, schedules)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpt_in_3d_under_the_other_schedules() -> None:
    """The schedules of ``SCHEDULES`` not in ``GPT_3D_CI`` at pp 2 x dp 2 x tp 2, in an 8-rank
    launch of their own."""
    others = tuple(s for s in SCHEDULES if s not in GPT_3D_CI)
    _check_gpt(flexpipe.spawn(_rank_cases, 8, 2, 2, others, timeout_s=300, deadline_s=800),
               2, 2, others)


def _check_gpt(results: list[list[Any]], dp: int, tp: int, schedules: tuple[str, ...]) -> None:
    assert len(results) == 2 * dp * tp
    covered = {k for r in results for k in r[0].params}
    assert covered == set(reference_run(GPT, TrainConfig(steps=1), M).params)
    worst = _worst(results, dp, schedules)
    assert all(v <= RTOL for v in worst.values()), worst
    if tp == 1:
        _check_fsdp_memory(results, dp)


def _check_fsdp_memory(results: list[list[Any]], dp: int) -> None:
    """ZeroPP's parameter and gradient bytes per rank (FSDP2: shards, gathered parameters,
    unsharded gradients) as the simulator predicts them, within 10% (measured: exact)."""
    schedule = _schedule("zeropp")
    sizes = []
    for s in range(schedule.num_stages):
        stages, _ = build_rank(Job(schedule, GPT), schedule.placement.stage_rank[s])
        sizes.append(sum(p.numel() * p.element_size() for p in stages[s].parameters()))
    predicted = predicted_param_bytes(schedule, sizes, dp)
    zeropp = SCHEDULES.index("zeropp")
    for rank in results:
        res = rank[zeropp]
        measured = max(res.param_bytes)
        assert abs(measured / predicted[res.pipe_rank] - 1) <= 0.10, \
            (res.rank, measured, predicted)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_hugging_face_llama_under_fsdp2(four_ranks: list[dict[str, Any]]) -> None:
    pytest.importorskip("transformers")
    assert max(r["llama"] for r in four_ranks) <= RTOL


def _llama_layers_3d(schedules: tuple[str, ...]) -> list[float]:
    """pp 2 x dp 2 x tp 2: a Hugging Face Llama given as its list of layers (its decoder
    layers' own q/k/v/o and MLP projections split by ``LLAMA_TP_PLAN``) under each schedule;
    per schedule the worst relative parameter error after 3 SGD steps against one process."""
    import matrix_models as mm

    out = []
    for name in schedules:
        layers = mm.llama_layers()
        ref = torch.nn.Sequential(*copy.deepcopy(layers))
        pipe = flexpipe.pipeline(layers, name, m=2, dp=2, tp=2, tp_plan=mm.LLAMA_TP_PLAN,
                                 loss_fn=lm_loss, **({"v": 2} if name == "zeropp" else {}))
        opt = torch.optim.SGD(pipe.param_groups(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(step))
            mine = ids.chunk(2)[pipe.replica]
            opt.zero_grad()
            ref_opt.zero_grad()
            pipe.step(mine if pipe.needs_inputs else None,
                      mine.roll(-1, 1) if pipe.needs_targets else None)
            for part in ids.chunk(4):
                (lm_loss(ref(part), part.roll(-1, 1)) / 4).backward()
            opt.step()
            ref_opt.step()
        want = dict(ref.named_parameters())
        out.append(max(_rel(q, want[n]) for n, q in pipe.full_named_parameters().items()))
    return out


def _check_llama(schedules: tuple[str, ...], errors: list[list[float]]) -> None:
    worst = dict(zip(schedules, (max(e) for e in zip(*errors, strict=True)), strict=True))
    assert all(v <= RTOL for v in worst.values()), worst


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_hugging_face_llama_layers_in_3d(eight_ranks: list[dict[str, Any]]) -> None:
    pytest.importorskip("transformers")
    _check_llama(LLAMA_CI, [r["llama"] for r in eight_ranks])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hugging_face_llama_layers_in_3d_under_the_other_schedules() -> None:
    """The schedules of ``SCHEDULES`` not in ``LLAMA_CI``, in an 8-rank launch of their own."""
    pytest.importorskip("transformers")
    others = tuple(s for s in SCHEDULES if s not in LLAMA_CI)
    _check_llama(others, flexpipe.spawn(_llama_layers_3d, 8, others, timeout_s=300,
                                        deadline_s=800))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_the_3d_example_trains_like_one_process(eight_ranks: list[dict[str, Any]]) -> None:
    """``examples/train_3d.py`` (docs/runtime.md: ``python examples/train_3d.py``, which spawns
    8 processes for its ``main``), its ``main`` run in the 8-rank launch: the rank holding the
    loss of replica 0 says the parameters equal one process's."""
    said = [r["example"] for r in eight_ranks if r["example"]]
    assert len(said) == 1, said
    assert "pp 2 x dp 2 x tp 2, zeropp: final loss" in said[0], said
    assert "parameters equal to one process" in said[0], said


def _gpt_pipe(**kw: Any) -> Any:
    torch.manual_seed(0)
    layers = gpt_layers(GPTConfig(vocab=32, hidden=16, heads=4, layers=4, seq=8))
    layers = [m.double() for m in layers]
    return flexpipe.pipeline(layers, kw.pop("schedule", "1f1b"), m=2, loss_fn=lm_loss, **kw)


def _train(pipe: Any, steps: int) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(pipe.param_groups(), lr=0.1, momentum=0.9)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 32, (4, 8), generator=gen)
        opt.zero_grad()
        pipe.step(ids if pipe.needs_inputs else None,
                  ids.roll(-1, 1) if pipe.needs_targets else None)
        opt.step()
    return opt


def _full(pipe: Any) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in pipe.named_parameters()}


def _checkpoint_across_meshes(path: str) -> tuple[Any, ...]:
    """Train at pp 2 x tp 2 and save (with the optimizer); load at pp 2 x dp 2 under ZeroPP
    (FSDP2, 4 stages) on the user's own mesh with its dimensions in another order: (what this
    rank saved, what it loaded, full tensors by name; the errors of two meshes that do not fit
    the run)."""
    from torch.distributed.device_mesh import init_device_mesh

    a = _gpt_pipe(tp=2, tp_plan=TP_PLAN)
    opt_a = _train(a, 2)
    a.save(path, opt_a)
    saved = _full(a)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    b = _gpt_pipe(mesh=mesh, schedule="zeropp", v=2)
    opt_b = torch.optim.SGD(b.param_groups(), lr=0.1, momentum=0.9)
    b.load(path, opt_b)
    errors = {}
    for what, bad in {"no pp": {"mesh": init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))},
                      "tp": {"mesh": mesh, "tp": 2},
                      "plan": {"tp": 2, "tp_plan": {"*.nothing": "colwise"}}}.items():
        try:
            _gpt_pipe(**bad)
        except ConfigError as exc:
            errors[what] = str(exc)
    return saved, _full(b), errors


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_checkpoint_moves_between_meshes(four_ranks: list[dict[str, Any]]) -> None:
    got = [r["checkpoint"] for r in four_ranks]
    saved = {n: t for s, _, _ in got for n, t in s.items()}
    loaded = {n: t for _, ld, _ in got for n, t in ld.items()}
    errors = got[0][2]
    assert "FlexPipe needs one named 'pp'" in errors["no pp"], errors
    assert "tp is 1 in the mesh but 2 in the run" in errors["tp"], errors
    assert "matches no module of stages [0]" in errors["plan"], errors
    assert set(saved) == set(loaded) and len(saved) == 4 * 12 + 2 + 3
    assert max(_rel(loaded[n], saved[n]) for n in saved) <= RTOL


def _user_model_tp() -> tuple[float, list[str]]:
    """pp 2 x tp 2 (ZB-H1): the GPT's layers given to ``flexpipe.pipeline`` as a
    ``UserModel`` whose ``tp_plan`` is the only plan: (the worst relative error of the
    parameters after 2 SGD steps against one process, the parameters this rank holds as
    tensor-parallel shards)."""
    torch.manual_seed(0)
    layers = [m.double() for m in gpt_layers(GPTConfig(vocab=32, hidden=16, heads=4, layers=4,
                                                       seq=8))]
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    user = flexpipe.UserModel(layers, lm_loss, tp_plan=TP_PLAN)
    pipe = flexpipe.pipeline(user, "zb-h1", m=2, tp=2)
    _train(pipe, 2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(step))
        ref_opt.zero_grad()
        lm_loss(ref(ids), ids.roll(-1, 1)).backward()
        ref_opt.step()
    want = dict(ref.named_parameters())
    worst = max(_rel(q, want[n]) for n, q in pipe.full_named_parameters().items())
    return worst, sorted(n for n, p in pipe.named_parameters() if hasattr(p, "full_tensor"))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_a_user_models_own_tp_plan_splits_its_layers(four_ranks: list[dict[str, Any]]) -> None:
    results = [r["user-tp"] for r in four_ranks]
    assert max(worst for worst, _ in results) <= RTOL
    assert all(any(n.endswith(".qkv.weight") for n in split) for _, split in results), results


def test_a_bad_plan_and_mesh_are_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown style\(s\) \['diagonal'\]"):
        tensor_parallel(torch.nn.Linear(2, 2), None, {"*": "diagonal"}, {"": "x"}, "stage 0")
    with pytest.raises(ConfigError, match="tp = 3 does not divide the GPT's 4 attention heads"):
        tp_plan(GPT, 3)
    with pytest.raises(ConfigError, match="'mlp' has no tensor-parallel plan"):
        tp_plan(ModelSpec("mlp"), 2)


def test_the_command_line_refuses_what_tp_does_not_support(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "1f1b", "-p", "2", "-m", "4", "--tp", "2", "--predict"])
    assert code != 0 and "does not model tensor-parallel collectives" in capsys.readouterr().err
