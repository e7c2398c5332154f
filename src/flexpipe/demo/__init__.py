"""The end-to-end main job (``flexpipe demo``): profile the built-in GPT on local ranks, search
the best schedule under a memory limit, compare it with the library, train with it, and write
an HTML report. ``job`` runs the steps; ``report`` writes the page."""

from flexpipe.demo.job import DemoConfig, DemoResult, run_demo

__all__ = ["DemoConfig", "DemoResult", "run_demo"]
