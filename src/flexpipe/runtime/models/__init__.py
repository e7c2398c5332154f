"""Models: the built-in runnable models and their data. ``zoo`` names them (``gpt``, ``mlp``,
``clip``: ``ModelSpec``, ``build_model``, ``make_batch``); ``gpt`` is the small GPT as a list of
layers; ``graph`` gives any model (built-in or yours) as segments and holds the two-tower
``clip`` with its contrastive loss; ``data`` is the synthetic text they train on."""
