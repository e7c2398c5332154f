"""The automated scheduler: find the fastest schedule for a cost model, p ranks, m micro-batches
and a per-rank memory limit, over the library families and list-scheduler synthesis, with
analytic pruning and an exact CP-SAT step (``flexpipe.search.exact``)."""

from flexpipe.search.costs import fit_cost, span_bound
from flexpipe.search.engine import search
from flexpipe.search.frontier import frontier
from flexpipe.search.graphs import search_graph
from flexpipe.search.result import STATUSES, SearchResult, Trial

__all__ = ["STATUSES", "SearchResult", "Trial", "fit_cost", "frontier", "search",
           "search_graph", "span_bound"]
