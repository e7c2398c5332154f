"""A model object with parametrizations crosses to the rank processes (``portable``): pickled
as a launch pickles it, it comes back parametrized, computing what it computed and training
its original tensors; a job that cannot be pickled fails the launch with an error that names
the factory way round it, before any rank starts."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import user_models as um
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import flexpipe
from flexpipe.errors import ConfigError
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.runtime.user.portable import portable
from flexpipe.specs import load


class Reparametrized(nn.Module):
    """Weight norm, spectral norm and an orthogonal map, each on its own layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = parametrizations.weight_norm(nn.Conv1d(2, 4, 3))
        self.b = parametrizations.spectral_norm(nn.Linear(4, 4))
        self.c = parametrizations.orthogonal(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x).mean(-1)))


def test_a_parametrized_model_crosses_as_it_is() -> None:
    torch.manual_seed(0)
    model = Reparametrized().double().eval()  # spectral norm's vectors stay as they are
    job = [{"model": model}]  # nested as a launch's arguments nest it
    portable(job)
    back = pickle.loads(ForkingPickler.dumps(job))[0]["model"]
    assert all(parametrize.is_parametrized(getattr(back, n)) for n in "abc")
    x = torch.randn(3, 2, 5, dtype=torch.float64)
    assert torch.equal(back(x), model(x))
    assert back.state_dict().keys() == model.state_dict().keys()
    for (name, p), q in zip(back.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    back(x).square().sum().backward()
    assert all(p.grad is not None for p in back.parameters())


def test_a_job_that_cannot_be_pickled_names_the_factory_way() -> None:
    model = flexpipe.UserModel(um.SkipNet().double(), lambda y, t: (y - y).sum(),
                               um.vectors(0, 2), split_points=("mid.1",))
    with pytest.raises(ConfigError, match=r"cannot send the job to the rank processes "
                                          r".*factory='package.module:function'"):
        launch([Job(load("1f1b", 2, 4), model, TrainConfig(steps=1))], world=2)
