"""Your own model: ``model`` holds ``UserModel``, factories named ``package.module:function`` and
the cut of a model into stages; ``tracing`` splits any ``nn.Module`` at named split points
(``torch.fx``, or ``torch.export`` where fx cannot trace). It sits below the built-in models:
``flexpipe.runtime.models.spec.ModelSpec`` names either. ``flexpipe.UserModel`` is loaded from
here on first use."""
