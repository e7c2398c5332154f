"""Transport: how the ranks talk. ``comm`` is the one module that imports ``torch.distributed``
(process groups, point-to-point primitives, collectives, barriers, waits that name a dead or
stuck peer); ``p2p`` is the pipeline's message transport on top of it (``P2P``: sends and
receives matched in the order the schedule agrees on, shapes sent once per stage boundary)."""
