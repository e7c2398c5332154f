"""The runtime: the only layer that imports torch. It runs any valid schedule for real over
torch.distributed, in sub-packages that each hold one part:

- ``execution``: the executor and its one handler table (``handlers``), stages and segments, the
  B/W split (``wgrad``), selective recompute, FSDP, schedule-independent RNG, activation memory.
- ``transport``: ``comm`` (the one module that imports ``torch.distributed``) and ``p2p``, the
  pipeline's point-to-point messages.
- ``processes``: launching and supervising the rank processes, the training loop (``train``),
  progress, checkpoints, memory limits, fault injection.
- ``measurement``: profiling into a cost model (``profile``), measured traces (``measure``), the
  FLOP-balanced partition (``balance``), comparing runs (``compare``).
- ``models``: the built-in models (``zoo``, ``gpt``, ``graph``) and their synthetic ``data``.
- ``user``: your own model (``model``, ``tracing``) and the public per-rank ``Pipeline``
  (``api``).
- ``interop``: torch.distributed.pipelining's schedules and runtime.

See docs/runtime.md."""
