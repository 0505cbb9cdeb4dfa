"""`titanrush tokenizer` (train a BPE on files, import a tokenizer.json or a rank file, never into the
package), and a Hugging Face tokenizer folder given to data.tokenizer: trained with, then exported with
the model from another folder (small stand-ins made in the tests: no downloads)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from test_hf_tokenizer import NO_TOKENIZERS, NO_TRANSFORMERS, SAMPLES, make_stand_in

import titanrush
from titanrush import cli
from titanrush.data import make_tokenizer
from titanrush.data.bpe import rank_file_text
from titanrush.data.sources import split_of
from titanrush.data.tokenizer import HFTokenizer, Tokenizer, build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
# Real text, enough for a 1024-id BPE: a few standard-library modules, copied as .txt files.
SOURCES = [json.__file__, shutil.__file__, importlib.util.__file__]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, src in enumerate(SOURCES):
        (folder / f"doc{i}.txt").write_text(Path(src).read_text())
    return folder


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titanrush tokenizer: error: "), err
    return err[0]


def test_trains_a_bpe_of_the_given_size_on_files(tmp_path, corpus, capsys):
    out = tmp_path / "tok"
    assert cli.main(["tokenizer", "--vocab-size", "1024", "--input", str(corpus), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.model"]
    tok = build_tokenizer(str(out))  # the folder is what data.tokenizer takes
    assert isinstance(tok, Tokenizer) and (tok.n_words, tok.n_ranks) == (1024, 768)
    assert f"--data.tokenizer {out} --model.vocab_size 1024" in printed and "note:" not in printed
    for text in SAMPLES:
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == text
    # The same table as the library's trainer on the same text gives: the command adds nothing of its own.
    texts = [(corpus / f"doc{i}.txt").read_text() for i in range(len(SOURCES))]
    kept = [t for i, t in enumerate(texts) if split_of(f"doc{i}.txt") == "train"]
    assert (out / "tokenizer.model").read_text() == rank_file_text(
        make_tokenizer.train_ranks(iter(kept), 1024)
    )

    # Text that runs out of pairs gives a smaller tokenizer, said so; the requested vocabulary covers it.
    small = tmp_path / "small.txt"
    small.write_text("the cat sat on the mat\n" * 20)
    argv = ["tokenizer", "--vocab-size", "4096", "--input", str(small), "--output", str(tmp_path / "s")]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    words = build_tokenizer(str(tmp_path / "s")).n_words
    assert words < 4096 and f"so the tokenizer has {words} ids, not 4096" in printed
    assert "--model.vocab_size 4096" in printed


def test_the_validation_split_is_left_out(tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(300):
        (folder / f"{i}.txt").write_text(f"document {i}\n")
    texts = list(make_tokenizer.train_texts([str(folder)]))
    held_out = [i for i in range(300) if split_of(f"{i}.txt") == "validation"]
    assert held_out and len(texts) == 300 - len(held_out)
    assert not {f"document {i}\n" for i in held_out} & set(texts)


def test_never_writes_into_the_package(tmp_path, corpus, capsys):
    package = Path(titanrush.__file__).resolve().parent
    before = sorted(p.relative_to(package) for p in package.rglob("*"))
    for out in (package, package / "data" / "assets", package / "new_folder"):
        assert cli.main(["tokenizer", "--input", str(corpus), "--output", str(out)]) == 2
        line = one_error_line(capsys)
        assert "inside the installed titanrush package" in line and "scripts/build_tokenizer.py" in line
    assert sorted(p.relative_to(package) for p in package.rglob("*")) == before


def test_build_tokenizer_script_writes_where_it_is_told(tmp_path, corpus, monkeypatch):
    """The shipped file is rebuilt by the script, explicitly (here: a small stand-in of its corpus)."""
    spec = importlib.util.spec_from_file_location("build_tokenizer", ROOT / "scripts" / "build_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert (
        Path(titanrush.__file__).resolve().parent / "data/assets/titanrush_bpe.tiktoken"
        == script.DEFAULT_PATH
    )
    monkeypatch.setattr(script, "train_texts", lambda inputs: make_tokenizer.train_texts([str(corpus)]))
    monkeypatch.setattr(script, "VOCAB_SIZE", 1024)
    assert script.main(["--output", str(tmp_path / "bpe.tiktoken")]) == 0
    assert build_tokenizer(str(tmp_path / "bpe.tiktoken")).n_words == 1024


def test_imports_a_tokenizer_json_folder_or_a_rank_file(tmp_path, capsys):
    pytest.importorskip("tokenizers", reason=NO_TOKENIZERS)
    rank_file, hf_folder = make_stand_in(tmp_path)
    (hf_folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    words = build_tokenizer(str(rank_file)).n_words

    assert cli.main(["tokenizer", "--from", str(hf_folder), "--output", str(tmp_path / "a")]) == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in hf_folder.iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "a" / name).read_bytes() == (hf_folder / name).read_bytes()
    tok = build_tokenizer(str(tmp_path / "a"))
    assert isinstance(tok, HFTokenizer) and tok.n_words == words
    assert f"--data.tokenizer {tmp_path / 'a'} --model.vocab_size {words}" in capsys.readouterr().out

    argv = [
        "tokenizer",
        "--from",
        str(rank_file),
        "--output",
        str(tmp_path / "b"),
        "--vocab-size",
        str(words),
    ]
    assert cli.main(argv) == 0
    assert (tmp_path / "b" / "tokenizer.model").read_bytes() == rank_file.read_bytes()
    assert build_tokenizer(str(tmp_path / "b")).n_words == words

    # An existing tokenizer is kept unless --overwrite; then the other kind's files go.
    argv = ["tokenizer", "--from", str(rank_file), "--output", str(tmp_path / "a")]
    assert cli.main(argv) == 2
    assert "holds a tokenizer already" in one_error_line(capsys)
    assert cli.main([*argv, "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["tokenizer.model"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--from", "FOLDER/nope"], "not found"),
        (["--from", "RANKS", "--vocab-size", "300"], "more than --vocab-size 300"),
        (["--vocab-size", "300"], "--vocab-size 300 is below 512"),
        (["--input", "FOLDER/empty"], "no such file or folder"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    rank_file, _ = make_stand_in(tmp_path)
    argv = [a.replace("FOLDER", str(tmp_path)).replace("RANKS", str(rank_file)) for a in argv]
    assert cli.main(["tokenizer", *argv, "--output", str(tmp_path / "out")]) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_listed_among_the_commands(capsys):
    assert cli.main(["--help"]) == 0
    assert "tokenizer" in capsys.readouterr().out
    assert cli.main(["tokenizer", "--help"]) == 0


def test_an_hf_tokenizer_folder_trains_and_is_exported_with_the_model(tmp_path, monkeypatch, capsys):
    """data.tokenizer = a Hugging Face tokenizer folder, named relative to where the run starts: the run
    trains with it, and the export made from another folder carries it (and its BOS/EOS ids)."""
    pytest.importorskip("tokenizers", reason=NO_TOKENIZERS)
    _, hf_folder = make_stand_in(tmp_path)
    (tmp_path / "start" / "corpus").mkdir(parents=True)
    (tmp_path / "start" / "corpus" / "a.txt").write_text("".join(SAMPLES[:3]) * 20)
    shutil.copytree(hf_folder, tmp_path / "start" / "tok")
    tok = build_tokenizer(str(hf_folder))
    monkeypatch.chdir(tmp_path / "start")
    argv = ["train", "--data.tokenizer", "tok", "--model.vocab_size", "1024", "--checkpoint.enable"]
    argv += ["--training.steps", "1", "--training.seq_len", "32", "--training.local_batch_size", "2"]
    argv += ["--data.dataset", "files", "--data.path", "corpus", "--data.cache_dir", ""]
    argv += ["--job.dump_folder", "runs"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    step = tmp_path / "start" / "runs" / "debug" / "checkpoint" / "step-1"
    assert step.is_dir()

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # where `tok` names nothing
    assert cli.main(["convert", "--to-hf", str(step.parent), "hf"]) == 0, capsys.readouterr().err
    out = tmp_path / "elsewhere" / "hf"
    assert (out / "tokenizer.json").read_bytes() == (hf_folder / "tokenizer.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (
        tok.bos_id,
        tok.eos_id,
        1024,
    )
    if importlib.util.find_spec("transformers") is None:
        pytest.skip(NO_TRANSFORMERS)
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in SAMPLES:
        assert theirs(text, add_special_tokens=False).input_ids == tok.encode(text, bos=False, eos=False)
