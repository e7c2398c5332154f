"""``flexpipe plan``: cut a model into stages, map them onto a cluster's devices and choose the
schedule and micro-batch size; print the plan, its predicted time and memory, and the baselines."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flexpipe.cli import guards
from flexpipe.cli.common import add_guard_arg, positive_int, positive_number
from flexpipe.cli.config import add_config_arg
from flexpipe.cli.written import announce
from flexpipe.cost.io import save_cost
from flexpipe.errors import ConfigError
from flexpipe.plan import (
    Cluster,
    Model,
    Options,
    Plan,
    cluster_preset,
    load_cluster,
    load_model,
    megatron,
    model_preset,
    pipedream,
    report3d,
)
from flexpipe.plan.choose3d import megatron_3d, plan_3d
from flexpipe.plan.planner import DEFAULT_FAMILIES
from flexpipe.plan.presets import CLUSTERS, MODELS
from flexpipe.plan.report import as_dict, as_text
from flexpipe.schedules.registry import names


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    parser = sub.add_parser("plan", help="plan stages, device mapping, schedule and micro-batch",
                            description="Partition a model's layers into stages, map them onto "
                            "devices over the cluster's links, choose the schedule and the "
                            "micro-batch size; every candidate is judged by the simulator.")
    parser.add_argument("--model", required=True, metavar="FILE",
                        help=f"model file (.json/.toml) or a preset: {', '.join(MODELS)}")
    parser.add_argument("--cluster", required=True, metavar="FILE",
                        help=f"cluster file (.json/.toml) or TOPOLOGY:N with TOPOLOGY one of "
                        f"{', '.join(CLUSTERS)}")
    parser.add_argument("--schedules", metavar="LIST", default=",".join(DEFAULT_FAMILIES),
                        help=f"comma-separated schedules to choose from (of {', '.join(names())})")
    parser.add_argument("--search-candidates", type=positive_int, default=24, metavar="N",
                        help="effort of the automated scheduler on the winning plan: candidates "
                        "tried (default 24; the same plan on an idle or a loaded machine)")
    parser.add_argument("--search-seconds", type=positive_number, metavar="S",
                        help="optional wall-clock limit on the automated scheduler (the plan "
                        "then depends on the machine's load)")
    parser.add_argument("--no-search", action="store_true",
                        help="library schedules only (skip the automated scheduler)")
    parser.add_argument("--tp", type=positive_int, metavar="N",
                        help="fix the tensor-parallel degree (inside a node, dividing the heads; "
                        "default: choose)")
    parser.add_argument("--dp", type=positive_int, metavar="N",
                        help="fix the data-parallel degree (default: choose; pipeline stages x "
                        "dp x tp = the devices; '--tp 1 --dp 1' plans one pipeline)")
    parser.add_argument("--no-baselines", action="store_true", help="do not plan the baselines")
    add_config_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the plan's schedule as text (loadable by every command)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite the output files if they exist")
    add_guard_arg(parser)
    parser.add_argument("--cost-out", metavar="FILE",
                        help="write the plan's cost model (stages and links, ranks in path "
                        "order) as JSON: 'flexpipe simulate FILE.txt --cost FILE.json' "
                        "reproduces the predicted time")


def _model(spec: str) -> Model:
    if spec in MODELS and not Path(spec).exists():
        return model_preset(spec)
    return load_model(spec)


def _cluster(spec: str, forced: bool) -> Cluster:
    name, sep, count = spec.partition(":")
    if sep and name in CLUSTERS and not Path(spec).exists():
        if not (count.isascii() and count.isdigit()) or len(count) > 9:
            raise ConfigError(f"--cluster {spec!r}: give TOPOLOGY:N with N a device count")
        _guard_paths(int(count), forced)  # before the preset builds its n x n link tables
        return cluster_preset(name, int(count))
    if sep and not Path(spec).exists():
        raise ConfigError(f"--cluster {spec!r}: no such file, and {name!r} is not a topology "
                          f"(known: {', '.join(CLUSTERS)})")
    return load_cluster(spec)


def _write(result: Plan, args: argparse.Namespace) -> None:
    """The schedule and cost files asked for."""
    if args.output:
        guards.write_text(args.output, result.best.schedule.to_text() + "\n")
        announce(args.output, "the plan's schedule, as text", args.json)
    if args.cost_out:
        save_cost(result.best.cost, args.cost_out)
        announce(args.cost_out, "the plan's cost model, JSON", args.json)


def run(args: argparse.Namespace) -> int:
    """Plan and print."""
    for path in (args.output, args.cost_out):
        guards.check_output(path, args.force)
    model, cluster = _model(args.model), _cluster(args.cluster, args.no_size_guard)
    _guard(model, cluster, args.no_size_guard)
    families = tuple(f.strip() for f in args.schedules.split(",") if f.strip())
    effort = 0 if args.no_search else args.search_candidates
    with _progress(f"planning {len(model.layers)} layers onto {cluster.size} devices"):
        chosen = plan_3d(model, cluster, Options(families=families, refine_candidates=effort,
                                                 refine_seconds=args.search_seconds),
                         args.tp, args.dp)
        baselines = {} if args.no_baselines else {"megatron": megatron(model, cluster),
                                                   "pipedream": pipedream(model, cluster)}
        default = None if args.no_baselines else megatron_3d(model, cluster)
    result, step = chosen.plan, chosen.best.step_ms
    _write(result, args)
    if args.json:
        print(guards.dumps({**as_dict(result, baselines, step),
                            **report3d.as_dict(chosen, default)}))
    else:
        text = as_text(result, baselines, step) + "\n\n" + report3d.as_text(chosen, default)
        print("\n".join(guards.safe(line) for line in text.split("\n")))
    return 0


def _guard(model: Model, cluster: Cluster, forced: bool) -> None:
    """Refuse a plan whose candidate simulations would not fit in memory: 3 passes x 2
    chunks x stages (at most the devices or layers) x the most micro-batches."""
    most_m = max((m for _, m in model.choices()), default=1)
    stages = min(cluster.size, len(model.layers))
    guards.check_ops(6 * stages * most_m, f"planning {len(model.layers)} layers onto "
                     f"{cluster.size} devices ({most_m} micro-batches)", forced,
                     "use a smaller global batch, fewer layers or devices")
    _guard_paths(cluster.size, forced)


def _guard_paths(n: int, forced: bool) -> None:
    """Refuse choosing device paths over ``n`` devices when it would take minutes: a greedy
    walk from every device, then 2-opt sweeps (about 7 n^3 link prices)."""
    guards.check_seconds(7.0 * n**3, guards.PATH_STEPS_PER_S, f"choosing device paths over "
                         f"{n} devices", forced, "plan for fewer devices (a node or a group "
                         "of nodes) and replicate the plan")


@contextmanager
def _progress(what: str) -> Iterator[None]:
    """A spinner with the elapsed time on stderr while the planner works (a terminal), or
    one line saying what it does (otherwise)."""
    if not sys.stderr.isatty():
        print(f"flexpipe plan: {what} ...", file=sys.stderr, flush=True)
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn(what), TimeElapsedColumn(),
                   console=Console(file=sys.stderr), transient=True)
    with bar:
        bar.add_task(what, total=None)
        yield
