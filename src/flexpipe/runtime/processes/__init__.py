"""Processes: a training run around the rank worker. ``launch`` starts one process per rank (or
joins a torchrun launch) and ``supervise`` watches them, naming a rank that dies, fails or
stalls; ``train`` is one rank's training loop (and the single-device reference run);
``progress`` reports each step to the launcher as it finishes, ``checkpoint`` saves and resumes
by stage, ``allocator`` keeps freed host memory for reuse, and ``faults`` injects kills and
stalls for the reliability tests."""
