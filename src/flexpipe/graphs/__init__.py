"""Models that are not a straight chain of layers: two towers meeting in a loss (CLIP), an encoder
feeding a decoder, a GPT whose embedding and head are sharded over every device. A preset builds
a ``GraphModel`` (stage graph, placement, cost model) per layout for p devices; the chain-only
baseline runs the same layers one after another with 1F1B."""

from flexpipe.graphs.model import GraphModel, balanced_cut, chain_baseline, merge_stages
from flexpipe.graphs.presets import PRESETS, preset, preset_cost, preset_layouts

__all__ = ["PRESETS", "GraphModel", "balanced_cut", "chain_baseline", "merge_stages", "preset",
           "preset_cost", "preset_layouts"]
