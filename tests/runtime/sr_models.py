"""Models under selective-recompute policies (``flexpipe.Recompute``), as factories the rank
processes call by name (``sr_models:net_mlp``): a user's ``nn.Module`` (``test_user_recompute``'s
four blocks of a linear attention stand-in and an MLP, hidden 64) and the tiny Hugging Face
GPT-2 (exported), each cut into 2 stages, under the policies ``POLICIES`` names."""

from __future__ import annotations

from collections.abc import Callable

import torch
import user_models as um
from test_user_recompute import MLP, Net, _loss

import flexpipe

MLP_OPS = (torch.ops.aten.addmm, torch.ops.aten.mm)
"""The products a per-op policy saves (torchtitan's op-level SAC saves matrix products)."""
POLICIES: dict[str, dict[str, dict[str, object]]] = {
    "net": {"none": {}, "drop MLP": {"drop": MLP},
            "keep attention": {"drop": "blocks.*", "keep": "attn"},
            "every 2nd block": {"drop": "blocks.*", "every": 2},
            "save mm (per op)": {"drop": "blocks.*", "save_ops": MLP_OPS}},
    "gpt2": {"none": {}, "drop MLP": {"drop": "mlp"},
             "keep attention": {"drop": "lm.transformer.h.*", "keep": "attn"},
             "every 2nd block": {"drop": "lm.transformer.h.*", "every": 2},
             "save mm (per op)": {"drop": "lm.transformer.h.*", "save_ops": MLP_OPS}},
}
"""Per model, each policy's ``Recompute`` arguments (none: no recompute)."""


def _recompute(model: str, policy: str) -> flexpipe.Recompute | None:
    kw = POLICIES[model][policy]
    return flexpipe.Recompute(**kw) if kw else None  # type: ignore[arg-type]


def build(model: str, policy: str) -> flexpipe.UserModel:
    """``model`` under ``policy`` (``POLICIES``), cut into 2 stages."""
    rc = _recompute(model, policy)
    if model == "net":
        gen = torch.Generator().manual_seed(1)
        example = torch.randn(64, 3, generator=gen), torch.randn(64, 2, generator=gen)
        return flexpipe.UserModel(Net(h=64), _loss, example, split_points=("blocks.2",),
                                  recompute=rc)
    x, y = um.tokens(0, 4)
    return flexpipe.UserModel(um.gpt2(), um.lm_loss, ((x,), y),
                              split_points=("lm.transformer.h.2",), recompute=rc)


def factory(model: str, policy: str) -> str:
    """The factory name of ``model`` under ``policy``: ``sr_models:net__drop_MLP``."""
    return f"sr_models:{model}__{policy.replace(' ', '_')}"


def __getattr__(attr: str) -> Callable[[], flexpipe.UserModel]:
    """The factories ``factory`` names."""
    model, sep, policy = attr.partition("__")
    names = {p.replace(" ", "_"): p for p in POLICIES.get(model, {})}
    if sep and policy in names:
        return lambda: build(model, names[policy])
    raise AttributeError(f"module 'sr_models' has no attribute {attr!r}")
