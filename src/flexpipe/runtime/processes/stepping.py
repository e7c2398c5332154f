"""What a training step of ``flexpipe run`` adds around the executor: its micro-batches (the
synthetic data of the built-in models, or ``--data`` read only on the ranks holding a first or
a last stage: the others get placeholders, as they read neither inputs nor targets), the
learning rate of the step (``lrschedule``), AdamW's settings, gradient clipping by the whole
model's norm (``clipping.clip_worker``, as ``Pipeline.clip_grad_norm_``) and the validation
loss on the held-out windows (a forward-only executor, modules in eval mode)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flexpipe.runtime.data.corpus import Corpus, open_corpus
from flexpipe.runtime.execution.clipping import clip_worker
from flexpipe.runtime.execution.executor import Executor
from flexpipe.runtime.execution.handlers import HANDLERS
from flexpipe.runtime.execution.stage import Batch
from flexpipe.runtime.models.kinds import batch_at
from flexpipe.runtime.transport import comm
from flexpipe.schedules.dualpipe_twoway import data_microbatches


def reads_data(job: Any, worker: Any) -> bool:
    """Whether this rank reads inputs or targets: it holds a first or a last stage."""
    graph = job.schedule.graph
    ends = set(graph.sources()) | set(graph.sinks())
    return any(s in ends for s in worker.stages)


def corpus(job: Any, worker: Any) -> Corpus | None:
    """The ``--data`` corpus on a rank that reads it (None: synthetic data, or a middle
    rank)."""
    data = job.train.data
    if data is None or not reads_data(job, worker):
        return None
    return open_corpus(data, job.model.seq, job.model.seed)


def global_batch(job: Any) -> int:
    """The sequences (samples) one step reads over every replica: dp x ep x m x micro-batch
    (2m for DualPipe: m each way)."""
    return job.train.replicas * data_microbatches(job.schedule) * job.model.micro_batch


@dataclass(frozen=True)
class Position:
    """Where a run's data stood at its first step: that ``step`` and the global ``samples``
    read before it (a checkpoint's data position; 0, 0 from scratch)."""

    step: int = 0
    samples: int = 0

    def at(self, step: int, job: Any) -> int:
        """The global samples read before ``step``, every step reading ``global_batch``."""
        return self.samples + (step - self.step) * global_batch(job)


def step_batch(job: Any, worker: Any, first: int) -> Batch:
    """This rank's micro-batches of the step that reads on from global sample ``first``: its
    replica's share, ``m`` micro-batches (2m for DualPipe) of ``b`` sequences from
    ``first + replica x m x b``
    (the synthetic data by global micro-batch, ``--data`` by sequence)."""
    m, b = data_microbatches(job.schedule), job.model.micro_batch
    mine = first + worker.replica * m * b
    if job.train.data is None:
        return batch_at(job.model, mine // b, m)
    data = corpus(job, worker)
    if data is None:
        return placeholders(m)
    return data.batch_at(mine, m, b)


def placeholders(microbatches: int) -> Batch:
    """The batch of a rank that reads no data: no inputs, an empty target per micro-batch."""
    return [((), torch.empty(0, dtype=torch.int64))] * microbatches


def set_lr(opt: torch.optim.Optimizer, cfg: Any, step: int) -> float:
    """Set the learning rate of ``step`` on every parameter group; the rate."""
    lr = cfg.lr * (cfg.lr_schedule.factor(step) if cfg.lr_schedule is not None else 1.0)
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


def clip(worker: Any, cfg: Any) -> float | None:
    """Clip the gradients to ``cfg.max_norm`` (None: off); the total norm before clipping."""
    if cfg.max_norm is None:
        return None
    return float(clip_worker(worker, cfg.max_norm))


class Validator:
    """The validation loss of a rank's job: the held-out micro-batches of its replica through a
    forward-only executor of the schedule; the mean loss over them and the replicas, on the
    ranks holding a last stage (None elsewhere; DualPipe's two directions' parts summed over
    the pair of ranks holding their last stages)."""

    def __init__(self, job: Any, worker: Any) -> None:
        from flexpipe.runtime.execution.evaluate import EvalForward

        schedule = job.schedule
        self.job, self.worker, self.collect = job, worker, EvalForward()
        forward = schedule.with_ranks([[o for o in ops if o.kind == "F"]
                                       for ops in schedule.ranks])
        self.executor: Executor = worker.executor_for(forward, {**HANDLERS, "F": self.collect})
        self.sinks = [s for s in schedule.graph.sinks() if s in worker.stages]

    def due(self, step: int) -> bool:
        """Whether a validation loss is taken after ``step`` (every ``val_every`` and the
        last)."""
        every, steps = self.job.train.val_every, self.job.train.steps
        return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)

    def loss(self) -> float | None:
        """The mean held-out loss (every rank calls this together)."""
        m = data_microbatches(self.job.schedule)
        data = corpus(self.job, self.worker)
        batch = data.validation(m, self.job.model.micro_batch, self.worker.replica,
                                self.worker.dp) if data is not None else placeholders(m)
        for stage in self.worker.stages.values():
            stage.eval()
        self.collect.outputs.clear()
        try:
            self.executor.step(batch, False)
        finally:
            for stage in self.worker.stages.values():
                stage.train()
        total = torch.zeros(1, dtype=torch.float64, device=self.worker.device)
        for j in sorted(self.collect.outputs):  # DualPipe: each sink rank's direction
            out, target = self.collect.outputs[j], batch[j][1]
            total += float(self.worker.loss_fn(*out, target.to(self.worker.device))) / m
        if self.worker.twins is not None:  # the two directions' parts
            self.worker.twins.add([total])
        comm.all_reduce_mean([total], self.worker.group, self.worker.dp)
        return float(total) if self.sinks else None
