"""The job config: what a run is told to do, from defaults < TOML file < command line.

- `schema`: one dataclass per TOML section with a docstring on every field, `JobConfig`, `ConfigError`,
  `sections()`. The place to read to find a key.
- `loader`: `load(config_path, overrides)`, `read_toml` (following `extends`), `toml_line` (where a key
  is set, for error messages).
- `keys`: a section and key looked up (with a suggestion when unknown), a value converted to its type.
- `overrides`: the command line: `--config FILE` and `--check` split off, `--section.key value`
  parsed, and the keys it sets more than once.
- `help`: `help_text()` for `--help`, from the schema's field docstrings (docs/config.md too).
- `write`: `to_toml`, the resolved config as the run folder's config.toml.

The base layer: may import the standard library (and tomli where tomllib is missing), nothing of
titanrush outside this package. A name with a leading underscore (`_lookup`, `_coerce`, ...) is shared
between this package's modules only. Values and their combinations are checked later, by
`titanrush.run.validate`.
"""

from titanrush.config.help import help_text
from titanrush.config.loader import load, load_command, read_toml, toml_line
from titanrush.config.overrides import ASSUME_CUDA, parse_overrides, repeated_overrides, split_args
from titanrush.config.schema import (
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    ConfigError,
    Data,
    Experimental,
    Float8,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    MoE,
    Optimizer,
    Parallelism,
    Plan,
    Profiling,
    Training,
    Validation,
    sections,
)
from titanrush.config.write import to_toml

__all__ = [
    "ASSUME_CUDA",
    "ActivationCheckpoint",
    "Checkpoint",
    "Compile",
    "ConfigError",
    "Data",
    "Experimental",
    "Float8",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "MoE",
    "Optimizer",
    "Parallelism",
    "Plan",
    "Profiling",
    "Training",
    "Validation",
    "help_text",
    "load",
    "load_command",
    "parse_overrides",
    "read_toml",
    "repeated_overrides",
    "sections",
    "split_args",
    "to_toml",
    "toml_line",
]
