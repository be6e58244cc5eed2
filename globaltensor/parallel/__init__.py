"""Parallelism as placements: the module plan (`module`), and the runtimes a plan installs.

`module` converts a model by its plan; `stage` runs a module whose parameters live on one placement
(a pipeline stage); `zero` gathers a module's parameters for its call and reduce-scatters their
gradients (ZeRO/FSDP); `plain` runs a gathering module's later calls on local tensors; `pipeline`
schedules micro-batches over stages, with `early_exit` (ranks leaving a forward past their last
stage) and `replay` (a rank's part of a step run again without the global program); `optim_skip`
lets optimizer steps skip parameters a rank holds nothing of. Beneath them: `trees` walks a module's inputs
and outputs (torch's pytree), `local_call` runs a module on its local tensors (plain regions, one-rank
stages, replays).
"""
