"""Bad input to `titanrush convert` and `titanrush generate`: corrupt Hugging Face folders and paths of the
wrong kind give one line naming the file and the fix, exit 2, no traceback, and leave everything as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_hf import make_model, save_checkpoint

from titanrush.interop import hf, hf_convert
from titanrush.models.llama import model_args
from titanrush.tools import convert, generate

ARGS = model_args("debug", dim=64, n_layers=1, n_heads=4, n_kv_heads=2)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny run (`run/checkpoint/step-3`), its HF export and its .pt export, shared by every test."""
    root = tmp_path_factory.mktemp("made")
    step = save_checkpoint(make_model(ARGS), root / "run" / "checkpoint", step=3)
    hf_dir = hf_convert.export_hf(step, root / "hf", dtype=torch.float32, tokenizer="default")
    pt = hf_convert.export_pt(step, root / "m.pt")
    return {"root": root, "run": root / "run", "step": step, "hf": hf_dir, "pt": pt}


def one_error_line(capsys: pytest.CaptureFixture, tool: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"titanrush {tool}: error: "), err
    return err.strip()


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under folder and a hash of its bytes: what a refused command must leave as it was."""
    return {
        str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def rewrite(name: str, change: Callable[[bytes], bytes]) -> Callable[[Path], Path]:
    def corrupt(folder: Path) -> Path:
        (folder / name).write_bytes(change((folder / name).read_bytes()))
        return folder / name

    return corrupt


def header(raw: bytes) -> Callable[[bytes], bytes]:
    return lambda _: len(raw).to_bytes(8, "little") + raw


def to_bin(folder: Path) -> Path:
    """The weights as a truncated pytorch_model.bin (transformers' older format)."""
    weights = hf.load_safetensors(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(weights, folder / "pytorch_model.bin")
    return rewrite("pytorch_model.bin", lambda b: b[: len(b) // 2])(folder)


def sharded(index: str | None) -> Callable[[Path], Path]:
    """Two shards + an index; the second shard missing, or the index replaced by `index`."""

    def corrupt(folder: Path) -> Path:
        weights = hf.load_safetensors(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        names = sorted(weights)
        files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        hf.save_safetensors({k: weights[k] for k in names[::2]}, folder / files[0])
        weight_map = {k: files[i % 2] for i, k in enumerate(names)}
        (folder / "model.safetensors.index.json").write_text(index or json.dumps({"weight_map": weight_map}))
        return folder / ("model.safetensors.index.json" if index else files[1])

    return corrupt


def weights_folder(folder: Path) -> Path:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    return folder / "model.safetensors"


CORRUPT = {
    "truncated_safetensors": (rewrite("model.safetensors", lambda b: b[:-100]), "is truncated: tensor"),
    "truncated_header": (rewrite("model.safetensors", lambda b: b[:50]), "is truncated or not a safetensors"),
    "empty_safetensors": (rewrite("model.safetensors", lambda b: b""), "the file has only 0 bytes"),
    "garbage_header_length": (
        rewrite("model.safetensors", lambda b: (10**15).to_bytes(8, "little") + b[8:]),
        "header length 1,000,000,000,000,000",
    ),
    "header_not_json": (
        rewrite("model.safetensors", lambda b: b[:8] + b"\xff@" + b[10:]),
        "header is not JSON",
    ),
    "header_not_an_object": (rewrite("model.safetensors", header(b"[1, 2]  ")), "not a JSON object"),
    "header_entry_malformed": (
        rewrite("model.safetensors", header(b'{"a": {"dtype": "F32"}}')),
        "header entry for 'a' is malformed",
    ),
    "header_sizes_disagree": (
        rewrite(
            "model.safetensors",
            header(b'{"a": {"dtype": "F32", "shape": [1000000, 1000000], "data_offsets": [0, 4]}}'),
        ),
        "tensor a has 4 bytes for shape [1000000, 1000000]",
    ),
    "git_lfs_pointer": (
        rewrite("model.safetensors", lambda b: b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n"),
        "is a Git LFS pointer, not the weights: run `git lfs pull`",
    ),
    "weights_are_a_folder": (weights_folder, "cannot be read (Is a directory)"),
    "truncated_bin": (to_bin, "is truncated or not a PyTorch weights file"),
    "index_not_json": (sharded("{not json"), "is truncated or not JSON"),
    "index_without_weight_map": (sharded('{"metadata": {}}'), "has no weight_map"),
    "index_names_a_missing_shard": (sharded(None), "is listed in the index but missing"),
    "config_not_json": (rewrite("config.json", lambda b: b[: len(b) // 2]), "is truncated or not valid JSON"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_corrupt_hf_folder_is_one_line_naming_the_file(tmp_path, made, capsys, case):
    corrupt, message = CORRUPT[case]
    folder = shutil.copytree(made["hf"], tmp_path / "hf")
    named = corrupt(folder)
    before = snapshot(folder)
    assert convert.main(["--from-hf", str(folder), str(tmp_path / "imported")]) == 2
    err = one_error_line(capsys, "convert")
    assert f"error: {named} " in err and message in err, err
    assert not (tmp_path / "imported").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert generate.main(["--checkpoint", str(folder), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    err = one_error_line(capsys, "generate")
    assert f"error: {named} " in err and message in err, err
    assert snapshot(folder) == before


def wrong_paths(made: dict[str, Path]) -> list[tuple[str, list[str], str]]:
    """(tool, argv, the message) of each path of the wrong kind."""
    run, step, pt, hf_dir, out = made["run"], made["step"], made["pt"], made["hf"], made["root"] / "out"
    gen = ["--prompt", "x", "--max-new-tokens", "1"]
    is_run = f"{run} is a run folder; its checkpoints are in {run / 'checkpoint'}: pass {step} (the newest)"
    pt_file = f"{pt} is a .pt file, which only torch.load reads: pass the checkpoint it was exported from"
    hf_fix = "Hugging Face model folder (config.json + weights)"
    return [
        (
            "generate",
            ["--checkpoint", str(pt), *gen],
            f"{pt_file} (a .../checkpoint/step-<N> folder) or a Hugging",
        ),
        ("generate", ["--checkpoint", str(run), *gen], is_run),
        (
            "generate",
            ["--checkpoint", str(hf_dir / "config.json"), *gen],
            f"{hf_dir / 'config.json'} is a file, not a folder: pass the folder that holds it, {hf_dir}",
        ),
        (
            "generate",
            ["--checkpoint", str(step / "titanrush.json"), *gen],
            f"{step / 'titanrush.json'} is a file, not a folder: pass the folder that holds it, {step}",
        ),
        ("convert", ["--to-hf", str(pt), str(out)], f"{pt_file} (a .../checkpoint/step-<N> folder)"),
        ("convert", ["--to-pt", str(pt), str(out)], pt_file),
        ("convert", ["--to-hf", str(run), str(out)], is_run),
        ("convert", ["--to-pt", str(run), str(out)], is_run),
        (
            "convert",
            ["--to-hf", str(hf_dir), str(out)],
            f"{hf_dir} is a Hugging Face model folder, not a titanrush checkpoint: import it first",
        ),
        (
            "convert",
            ["--from-hf", str(pt), str(out)],
            f"{pt} is a .pt file, which only torch.load reads: pass a {hf_fix}",
        ),
        (
            "convert",
            ["--from-hf", str(run), str(out)],
            f"{run} is a titanrush run folder, not a Hugging Face folder: export it first (titanrush convert "
            f"--to-hf {step} OUT_DIR)",
        ),
        (
            "convert",
            ["--from-hf", str(step), str(out)],
            f"{step} is a titanrush checkpoint, not a Hugging Face folder",
        ),
        (
            "convert",
            ["--from-hf", str(made["root"] / "nope"), str(out)],
            f"nope does not exist; pass a {hf_fix}",
        ),
        ("convert", ["--to-pt", str(step), str(step)], f"{step} is a checkpoint folder: write the .pt file"),
    ]


def test_a_path_of_the_wrong_kind_says_what_to_pass(made, capsys):
    before = snapshot(made["root"])
    for tool, argv, message in wrong_paths(made):
        assert (convert if tool == "convert" else generate).main(argv) == 2, argv
        err = one_error_line(capsys, tool)
        assert message in err, (argv, err)
    assert snapshot(made["root"]) == before  # nothing written, nothing changed


def test_to_pt_into_a_folder_writes_model_pt_there(tmp_path, made, capsys):
    """OUT that is a folder, or ends with /, gets OUT/model.pt (as cp puts a file into a folder); a model.pt
    already there is refused and kept."""
    (tmp_path / "existing").mkdir()
    for out, written in [
        (str(tmp_path / "existing"), tmp_path / "existing" / "model.pt"),
        (str(tmp_path / "new") + "/", tmp_path / "new" / "model.pt"),
    ]:
        assert convert.main(["--to-pt", str(made["step"]), out]) == 0
        assert capsys.readouterr().out.strip() == f"wrote {written}"
        assert torch.load(written, weights_only=True)["step"] == 3
        assert [p.name for p in written.parent.iterdir()] == ["model.pt"]
    written.write_bytes(b"keep me")
    assert convert.main(["--to-pt", str(made["step"]), str(written.parent)]) == 2
    assert f"{written} exists: export to a new path" in one_error_line(capsys, "convert")
    assert written.read_bytes() == b"keep me"


def _dim_a_string(step: Path) -> None:
    info = json.loads((step / "titanrush.json").read_text())
    info["model_args"]["dim"] = str(info["model_args"]["dim"])
    (step / "titanrush.json").write_text(json.dumps(info))


def _shard_cut(step: Path) -> None:
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])


@pytest.mark.parametrize(
    "damage, message",
    [
        (_dim_a_string, 'titanrush.json has model_args.dim "64" (a string), not a whole number'),
        (_shard_cut, "has 1,000 bytes, .metadata places data up to byte"),
    ],
    ids=["dim_a_string", "shard_cut"],
)
def test_a_damaged_checkpoint_without_a_record_is_corrupt_for_the_tools(
    tmp_path, made, capsys, damage, message
):
    """Without an integrity record (a copy that lost it, an import), the tools check titanrush.json's shape
    and the shards' lengths as a resume does."""
    step = shutil.copytree(made["step"], tmp_path / "step-3")
    (step / "integrity.json").unlink(missing_ok=True)
    damage(step)
    before = snapshot(step)
    for tool, argv in [
        ("generate", ["--checkpoint", str(step), "--prompt", "x", "--max-new-tokens", "1"]),
        ("convert", ["--to-pt", str(step), str(tmp_path / "m.pt")]),
    ]:
        assert (convert if tool == "convert" else generate).main(argv) == 2
        err = one_error_line(capsys, tool)
        assert f"checkpoint {step} is corrupt: " in err and message in err, err
    assert snapshot(step) == before and not (tmp_path / "m.pt").exists()
