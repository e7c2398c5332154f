"""The runtime: the only layer that imports torch. It runs any valid schedule for real over
torch.distributed, in sub-packages that stand on floors: each imports only those below it
(docs/architecture.md, checked by tests/test_layers.py), from the bottom:

1. ``transport``: ``comm`` (the one module that imports ``torch.distributed``) and ``p2p``, the
   pipeline's point-to-point messages.
2. ``split``: the B/W split, one rule for every product of an activation and a weight.
3. ``execution``: one rank's share of a schedule: the executor (given its handler table), the
   standard ``handlers``, stages and segments, selective recompute, FSDP, schedule-independent
   RNG, activation memory, and ``worker``: one pipeline rank set up once (device, links,
   data-parallel group, shards, executor, gradient average).
4. ``user``: your own model (``UserModel``, factories, the cut into stages, ``tracing``).
5. ``models``: ``ModelSpec``, the one description of a model to train (built-in or yours), the
   built-in models (``zoo``, ``gpt``, ``graph``) and their synthetic ``data``.
6. ``processes``: launching and supervising the rank processes, the training loop (``train``),
   progress, checkpoints, fault injection.
7. ``measurement``: profiling into a cost model (``profile``), measured traces (``measure``), the
   FLOP-balanced partition (``balance``), the memory check before a run (``limits``), comparing
   runs (``compare``).
8. ``pipeline`` (the public per-rank ``Pipeline``) and ``interop`` (torch.distributed.pipelining's
   schedules and runtime).

See docs/runtime.md."""
