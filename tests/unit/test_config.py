"""Config loading: precedence, extends, override syntax and every error path."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titanrush import config
from titanrush.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_are_the_debug_job():
    cfg = config.load()
    assert cfg.model.flavor == "debug"
    assert cfg.data.dataset == "embedded"
    assert cfg.training.steps > 0


def test_precedence_defaults_toml_cli(tmp_path):
    f = write(tmp_path / "a.toml", "[training]\nsteps = 7\nseq_len = 128\n")
    cfg = config.load(str(f), ["--training.seq_len", "64"])
    assert cfg.training.steps == 7  # TOML over default
    assert cfg.training.seq_len == 64  # command line over TOML
    assert cfg.training.local_batch_size == config.Training().local_batch_size  # default kept


def test_override_forms(tmp_path):
    cfg = config.load(
        None,
        [
            "--compile.enable",
            "--no-metrics.tensorboard",
            "--training.max_norm=0.5",
            "--checkpoint.enable=true",
            "--float8.filter_fqns",
            "output,w2",
            "--parallelism.pp_layers_per_stage=2,2",
        ],
    )
    assert cfg.compile.enable is True
    assert cfg.metrics.tensorboard is False
    assert cfg.training.max_norm == 0.5
    assert cfg.checkpoint.enable is True
    assert cfg.float8.filter_fqns == ["output", "w2"]
    assert cfg.parallelism.pp_layers_per_stage == [2, 2]


def test_bool_flag_followed_by_another_flag():
    cfg = config.load(None, ["--compile.enable", "--training.steps", "3"])
    assert cfg.compile.enable is True and cfg.training.steps == 3


def test_extends_relative_and_chained(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    write(tmp_path / "base.toml", "[training]\nsteps = 11\nseq_len = 100\n[model]\nflavor = '1B'\n")
    write(sub / "mid.toml", 'extends = "../base.toml"\n[training]\nseq_len = 200\n')
    leaf = write(sub / "leaf.toml", 'extends = "mid.toml"\n[optimizer]\nlr = 0.5\n')
    cfg = config.load(str(leaf))
    assert (cfg.training.steps, cfg.training.seq_len, cfg.model.flavor, cfg.optimizer.lr) == (
        11,
        200,
        "1B",
        0.5,
    )


def test_extends_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="extends itself"):
        config.load(str(tmp_path / "a.toml"))


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--training.step", "3"], "unknown config key training.step; did you mean training.steps"),
        (["--trainig.steps", "3"], r"unknown config section \[trainig\]; did you mean \[training\]"),
        (["--training.lr", "3"], "did you mean optimizer.lr"),
        (["--training.steps", "many"], "training.steps must be an integer"),
        (["--training.precision", "fp16"], "training.precision = 'fp16' is not one of fp32, bf16"),
        (["--compile.enable=maybe"], "compile.enable must be true or false"),
        (["--optimizer.lr", "inf"], "optimizer.lr must be a finite number"),
        (["--training.max_norm", "nan"], "training.max_norm must be a finite number"),
        (["--no-training.steps"], "only applies to true/false keys"),
        (["--training.seq_len"], "needs a value"),
        (
            ["--training.steps", "--training.seq_len", "64"],
            r"steps needs a value \(the next argument, --training",
        ),
        (["steps=3"], "overrides look like --section.key value"),
        (["--job.name", "ab\udcffc"], r"job\.name = 'ab\\udcffc' holds bytes that are not UTF-8 text"),
    ],
)
def test_cli_errors(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(None, args)


def test_home_folder_and_byte_order_mark(tmp_path, monkeypatch):
    """`~` in the keys naming run folders and checkpoints means the home folder (as data.path's does); a
    TOML file that a Windows editor began with a byte-order mark reads as the same file without it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + b'[job]\ndump_folder = "~/runs"\n[training]\nsteps = 3\n')
    cfg = config.load(str(path), ["--checkpoint.load_path", "~/ck/step-2", "--model.from_checkpoint", "~/m"])
    assert cfg.job.dump_folder == str(tmp_path / "home" / "runs") and cfg.training.steps == 3
    assert cfg.checkpoint.load_path == str(tmp_path / "home" / "ck" / "step-2")
    assert cfg.model.from_checkpoint == str(tmp_path / "home" / "m")
    assert config.load(None, ["--checkpoint.folder", "ck"]).checkpoint.folder == "ck"


