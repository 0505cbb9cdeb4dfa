"""Checkpoints: DCP save and load of a run, and the safety around them.

- `manager`: the trainer's checkpointer (when to save, sync or async, what to load at start, pruning).
- `state`: what a checkpoint holds (model, optimizer, scheduler, data loader, step) as stateful objects.
- `folder`: the `step-<N>` folders on disk: what each holds and lacks, which are complete, moving one aside.
- `choose`: which checkpoint to load (the run's newest complete one or `checkpoint.load_path`), whether it
  can be (complete, undamaged, within training.steps), and where to resume from instead of a bad one.
- `space`: a save's room on disk: the folder writable, the next save fitting, its way cleared, and a full
  disk told from other write failures.
- `integrity`: the per-checkpoint record of file sizes and checksums, written on save and checked on load.
- `compat`: whether a checkpoint fits this run (model arguments, data position, shapes).

May import: the base modules (`config`, `errors`, `distributed`, `files`), `models` (for model arguments).
Never imports `run`, `interop`, the trainer or the tools.
"""
