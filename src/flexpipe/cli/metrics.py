"""``flexpipe run``'s metrics of each logged step (every ``--log-every`` and the last, and every
step with a validation loss): loss, learning rate, step time, tokens/s, achieved TFLOP/s and
MFU (``flexpipe.runtime.measurement.mfu``), peak memory and the validation loss. They extend
the live line on the terminal and, with ``--run-dir``, go to ``RUN_DIR/metrics.jsonl`` (one JSON
object a line, appended: a resumed run continues the file; its first line describes the run)
and to TensorBoard events in ``RUN_DIR/tb`` when ``tensorboard`` is installed (``--tensorboard
on`` requires it, ``off`` skips it)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from flexpipe.errors import ConfigError
from flexpipe.schedules.dualpipe_twoway import data_microbatches

if TYPE_CHECKING:  # the CLI imports torch only when it runs a job
    from flexpipe.runtime.processes.train import Job

METRICS_FILE = "metrics.jsonl"
TB_FOLDER = "tb"


def tensorboard_writer(folder: Path, mode: str) -> Any:
    """A ``SummaryWriter`` in ``folder`` (``flexpipe.runtime.measurement.tensorboard``)."""
    from flexpipe.runtime.measurement.tensorboard import tensorboard_writer as writer

    return writer(folder, mode)


@dataclass
class Metrics:
    """The per-step figures of one run and where they are written."""

    job: Job
    args: argparse.Namespace
    tokens: int
    """Tokens (or samples) of one step."""
    flops: float | None = None
    """Counted FLOPs of one step (None: not counted)."""
    peak: float | None = None
    """Peak FLOP/s of all the run's devices together (None: unknown)."""
    header: dict[str, Any] = field(default_factory=dict)
    """The run's description, the first line of metrics.jsonl."""
    records: list[dict[str, Any]] = field(default_factory=list)
    _file: TextIO | None = None
    _tb: Any = None
    _opened: bool = False

    def open(self) -> None:
        """Open the run folder's files (with ``--run-dir``) and write the run's header line:
        on the first step, so that under torchrun only the rank printing the steps writes."""
        self._opened = True
        if self.args.run_dir is None:
            return
        folder = Path(self.args.run_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._file = (folder / METRICS_FILE).open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--run-dir {str(folder)!r}: cannot write ({exc.strerror})") \
                from None
        self._tb = tensorboard_writer(folder / TB_FOLDER, self.args.tensorboard)
        self._write({"event": "run", "description": self.args.description} | self.header)

    def close(self) -> None:
        """Flush and close the files."""
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()

    def lr(self, step: int) -> float:
        """The learning rate of 0-based ``step``."""
        schedule = self.job.train.lr_schedule
        return self.job.train.lr * (schedule.factor(step) if schedule is not None else 1.0)

    def record(self, step: Any) -> dict[str, Any]:
        """The figures of one ``progress.Step``."""
        seconds = step.seconds
        out: dict[str, Any] = {"step": step.step + 1, "loss": step.loss, "lr": self.lr(step.step),
                               "step_ms": 1e3 * seconds}
        if seconds > 0:  # the rates of a timed step (JSON has no NaN)
            out["tokens_per_s"] = self.tokens / seconds
            if self.flops is not None:
                out["tflops_per_s"] = self.flops / seconds / 1e12
            if self.flops is not None and self.peak:
                out["mfu"] = self.flops / seconds / self.peak
        out |= {"peak_memory_bytes": step.peak_bytes, "memory_kind": step.memory_kind}
        if step.val_loss is not None:
            out["val_loss"] = step.val_loss
        return out

    def summary(self) -> dict[str, Any]:
        """For the run's report: the median MFU over the logged steps and the last validation
        loss (what was measured)."""
        out: dict[str, Any] = {}
        mfus = sorted(r["mfu"] for r in self.records if "mfu" in r)
        if mfus:
            out["mfu_median"] = mfus[len(mfus) // 2]
        vals = [r["val_loss"] for r in self.records if "val_loss" in r]
        if vals:
            out["val_loss"] = vals[-1]
        return out

    def step(self, step: Any) -> str:
        """Record ``step`` when it is a logged one; the text the live line ends with."""
        if not self._opened:
            self.open()
        rec = self.record(step)
        logged = (step.step + 1) % self.args.log_every == 0 or \
            step.step + 1 == self.job.train.steps or step.val_loss is not None
        if logged:
            self.records.append(rec)
            self._write(rec)
        text = f"lr {rec['lr']:.3g}"
        if "mfu" in rec:
            text += f"  MFU {100 * rec['mfu']:.2f}%"
        if "val_loss" in rec:
            text += f"  val loss {rec['val_loss']:.4f}"
        return text

    def _write(self, rec: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        if self._tb is not None and "step" in rec:
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, rec["step"])
            self._tb.flush()


def metrics_for(job: Job, args: argparse.Namespace, tokens: int) -> Metrics:
    """The run's ``Metrics``: its step FLOPs counted and its devices' peak found."""
    from flexpipe.runtime.measurement.mfu import device_peak, step_flops
    from flexpipe.runtime.transport import comm

    flops = step_flops(job.model, data_microbatches(job.schedule), job.train.replicas)
    peak, source = device_peak(args.peak_flops, comm.pick_backend(args.backend), args.threads)
    header = {"schedule": job.schedule.name, "world": job.world, "steps": job.train.steps,
              "step_flops": flops, "device_peak_flops": peak, "peak_source": source}
    return Metrics(job, args, tokens, flops, None if peak is None else peak * job.world,
                   header)
