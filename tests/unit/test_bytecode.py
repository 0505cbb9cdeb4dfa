"""titanrush/bytecode.py: bytecode under titanrush's folder where the installed package has none usable."""

from __future__ import annotations

import importlib
import os
import py_compile
import sys

import pytest

from titanrush import bytecode


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package with no bytecode, importable, Python told not to write bytecode (as on the GPU machines)."""
    src = tmp_path / "src" / "nobytecode_pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "")  # (recorded, so that enable()'s setting is undone)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    monkeypatch.delitem(sys.modules, "nobytecode_pkg", raising=False)
    importlib.invalidate_caches()
    return src


def test_without_usable_bytecode_it_is_kept_in_the_folder(package, tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(bytecode.VARIABLE, str(folder))
    assert not bytecode.installed_bytecode_usable("nobytecode_pkg")
    assert bytecode.enable("nobytecode_pkg") == folder
    assert sys.pycache_prefix == str(folder) and not sys.dont_write_bytecode
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(folder) and "PYTHONDONTWRITEBYTECODE" not in os.environ
    assert importlib.import_module("nobytecode_pkg").VALUE == 42
    assert list(folder.rglob("__init__*.pyc")), "the import wrote no bytecode under the folder"
    assert not (package / "__pycache__").exists()  # nothing beside the package's sources


def test_current_installed_bytecode_or_a_users_choice_leaves_python_alone(package, tmp_path, monkeypatch):
    monkeypatch.setenv(bytecode.VARIABLE, str(tmp_path / "cache"))
    py_compile.compile(str(package / "__init__.py"), doraise=True)  # a current .pyc beside the source
    assert bytecode.installed_bytecode_usable("nobytecode_pkg")
    assert bytecode.enable("nobytecode_pkg") is None and sys.pycache_prefix is None
    (package / "__init__.py").write_text("VALUE = 43  # changed since\n")
    assert not bytecode.installed_bytecode_usable("nobytecode_pkg")
    monkeypatch.setenv(bytecode.VARIABLE, "off")
    assert bytecode.enable("nobytecode_pkg") is None and sys.pycache_prefix is None
    monkeypatch.setenv(bytecode.VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "users"))  # PYTHONPYCACHEPREFIX's choice
    assert bytecode.enable("nobytecode_pkg") is None and sys.pycache_prefix == str(tmp_path / "users")
    assert not (tmp_path / "cache").exists()


def test_an_unusable_folder_is_warned_of_and_python_left_alone(package, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(bytecode.VARIABLE, str(blocker / "pycache"))  # (a folder inside a file)
    assert bytecode.enable("nobytecode_pkg") is None and sys.pycache_prefix is None
    err = capsys.readouterr().err
    assert "no bytecode folder" in err and bytecode.VARIABLE in err