def test_toml_non_finite_floats_are_refused(tmp_path):
    path = write(tmp_path / "n.toml", "[optimizer]\nlr = nan\n")
    with pytest.raises(ConfigError, match="optimizer.lr must be a finite number"):
        config.load(str(path))


def test_toml_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(str(tmp_path / "missing.toml"))
    bad_type = write(tmp_path / "t.toml", '[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="training.steps must be an integer"):
        config.load(str(bad_type))
    unknown = write(tmp_path / "u.toml", "[trainer]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"did you mean \[training\]"):
        config.load(str(unknown))
    broken = write(tmp_path / "b.toml", "[training\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(str(broken))


@pytest.mark.parametrize(
    "files, fragment",
    [
        # an unknown key, its line under its table
        (
            {"a.toml": "[training]\nsteps = 3\n\n[model]\nflavr = 'debug'\n"},
            "a.toml:5: unknown config key model.flavr; did you mean model.flavor?",
        ),
        # a bad type, quoted key
        (
            {"a.toml": "# run\n[training]\nsteps = 3\n'seq_len' = 'long'\n"},
            "a.toml:4: training.seq_len must be an integer, got 'long'",
        ),
        # an unknown section: its header
        (
            {"a.toml": "[optimizer]\nlr = 0.1\n[trainer]\nsteps = 3\n"},
            "a.toml:3: unknown config section [trainer]; did you mean [training]?",
        ),
        # a dotted key and an inline table before any header
        (
            {"a.toml": "training.steps = 3\nmodel = { flavor = 'debug', vocab_sise = 3 }\n"},
            "a.toml:2: unknown config key model.vocab_sise",
        ),
        # in an extends chain: the file that has the key, not the one passed to --config
        (
            {
                "a.toml": "extends = 'base.toml'\n[training]\nsteps = 4\n",
                "base.toml": "[optimizer]\nlr = 0.1\n\n[training]\nsteps = 2\nprecision = 'fp16'\n",
            },
            "base.toml:6: training.precision = 'fp16' is not one of fp32, bf16",
        ),
        ({"a.toml": "extends = 3\n"}, "a.toml:1: extends must name the TOML file this one builds on, got 3"),
        ({"a.toml": "extends = ''\n"}, "a.toml:1: extends must name the TOML file this one builds on"),
        # a file it extends that is missing or not a file: named with the line that names it
        ({"a.toml": "\nextends = 'base.toml'\n"}, "a.toml:2: extends names '{tmp}/base.toml', which is not"),
        ({"a.toml": "extends = 'sub'\n", "sub": None}, "a.toml:1: extends names '{tmp}/sub', which is a fo"),
        ({"a.toml": "training = 3\n"}, "a.toml:1: top-level key 'training' must be a [section] table"),
    ],
)
def test_toml_key_and_type_errors_name_the_file_and_line(tmp_path, files, fragment):
    for name, text in files.items():
        write(tmp_path / name, text) if text is not None else (tmp_path / name).mkdir()
    with pytest.raises(ConfigError) as e:
        config.load(str(tmp_path / "a.toml"))
    assert str(e.value).startswith(f"{tmp_path}/{fragment.format(tmp=tmp_path)}"), str(e.value)


def test_toml_line():
    text = "extends = 'b.toml'\n[training]\nsteps = 3\n[optimizer]\nlr = 1.0\n"
    assert config.toml_line(text, "training", "steps") == 3
    assert config.toml_line(text, "optimizer", "lr") == 5 and config.toml_line(text, "optimizer") == 4
    assert config.toml_line(text, "training", "lr") is None  # lr is in another table
    assert config.toml_line(text, "extends") == 1


def test_help_is_wrapped_and_grouped_by_section():
    width = 64
    text = config.help_text(width)
    lines = text.splitlines()
    # Only a word longer than the line (a long type such as pp_schedule's choices) overflows it.
    assert all(len(line) <= width or len(line.split()) <= 2 for line in lines), max(lines, key=len)
    assert sum(len(line) > width for line in lines) <= 2
    # Keys by section: each [section] header, in order, followed by exactly its own keys.
    heads = [i for i, line in enumerate(lines) if line.startswith("[")]
    assert [lines[i] for i in heads] == [f"[{name}]" for name in config.sections()]
    for i, (name, cls) in zip(heads, config.sections().items()):
        block = lines[i + 1 : (heads + [len(lines)])[heads.index(i) + 1]]
        keys = [line.split()[0] for line in block if line.startswith("  --")]
        assert keys == [f"--{name}.{f.name}" for f in dataclasses.fields(cls)]
    # Unwrapped, a docstring would run past 200 columns.
    assert max(len(line) for line in config.help_text(1000).splitlines()) > 200


def test_help_follows_the_terminal_width():
    env = {**os.environ, "COLUMNS": "72"}
    res = subprocess.run(
        [sys.executable, "-m", "titanrush.train", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and "[parallelism]" in res.stdout
    keys = res.stdout[res.stdout.index("Config keys") :]  # (the usage lines above are train.py's own)
    assert all(len(line) <= 72 or len(line.split()) <= 2 for line in keys.splitlines())
    assert keys.strip() == config.help_text(72).strip()


def test_help_lists_every_key_with_doc():
    text = config.help_text()
    for section, cls in config.sections().items():
        for f in dataclasses.fields(cls):
            assert f"--{section}.{f.name} " in text
    # every field has a docstring: no empty help line follows a key
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("--"):
            assert lines[i + 1].strip(), f"no docstring for {line.strip()}"


def test_resolved_config_round_trips(tmp_path):
    cfg = config.load(None, ["--training.steps", "9", "--float8.filter_fqns", "a,b", "--job.name", 'we"ird'])
    path = write(tmp_path / "resolved.toml", config.to_toml(cfg))
    again = config.load(str(path))
    assert again == cfg


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titanrush.train", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--training.stepz", "3"], "did you mean training.steps"),
        (["--config", "no/such/file.toml"], "not found"),
        (["--config", "/"], "is a folder; pass a TOML file"),
        (["--config="], "--config is empty"),
        (["--job.name", "../../escape"], "job.name = '../../escape': a folder name under job.dump_folder"),
        (["--job.name", ""], "job.name = '': a folder name"),
        (["--training.seq_len", "4096"], "exceeds the debug model's maximum"),
        (["--model.flavor", "8b"], "did you mean '8B'"),
        (["--model.vocab_size", "1000"], "does not cover the tokenizer"),
    ],
)
def test_cli_exit_status_2_with_one_line(args, fragment, tmp_path):
    res = run_cli("--job.dump_folder", str(tmp_path), *args)
    assert res.returncode == 2, res.stderr
    err_lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(err_lines) == 1 and fragment in err_lines[0], res.stderr
    assert not any(tmp_path.iterdir()), "nothing may be written on a config error"


def test_the_console_script_passes_each_commands_status_on(tmp_path):
    """`titanrush` (pyproject's script, `cli.run`, and `python -m titanrush`) exits with the command's
    status: 0 for help, 2 and one line for a config error, 2 for an unknown command."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"titanrush": "titanrush.cli:run"}
    code = "from titanrush.cli import run; run()"  # (argv after -c: the command's)

    def script(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", code, *args]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    res = script("train", "--help")
    assert res.returncode == 0 and "--training.seq_len" in res.stdout, res.stderr
    res = script("train", "--training.stepz", "3")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "did you mean training.steps" in lines[0], res.stderr
    res = script("trian")
    assert res.returncode == 2 and "unknown command 'trian'; did you mean 'train'?" in res.stderr, res.stderr
    # `python -m titanrush` is the same script
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "titanrush", "train", "--training.stepz", "3"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "did you mean training.steps" in res.stderr, res.stderr
    assert not any(tmp_path.iterdir())


def test_help_exits_zero():
    res = run_cli("--help")
    assert res.returncode == 0
    assert "--training.seq_len" in res.stdout and "--parallelism.tp" in res.stdout


@pytest.mark.parametrize(
    "backend, fragment",
    [
        ("flash", "flash-attn's kernels run on CUDA GPUs"),
        ("flex", "FlexAttention has no backward on CPU"),
        ("cudnn", "cuDNN attention is a GPU kernel"),
    ],
)
def test_attention_backend_that_cannot_run_here_is_a_config_error(backend, fragment, tmp_path):
    """On this machine without CUDA: a GPU config (`titanrush.run.machine`), refused in one line."""
    res = run_cli("--job.dump_folder", str(tmp_path), "--model.attn_backend", backend)
    assert res.returncode == 2 and fragment in res.stderr and "this machine has none" in res.stderr, (
        res.stderr
    )


def test_config_reference_doc_is_current():
    """docs/config.md is generated from the dataclasses: it must list the keys as they are now."""
    cmd = [sys.executable, "scripts/gen_config_doc.py", "--check"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def train_errors(argv: list[str], capsys: pytest.CaptureFixture, tmp_path: Path) -> str:
    """Run `titanrush train` in this process on bad input: exit 2, one short line, nothing written."""
    from titanrush.train import main

    assert main(["--job.dump_folder", str(tmp_path / "runs"), *argv]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("titanrush: config error: "), err
    assert not (tmp_path / "runs").exists()
    return err


BIG_FLOAT = "1" + "0" * 400  # an integer past a float's range (~1.8e308)
HUGE_INT = "1" + "0" * 5000  # more digits than Python reads into an int (4300)


@pytest.mark.parametrize(
    "toml, fragment",
    [
        (f"[optimizer]\nlr = {BIG_FLOAT}\n", "c.toml:2: optimizer.lr must be a finite number, got 1000"),
        (f"[training]\nsteps = {HUGE_INT}\n", "c.toml:2: an integer of more than 4300 digits"),
        # hexadecimal: tomllib reads it, but neither a float nor a printed message can hold it
        (
            f"[training]\nsteps = 1\n\n[optimizer]\nlr = 0x{'f' * 5000}\n",
            "c.toml:5: optimizer.lr must be a finite",
        ),
        (
            f"[training]\nseed = 0x{'f' * 5000}\n",
            "c.toml:2: training.seed must be an integer of at most 4300 digits",
        ),
    ],
)
def test_numbers_python_cannot_hold_in_toml_are_config_errors(tmp_path, capsys, toml, fragment):
    path = write(tmp_path / "c.toml", toml)
    err = train_errors(["--config", str(path)], capsys, tmp_path)
    assert f"{tmp_path}/{fragment}" in err and len(err) < 300, err  # (the value shown cut short)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--optimizer.lr", BIG_FLOAT], "optimizer.lr must be a finite number, got '1000"),
        (["--training.steps", HUGE_INT], "training.steps must be an integer of at most 4300 digits"),
        (["--training.steps", "1__0"], "training.steps must be an integer, got '1__0'"),
    ],
)
def test_numbers_python_cannot_hold_on_the_command_line_are_config_errors(tmp_path, capsys, args, fragment):
    err = train_errors(args, capsys, tmp_path)
    assert fragment in err and len(err) < 300, err  # (the value shown cut short)


def test_an_unreadable_config_file_is_a_config_error(tmp_path, capsys, monkeypatch):
    assert "is a folder; pass a TOML file to --config" in train_errors(
        ["--config", str(tmp_path)], capsys, tmp_path
    )
    long_name = str(tmp_path / ("x" * 5000))  # ENAMETOOLONG from the file system, not a missing file
    err = train_errors(["--config", long_name], capsys, tmp_path)
    assert "cannot be read (File name too long); pass a TOML file to --config" in err
    os.mkfifo(tmp_path / "pipe")  # (reading it would wait for a writer)
    err = train_errors(["--config", str(tmp_path / "pipe")], capsys, tmp_path)
    assert "is not a regular file (a pipe or a device); pass a TOML file to --config" in err
    if Path("/proc/self/mem").exists():  # a file whose read fails (EIO)
        err = train_errors(["--config", "/proc/self/mem"], capsys, tmp_path)
        assert "config file '/proc/self/mem' cannot be read" in err
    path = write(tmp_path / "c.toml", "[training]\nsteps = 3\n")

    def denied(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # (root reads any file: the refusal, simulated)
    err = train_errors(["--config", str(path)], capsys, tmp_path)
    assert f"config file '{path}' cannot be read (Permission denied)" in err


def test_help_of_one_section_or_the_keys_a_word_names(capsys):
    """`--help SECTION` / `--help WORD` / `--help section.key`: those keys only, in the full reference's
    format; a topic that names nothing is one line and status 2."""
    from titanrush.train import main

    def shown(*argv: str) -> list[str]:
        assert main(list(argv)) == 0
        return [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  --")]

    sched = [f"--lr_scheduler.{f.name}" for f in dataclasses.fields(config.sections()["lr_scheduler"])]
    assert shown("--help", "lr_scheduler") == sched == shown("-h", "[lr_scheduler]")
    assert shown("--help", "warmup") == ["--lr_scheduler.warmup_steps"]
    assert shown("--help", "training.seq_len") == ["--training.seq_len"]
    every = [f"--{s}.{f.name}" for s, cls in config.sections().items() for f in dataclasses.fields(cls)]
    seq = [key for key in every if "seq" in key]
    assert shown("--help", "SEQ") == seq and len(seq) > 2
    assert shown("--help", "--training.steps", "3") == every  # (a flag after --help is no topic)
    assert main(["--help", "nosuch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no section or key name holds 'nosuch'; sections: job, model" in err[0], err


def test_the_full_reference_ends_with_the_sections():
    """The last lines of the 400-line reference (what a terminal shows) list the sections and how to ask
    for one; run_train.sh passes the topic on."""
    lines = config.help_text(80).splitlines()
    tail = lines[-len(config.sections()) - 2 :]
    assert tail[0].startswith("Sections (--help SECTION shows one")
    assert [line.split()[0] for line in tail[-len(config.sections()) :]] == list(config.sections())
    assert all(len(line) <= 80 for line in tail)
    res = subprocess.run(
        [str(ROOT / "run_train.sh"), "--help", "checkpoint"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and "--checkpoint.interval" in res.stdout and "--training." not in res.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["--training.steps", "2_0"],
            "training.steps must be an integer, got '2_0': the command line takes no",
        ),
        (["--training.steps", "1_000"], "no '_' between digits; write the digits alone"),
        (
            ["--optimizer.lr", "1_0.5"],
            "optimizer.lr must be a number, got '1_0.5': the command line takes no",
        ),
        (["--training.steps", "٢٠"], "training.steps must be an integer written in ASCII digits"),
    ],
)
def test_python_digit_spellings_on_the_command_line_are_refused(args, fragment):
    """int() and float() read `2_0` as 20 and Arabic-Indic digits as ASCII ones; on a command line the
    first is a typo (of 20? 2.0? 200?) and the second no setting a user types: refused, not guessed."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        config.load(None, args)


def test_toml_digit_separators_are_the_format_s_own(tmp_path):
    """In a TOML file `_` between digits is the format's own separator: it reads as the number."""
    assert config.load(str(write(tmp_path / "c.toml", "[training]\nsteps = 2_0\n"))).training.steps == 20


@pytest.mark.parametrize(
    "text", ["", "\n# only a comment\n", "[training]\n[optimizer]\n"], ids=["empty", "comments", "tables"]
)
def test_an_empty_config_file_is_refused(tmp_path, capsys, text):
    """A file that sets no key is a mistake (the wrong file, one not yet saved): the run would silently
    train the defaults. Refused, naming the file, with how to get the defaults on purpose."""
    path = write(tmp_path / "c.toml", text)
    err = train_errors(["--config", str(path)], capsys, tmp_path)
    assert f"config file '{path}' is empty: it sets no key, so the run would take the defaults" in err
    assert err.rstrip().endswith("or leave --config out to train with the defaults"), err


def test_an_empty_file_that_a_config_extends_is_refused_and_only_extends_is_fine(tmp_path):
    write(tmp_path / "base.toml", "")
    with pytest.raises(
        ConfigError,
        match=r"c\.toml:1: extends names '.*base\.toml', which is empty: .* or remove the extends line$",
    ):
        config.load(str(write(tmp_path / "c.toml", 'extends = "base.toml"\n')))
    write(tmp_path / "base.toml", "[training]\nsteps = 7\n")
    assert config.load(str(tmp_path / "c.toml")).training.steps == 7  # a file of `extends` alone sets keys


def test_a_key_given_twice_on_the_command_line_is_said_and_the_last_is_used(tmp_path):
    """Given twice (a wrapper script's default, then the caller's own), the last wins, as in every
    command-line parser, and the run says so once, naming both values; the same value twice says nothing."""
    args = ["--training.steps", "3", "--checkpoint.enable", "--training.steps=5", "--no-checkpoint.enable"]
    assert config.repeated_overrides([*args, "--job.name", "a", "--job.name", "a"]) == [
        "--training.steps is given twice on the command line (3, then 5): the last, 5, is used",
        "--checkpoint.enable is given twice on the command line (true, then false): the last, false, is used",
    ]
    cfg = config.load(None, args)
    assert cfg.training.steps == 5 and cfg.checkpoint.enable is False
    res = run_cli("--job.dump_folder", str(tmp_path), *args, "--data.dataset", "synthetic", "--check")
    assert res.returncode == 0, res.stderr
    warned = [line for line in res.stderr.splitlines() if "is given" in line]
    assert len(warned) == 2 and "WARNING --training.steps is given twice" in warned[0], res.stderr


def test_two_config_files_are_refused_naming_both(tmp_path):
    """`--config a --config b` used to train b's model silently; one file twice is one file."""
    a = write(tmp_path / "a.toml", "[training]\nsteps = 3\n")
    b = write(tmp_path / "b.toml", "[training]\nsteps = 5\n")
    with pytest.raises(ConfigError, match=r"--config is given 2 times \(.*a\.toml, then .*b\.toml\)"):
        config.split_args(["--config", str(a), f"--job.config_file={b}"])
    assert config.split_args(["--config", str(a), "--config", str(a), "--check"]) == (str(a), True, [])
    res = run_cli("--config", str(a), "--config", str(b), "--check")
    assert res.returncode == 2 and "one run reads one config file" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_the_run_folder_is_named_after_the_model_unless_a_name_is_given(tmp_path):
    """Runs of different models from the defaults never share a folder (a Llama 4 run used to resume
    from the dense quick start's checkpoint in outputs/debug); a name given anywhere wins."""
    assert config.load(None, []).job.name == "debug"
    assert config.load(None, ["--model.flavor", "llama4_debug"]).job.name == "llama4_debug"
    assert config.load(None, ["--model.flavor", "llama4_debug", "--job.name", "mine"]).job.name == "mine"
    toml = tmp_path / "c.toml"
    toml.write_text('[job]\nname = "from_file"\n[model]\nflavor = "llama4_debug"\n')
    assert config.load(str(toml), []).job.name == "from_file"
    toml.write_text('[model]\nflavor = "llama4_debug"\n')
    assert config.load(str(toml), []).job.name == "llama4_debug"
