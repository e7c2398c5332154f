"""Models: ``spec`` holds ``ModelSpec``, the one description of a model to train (a built-in
name with its size, or your own ``UserModel`` or factory), and turns a ``user`` spec into its
segments; ``zoo`` builds the built-in chain models (``gpt``, ``mlp``) and every model's data
(``make_batch``); ``gpt`` is the small GPT as a list of layers; ``graph`` gives any model as
segments and holds the two-tower ``clip`` with its contrastive loss; ``data`` is the synthetic
text they train on."""
