"""The public per-rank pipeline: ``api`` builds this rank's ``Pipeline`` of your model
(``step``/``eval`` inside your own training loop, over a ``RankWorker``) and holds ``spawn``.
``flexpipe.Pipeline`` and ``flexpipe.spawn`` are loaded from here on first use."""
