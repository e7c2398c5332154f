"""Your own model and the public per-rank pipeline API. ``model`` holds ``UserModel``, factories
named ``package.module:function`` and the cut of a model into stages; ``tracing`` splits any
``nn.Module`` at named split points (``torch.fx``); ``api`` builds this rank's ``Pipeline``
(``step``/``eval`` inside your own training loop) and holds ``spawn``. ``flexpipe.Pipeline``,
``flexpipe.spawn`` and ``flexpipe.UserModel`` are loaded from here on first use."""
