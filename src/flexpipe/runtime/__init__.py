"""The runtime: the only layer that imports torch. It runs any valid schedule for real over
torch.distributed (``launch``, ``train``, ``executor`` with its one handler table in
``handlers``), splits backward into B and W (``split``), and profiles a model into a cost
model (``profile``); ``measure`` turns what the ranks recorded into a ``Trace``. See
docs/runtime.md."""
