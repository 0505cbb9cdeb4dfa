"""The side-by-side benchmark's own logic: log parsing, the ratio table, the tokenizer conversion."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import side_by_side as sbs  # noqa: E402


def test_parses_torchtitan_step_lines():
    # torchtitan 0.2.2's metrics line (components/metrics.py) with color printing disabled.
    line = (
        "[titan] 2026-11-21 08:00:00,000 - root - INFO - step: 21  loss:  7.12345  grad_norm:  1.2345  "
        "memory: 50.71GiB(35.47%)  tps: 64,512  tflops: 530.12  mfu: 53.60%"
    )
    m = sbs._TT_STEP.search(line)
    assert m and (int(m[1]), float(m[2]), float(m[3]), m[4]) == (21, 7.12345, 50.71, "64,512")
    assert sbs._TR_STEP.search("08:00:00 INFO step     21  loss 7.1234  gnorm 1.0")[1] == "21"


def test_ratio_table_compares_each_variant_with_torchtitan():
    results = [
        {
            "trainer": "torchtitan",
            "row": "r",
            "variant": "-",
            "status": "ok",
            "tps": 100.0,
            "mem_reserved_gib": 50.0,
            "first_step_s": 30.0,
        },
        {
            "trainer": "titanrush",
            "row": "r",
            "variant": "same",
            "status": "ok",
            "tps": 110.0,
            "mem_reserved_gib": 40.0,
            "first_step_s": 20.0,
        },
        {
            "trainer": "titanrush",
            "row": "r",
            "variant": "same",
            "status": "ok",
            "tps": 130.0,
            "mem_reserved_gib": 44.0,
            "first_step_s": 24.0,
        },
        {"trainer": "titanrush", "row": "r", "variant": "v", "status": "OOM"},
    ]
    table = sbs.ratio_table(results).splitlines()
    assert len(table) == 4
    assert table[2] == "| r | same | 100 | 120 | 1.200x | 50.0 | 44.0 | 0.88 | 30 | 22 |"
    assert "(OOM)" in table[3] and "| -x |" in table[3]


def test_torchtitan_config_carries_the_row_settings(tmp_path):
    toml = sbs.torchtitan_toml(
        sbs.ROWS["8b_compile_float8"], 40, tmp_path / "tok", tmp_path / "c", tmp_path / "d"
    )

    cfg = tomllib.loads(toml)
    assert cfg["model"]["flavor"] == "8B" and cfg["model"]["converters"] == ["quantize.linear.float8"]
    assert cfg["training"]["local_batch_size"] == 2 and cfg["training"]["seq_len"] == 8192
    assert cfg["activation_checkpoint"]["selective_ac_option"] == "op" and cfg["compile"]["enable"] is True
    args = sbs.titanrush_args(sbs.ROWS["1b_eager"])
    assert "--no-compile.enable" in args and args[args.index("--model.tie_embeddings") + 1] == "untied"


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs the tokenizers package")
def test_converted_tokenizer_round_trips(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    from titanrush.data.tokenizer import build_tokenizer

    sbs.write_hf_tokenizer(tmp_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ours = build_tokenizer("default")
    text = "def f(x):\n    return {'a': x ** 2}  # größer\n"
    ids = hf.encode(text).ids
    assert hf.decode(ids) == text
    assert len(ids) <= 2 * len(ours.encode(text, bos=False, eos=False))  # BPE merges applied, not bytes
    assert hf.token_to_id("<|begin_of_text|>") == ours.bos_id


def test_execute_timestamps_steps_and_summarizes_the_steady_state(tmp_path):
    lines = [
        f"step: {i}  loss: {10 - i:.5f}  grad_norm: 1.0  memory: {40 + i:.2f}GiB(30.00%)  tps: {1000 * i:,}"
        for i in range(1, 5)
    ]
    code = "import sys\nfor line in sys.argv[1:]: print(line)"
    run = sbs.Run("torchtitan", "r", "-", [sys.executable, "-c", code, *lines], {}, tmp_path / "log")
    sbs.execute(run, timeout=60)
    s = sbs.summarize(run, measure_from=3)
    assert s["status"] == "ok" and s["steps_measured"] == "3-4"
    assert s["tps"] == 3500 and s["mem_reserved_gib"] == 44 and s["final_loss"] == 6
    assert 0 < s["first_step_s"] < 60
    failing = sbs.Run(
        "torchtitan", "r", "-", [sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "l2"
    )
    sbs.execute(failing, timeout=60)
    assert sbs.summarize(failing, 1)["status"] == "failed (3)"


def test_execute_on_one_gpu_names_the_log_and_moves_the_metrics_aside(tmp_path):
    code = "import os\nprint('visible', os.environ['CUDA_VISIBLE_DEVICES'])"
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0, "tps": 10.0, "mem_reserved_gib": 1.0}\n')
    run = sbs.Run(
        "titanrush", "r", "same", [sys.executable, "-c", code], {}, tmp_path / "run.log", metrics=metrics
    )
    sbs.execute(run, timeout=60, gpu="7")
    assert "visible 7" in (tmp_path / "run.gpu7.log").read_text()
    assert not metrics.exists() and (tmp_path / "metrics.gpu7.jsonl").exists()
    assert sbs.summarize(run, measure_from=1)["tps"] == 10.0


def test_fresh_compile_caches_give_each_execution_its_own_empty_folders(tmp_path):
    keys = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
    code = f"import os\nprint(*(os.environ[k] for k in {keys}))"
    run = sbs.Run("titanrush", "r", "v", [sys.executable, "-c", code], {}, tmp_path / "run.log")
    seen = []
    for _ in range(2):  # the same run twice (as --repeats 2 does): a new folder each time
        sbs.execute(run, timeout=60, caches=tmp_path / "caches")
        seen.append(run.log.read_text().splitlines()[-1].split())
    (ind1, tri1, fa1), (ind2, tri2, fa2) = seen  # inductor's, Triton's and flash-attn-4's kernels
    assert ind1 != ind2 and tri1 != tri2 and fa1 != fa2
    paths = (ind1, ind2, tri1, tri2, fa1, fa2)
    assert all(Path(p).parent.parent == tmp_path / "caches" for p in paths)
    assert not any(Path(p).exists() for p in paths)  # nothing in them before the run
    plain = sbs.Run(
        "titanrush", "r", "v", [sys.executable, "-c", "import os\nprint(os.environ)"], {}, tmp_path / "l"
    )
    sbs.execute(plain, timeout=60)
    assert "TORCHINDUCTOR_CACHE_DIR" not in plain.log.read_text()


def test_profile_option_configures_both_trainers_and_finds_their_traces(tmp_path):
    row = sbs.ROWS["8b_eager"]
    cfg = tomllib.loads(sbs.torchtitan_toml(row, 10, tmp_path, tmp_path, tmp_path / "d", profile_step=8))
    prof = cfg["profiling"]
    assert prof["enable_profiling"] is True and prof["profile_freq"] == 8
    assert prof["profiler_warmup"] + prof["profiler_active"] <= prof["profile_freq"]  # torchtitan asserts it
    assert "profiling" not in tomllib.loads(sbs.torchtitan_toml(row, 10, tmp_path, tmp_path, tmp_path / "d"))
    args = sbs.profile_args(8)
    assert args[args.index("--profiling.freq") + 1] == "8" and sbs.profile_args(0) == []
    # where each trainer writes rank 0's trace, named by row (torchtitan) and run tag (titanrush)
    tt = tmp_path / "tt_dump" / "8b_eager" / "profile_traces" / "iteration_8" / "rank0_trace.json"
    tr = tmp_path / "tr_dump" / "8b_eager+ac_alternate" / "profile" / "step-8" / "rank0.trace.json.gz"
    other_rank = tmp_path / "tr_dump" / "8b_eager" / "profile" / "step-8" / "rank1.trace.json.gz"
    other_step = tmp_path / "tr_dump" / "8b_eager+ac_alternate" / "profile" / "step-4" / "rank0.trace.json.gz"
    older_run = tmp_path / "tt_dump" / "8b_compile" / "profile_traces" / "iteration_8" / "rank0_trace.json"
    for p in (tt, tr, other_rank, other_step, older_run):
        p.parent.mkdir(parents=True)
        p.write_text("{}")
    names = {"8b_eager", "8b_eager+ac_alternate"}
    assert sbs.traces(tmp_path, 8, names) == [
        ("torchtitan 8b_eager, step 8", tt),
        ("titanrush 8b_eager+ac_alternate, step 8", tr),
    ]
    assert len(sbs.traces(tmp_path, 8)) == 3  # without names: the older run's trace too


def test_profile_and_snapshot_flags_are_checked(tmp_path):
    script = str(Path(sbs.__file__))
    for extra, msg in (
        (["--profile", "5", "--memory-snapshot", "5"], "give one"),
        (["--profile", "50"], "must end in 4..--steps"),
        (["--variants", "same,fast"], "unknown variants ['fast']"),
    ):
        out = subprocess.run(
            [sys.executable, script, "--out", str(tmp_path), "--steps", "10", "--dry-run", *extra],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2 and msg in out.stderr


def test_the_fast_8b_config_is_the_measured_best_settings():
    # train_configs/llama8b_float8_fast.toml holds the settings measured as the best row: the
    # `ac_none_zero2_flash_overlap` variant over the 8B float8 row's flags
    from titanrush import config
    from titanrush.train import split_args

    fast = config.load(str(ROOT / "train_configs" / "llama8b_float8_fast.toml"))
    path, _, flags = split_args(sbs.titanrush_args(sbs.ROWS["8b_compile_float8"]))
    flags += sbs._8B_VARIANTS["ac_none_zero2_flash_overlap"]
    measured = config.load(str(ROOT / path), flags)  # (the benchmark turns checkpoints off: not compared)
    for section in ("model", "float8", "activation_checkpoint", "parallelism", "optimizer", "compile"):
        assert getattr(fast, section) == getattr(measured, section), section
    assert fast.training == measured.training
