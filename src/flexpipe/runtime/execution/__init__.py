"""Execution: what runs one rank's share of a schedule. The ``executor`` runs the rank's ops in
order, dispatching each by kind through the handler table it is given (the standard one is
``handlers.HANDLERS``); ``stage`` and ``segments`` cut a model (a chain of layers, or a graph of
layer sequences) into stage modules (their B/W split is ``flexpipe.runtime.split``);
``selective`` drops and recomputes attention cores (SR), ``fsdp`` shards a stage's parameters
(AG/RS), ``rng`` makes random numbers independent of the schedule and
``activations`` counts the activation memory a rank holds. ``worker`` sets one pipeline rank up
(device, links, data-parallel group, shards, executor) for the CLI's training loop and the
public ``Pipeline`` alike."""
