"""From a config to a running job: the checked plan of a run and what launches and guards it.

- `validate`: every check of a config that needs no allocation; one error line per problem.
- `plan`: `RunPlan`, the run's decisions (mesh, precision, AC, compile, ...) derived once from the
  config; the trainer and the estimator both read it.
- `preflight`: the checks that read the disk (checkpoint to load, data) before the model is built.
- `run_dir`: the run folder (config.toml, the lock, metrics), made safely by rank 0.
- `launch`: the multi-process launcher behind `run_train.sh` (torchrun with titanrush's exit statuses,
  restarting a failed job: `job.max_restarts`).
- `signals`, `nonfinite`: stopping cleanly on a signal, and on a loss or gradient that is not finite.
- `watchdog`: a step that does not finish in time (`training.step_timeout`) ends the job, with stacks.

May import: `interop`, `checkpoint`, `models`, `data`, `parallel` and the base modules. Never imports the
trainer or the tools.
"""
