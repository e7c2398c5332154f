"""The models people train, exactly: every model of tests/runtime/matrix_models.py (Hugging Face
GPT-2 tied, Llama, Qwen2 tied, BERT with a mask, T5 sharing one embedding, ViT, Mixtral, and a
BatchNorm CNN with a long residual) under each schedule, through ``flexpipe.pipeline`` against
plain one-process PyTorch on the same micro-batches (float64, SGD, 3 steps): the worst relative
error of the loss, gradients, parameters, buffers and eval outputs over every rank, per case,
and the wall time of each launch (all cases of one rank count in one process group).

    .venv/bin/python benchmarks/model_matrix.py [--p 2 4] [--models gpt2-tied llama ...]
        [--schedules 1f1b zb-h1 zb-v interleaved-1f1b v-half]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "tests" / "runtime"
sys.path.insert(0, str(HERE))

import matrix_models as mm  # noqa: E402
import test_model_matrix as tm  # noqa: E402

import flexpipe  # noqa: E402


def main() -> None:
    """Run the matrix and print one row per case."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--models", nargs="+", default=list(mm.MODELS), choices=list(mm.MODELS))
    ap.add_argument("--schedules", nargs="+", default=list(tm.SCHEDULES))
    args = ap.parse_args()
    print(f"{'p':>2} {'model':<12}{'schedule':<18}" + "".join(f"{k:>10}" for k in
                                                            ("loss", "grad", "param",
                                                             "buffer", "eval")))
    for p in args.p:
        cases = [(m, s) for m in args.models for s in args.schedules]
        t0 = time.perf_counter()
        results = flexpipe.spawn(tm.rank_main, p, cases, p, timeout_s=300, deadline_s=7200)
        for i, (model, schedule) in enumerate(cases):
            worst = {k: max(r[i][k] for r in results) for k in results[0][i]}
            print(f"{p:>2} {model:<12}{schedule:<18}" +
                  "".join(f"{worst[k]:>10.1e}" for k in worst))
        print(f"p = {p}: {len(cases)} cases in {time.perf_counter() - t0:.0f} s, worst "
              f"{max(max(r[i].values()) for r in results for i in range(len(cases))):.1e}")


if __name__ == "__main__":
    main()
