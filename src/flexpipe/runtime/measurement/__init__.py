"""Measurement: what a model and a run cost, counted or timed, and how two runs compare.
``profile`` times every stage's F, B, W, BW and SR and the links between ranks into a cost model;
``measure`` turns the op times the ranks recorded into the simulator's ``Trace``; ``balance``
counts each layer's FLOPs (or parameters) for a balanced partition (``--partition auto``; the
balancing itself is ``flexpipe.cost.partition``); ``limits`` refuses a run whose simulated memory
does not fit, before any process starts; ``compare`` joins per-rank tensors and gives the
largest relative difference from a reference."""
