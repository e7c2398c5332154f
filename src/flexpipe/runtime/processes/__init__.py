"""Processes: a training run around the executor. ``launch`` starts one process per rank (or joins
a torchrun launch) and ``supervise`` watches them, naming a rank that dies, fails or stalls;
``train`` is one rank's training loop (and the single-device reference run); ``progress`` reports
each step to the launcher as it finishes, ``checkpoint`` saves and resumes by stage, ``limits``
refuses a run whose simulated memory does not fit before any process starts, and ``faults``
injects kills and stalls for the reliability tests."""
