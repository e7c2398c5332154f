"""Training data from disk for ``flexpipe run --data``: token streams read from a UTF-8 text
file or folder (a ``tokenizers`` tokenizer file, or bytes), a pre-tokenised ``.bin``/``.npy``
array (memory-mapped) or a ``datasets.load_from_disk`` folder (``tokens``), cut into
fixed-length windows, shuffled by seed, split into train and held-out windows and sharded over
the data-parallel replicas (``corpus``)."""
