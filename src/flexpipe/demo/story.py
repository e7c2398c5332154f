"""The demo's story in its first lines: what was asked (the fastest schedule under a share of
1F1B's activation memory), what was found (the winner's readable name, its memory against the
limit, its speed against the fastest library schedule that fits and against 1F1B, predicted
and measured), and at most three lines of why."""

from __future__ import annotations

from collections.abc import Callable

from flexpipe.demo.job import Compared, DemoResult
from flexpipe.demo.verdict import TOLERANCE, makespan_error, speedup
from flexpipe.viz.units import fmt_memory, fmt_ms

PLACEMENTS = {"linear": "1 stage/rank", "vshape": "V-shape, 2 stages/rank",
              "interleaved": "interleaved stages"}
"""The list scheduler's placements, as a reader names them."""

BUILDERS = {"adaptive-v": "adaptive V for the limit", "v-pattern": "V pattern for the limit",
            "zb-greedy": "zero-bubble heuristic for the limit",
            "v-blocks": "adaptive V over building blocks"}
"""The search's constructions (``flexpipe.search.space.BUILDER_PLACEMENTS``) in words."""

KNOBS: dict[str, Callable[[str], str]] = {
    "ahead": lambda v: "" if v == "none" else f"warm-up <= {v.replace('p', '(p-r)')}",
    "reserve": lambda v: "" if v == "auto" else "memory kept for later stages",
    "prefer": lambda v: "forwards first" if v.startswith("F") else "",
    "split": lambda v: "fused backward" if v == "False" else "",
    "builder": lambda v: BUILDERS.get(v, f"{v} construction")}
"""The search's knobs (``flexpipe.search.space``) in words; an empty word: the default."""

FAMILIES = {"1f1b": "1F1B", "zb-h1": "ZB-H1", "zb-h2": "ZB-H2", "zb-v": "ZB-V",
            "v-min": "V-Min", "v-half": "V-Half", "v-zb": "V-ZB", "gpipe": "GPipe",
            "1f1b-recompute": "1F1B with recompute"}
"""Library families as the papers write them."""


RECOMPUTE = {"SR": "selective recompute", "R": "full recompute"}
"""The search's recompute tags (``flexpipe.search.recompute``: ``+SR[0-1] R[3]``) in words."""


def readable(name: str) -> str:
    """A schedule's name for a reader: ``search:policy[linear] ahead=none reserve=auto`` ->
    ``list scheduler, 1 stage/rank``; ``zb-h1`` -> ``ZB-H1``; ``1f1b +R[0]`` -> ``1F1B,
    full recompute on stage 0``; other names as they are."""
    label = name.removeprefix("search winner:").removeprefix("search:").strip()
    label, _, tags = label.partition(" +")
    return ", ".join([_named(label), *(_recompute(tag) for tag in tags.split())])


def _recompute(tag: str) -> str:
    """``SR[0-1]`` -> ``selective recompute on stages 0-1``; an unknown tag as it is."""
    kind, _, stages = tag.partition("[")
    stages = stages.rstrip("]")
    if kind not in RECOMPUTE or not stages:
        return tag
    many = "," in stages or "-" in stages
    return f"{RECOMPUTE[kind]} on stage{'s' if many else ''} {stages.replace(',', ', ')}"


def _named(label: str) -> str:
    """The schedule's name without its recompute tags, for a reader (``readable``)."""
    head, _, rest = label.partition(" ")
    if not head.startswith("policy"):
        return " ".join([FAMILIES.get(head, head), rest]).strip()
    placement = head.removeprefix("policy").strip("[]@") or "linear"
    words = [PLACEMENTS.get(placement, f"{placement} placement")]
    for item in rest.split():
        key, _, value = item.partition("=")
        word = KNOBS[key](value) if key in KNOBS else item
        words += [word] if word else []
    return "list scheduler, " + ", ".join(words)


def _fastest_fitting(result: DemoResult) -> Compared | None:
    """The library schedule (not the winner) that fits the limit with the shortest predicted
    step, or None when none fits."""
    fitting = [c for c in result.compared[:-1] if c.fits]
    return min(fitting, key=lambda c: c.trace.metrics().makespan, default=None)


def _peak(c: Compared) -> float:
    return max(c.trace.metrics().peak_activation, default=0.0)


def story(result: DemoResult) -> list[tuple[str, str]]:
    """Asked, found, memory, speed, why (module docstring), as (label, text) rows."""
    cfg, winner = result.cfg, result.compared[-1]
    base = next(c for c in result.compared if c.name == "1f1b")
    asked = (f"the fastest schedule for the built-in GPT ({cfg.ranks} ranks, "
             f"{cfg.microbatches} micro-batches) whose activation peak per rank stays under "
             f"{cfg.mem_fraction:.0%} of 1F1B's: {fmt_memory(result.limit)}")
    memory = (f"{fmt_memory(_peak(winner))} on the worst rank, "
              f"{_peak(winner) / result.limit:.0%} of the limit (1F1B: "
              f"{fmt_memory(_peak(base))}, {'within' if base.fits else 'over'} it)")
    rows = [("Asked", asked), ("Found", readable(winner.name)), ("Memory", memory),
            ("Speed", _speed(result, winner, base)), ("Why", _why(result, winner, base))]
    return rows


def _speed(result: DemoResult, winner: Compared, base: Compared) -> str:
    """Against the fastest library schedule that fits (predicted) and 1F1B (predicted and,
    when both ran, measured)."""
    span = winner.trace.metrics().makespan
    other = _fastest_fitting(result)
    parts = [] if other is not None and other.name == base.name else [
        "none of the library schedules compared fits" if other is None else
        f"{other.trace.metrics().makespan / span:.2f}x {readable(other.name)}, the fastest "
        "library schedule that fits (predicted)"]
    got = speedup(result)
    vs_base = (f"{base.trace.metrics().makespan / span:.2f}x 1F1B predicted" if got is None
               else f"{got.predicted:.2f}x 1F1B predicted, {got.measured:.2f}x measured")
    return "; ".join(parts + [vs_base]) + " (above 1x: faster)"


def _why(result: DemoResult, winner: Compared, base: Compared) -> str:
    """At most three lines: why the winner is where it is against 1F1B, and whether the
    prediction held."""
    faster = base.trace.metrics().makespan / winner.trace.metrics().makespan
    if base.fits:
        head = "1F1B fits the limit; the search found a faster schedule within it."
    elif faster < 1.0:
        head = ("1F1B needs more memory than the limit, and so does every schedule faster "
                "than it: the fastest one that fits holds fewer micro-batches in flight.")
    else:
        head = "1F1B needs more memory than the limit; the winner is faster and fits."
    step = makespan_error(result)
    if step is None:
        return head
    pred, meas = step
    held = (f"held (within {TOLERANCE:.0%})" if abs(meas / pred - 1.0) <= TOLERANCE
            else f"is off by more than {TOLERANCE:.0%} (the report says why)")
    return (f"{head} Its last step took {fmt_ms(meas)} against {fmt_ms(pred)} predicted "
            f"({meas / pred - 1:+.0%}): the prediction {held}.")
