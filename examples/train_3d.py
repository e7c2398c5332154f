"""3D training on 8 CPU processes: pipeline (pp 2) x data parallel (dp 2, torch's FSDP2) x tensor
parallel (tp 2, torch's DTensor), a tiny GPT, ZeroPP's blockwise schedule deciding when FSDP2
gathers and reduce-scatters each stage's parameters:

    torchrun --nproc-per-node 8 examples/train_3d.py
    python examples/train_3d.py            # starts the 8 processes itself

It prints the final loss and whether the parameters equal one process training the same model on
the same batches (float64). SCHEDULE=zb-v (or 1f1b, zb-h1, ...) picks another schedule; a
schedule without AG/RS averages the replicas' gradients with one all-reduce instead.
On GPUs across machines, see docs/runtime.md ("3D: pipeline x FSDP2 x tensor parallel").
"""
import os

import torch
import torch.distributed as dist

import flexpipe
from flexpipe.runtime.models.gpt import TP_PLAN, GPTConfig, gpt_layers, lm_loss

CFG = GPTConfig(vocab=64, hidden=32, heads=4, layers=4, seq=16)
STEPS, BATCH, M = 5, 8, 4


def model() -> list[torch.nn.Module]:
    torch.manual_seed(0)  # every rank (and the reference) builds the same initial weights
    return [layer.double() for layer in gpt_layers(CFG)]


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab, (BATCH, CFG.seq), generator=gen) for _ in range(STEPS)]


def one_process() -> dict[str, torch.Tensor]:
    """The same training on one process: the whole model, the whole batch."""
    layers = torch.nn.Sequential(*model())
    opt = torch.optim.SGD(layers.parameters(), lr=0.1, momentum=0.9)
    for ids in batches():
        opt.zero_grad()
        for part in ids.chunk(2 * M):  # the micro-batches of both replicas
            (lm_loss(layers(part), part.roll(-1, 1)) / (2 * M)).backward()
        opt.step()
    return dict(layers.named_parameters())


def main() -> None:
    schedule = os.environ.get("SCHEDULE", "zeropp")
    pipe = flexpipe.pipeline(model(), schedule, m=M, dp=2, tp=2, tp_plan=TP_PLAN,
                             loss_fn=lm_loss, **({"v": 2} if schedule == "zeropp" else {}))
    opt = torch.optim.SGD(pipe.param_groups(), lr=0.1, momentum=0.9)
    loss = None
    for ids in batches():
        mine = ids.chunk(2)[pipe.replica]  # this replica's half of the global batch
        opt.zero_grad()
        loss = pipe.step(mine if pipe.needs_inputs else None,
                         mine.roll(-1, 1) if pipe.needs_targets else None)
        opt.step()
    ref = one_process()
    worst = torch.zeros(1, dtype=torch.float64)
    for name, p in pipe.full_named_parameters().items():
        want = ref[name]
        worst = torch.maximum(worst, ((p - want).abs().max() / want.abs().max()).reshape(1))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if loss is not None and pipe.replica == 0 and pipe.tp_rank == 0:
        verdict = "equal to" if worst.item() <= 1e-9 else "DIFFERENT from"
        print(f"pp 2 x dp 2 x tp 2, {pipe.schedule.name}: final loss {loss.item():.6f}; "
              f"parameters {verdict} one process (worst relative error {worst.item():.1e})",
              flush=True)
    pipe.close()


if __name__ == "__main__":
    main() if "RANK" in os.environ else flexpipe.spawn(main, 8)
