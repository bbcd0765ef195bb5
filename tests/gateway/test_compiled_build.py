"""gateway.compiled: a compiled build is used only while it matches its sources, and cleaning it restores
them. (The build itself, mypyc over the hot path, is exercised by the suite run against it: see the
README's "Compiled hot path".)"""

from __future__ import annotations

import json
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from gateway import compiled
from gateway.user_errors import UserError

SOURCE = "gateway/service.py"


def tree(tmp_path: Path, *, built: bool, manifest: bool = True) -> Path:
    """A source tree with the hot modules' sources, and optionally one compiled module and its manifest."""
    for source in compiled.HOT_MODULES:
        path = tmp_path / source
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {source}\n")
    if built:
        (tmp_path / SOURCE).with_suffix(EXTENSION_SUFFIXES[0]).write_bytes(b"\x7fELF")
        (tmp_path / f"abc__mypyc{EXTENSION_SUFFIXES[0]}").write_bytes(b"\x7fELF")
        if manifest:
            sources = {s: compiled.digest(tmp_path / s) for s in compiled.HOT_MODULES}
            (tmp_path / compiled.MANIFEST_NAME).write_text(json.dumps({"sources": sources}))
    return tmp_path


def test_pure_sources_are_never_stale(tmp_path: Path) -> None:
    root = tree(tmp_path, built=False)
    assert not compiled.in_use(root) and compiled.stale_modules(root) == []
    compiled.check_fresh(root)


def test_a_build_that_matches_its_sources_is_fresh(tmp_path: Path) -> None:
    root = tree(tmp_path, built=True)
    assert compiled.in_use(root) and compiled.stale_modules(root) == []
    compiled.check_fresh(root)


def test_a_source_edited_after_the_build_makes_it_stale(tmp_path: Path) -> None:
    root = tree(tmp_path, built=True)
    (root / SOURCE).write_text("# edited\n")
    assert compiled.stale_modules(root) == [SOURCE]
    with pytest.raises(UserError, match=r"gateway/service\.py changed"):
        compiled.check_fresh(root)


def test_extension_modules_without_a_manifest_are_stale(tmp_path: Path) -> None:
    root = tree(tmp_path, built=True, manifest=False)
    assert compiled.stale_modules(root) == [SOURCE]


def test_clean_removes_the_build_and_the_sources_stay(tmp_path: Path) -> None:
    root = tree(tmp_path, built=True)
    assert compiled.clean(root) == 2
    assert not compiled.in_use(root) and not (root / compiled.MANIFEST_NAME).exists()
    assert not list(root.glob("*__mypyc*")) and (root / SOURCE).read_text() == f"# {SOURCE}\n"


def test_a_tree_it_cannot_write_gets_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """(Where its manifest cannot be removed: here a directory in its place, since the tests may run as
    root, for whom file modes forbid nothing.)"""
    root = tree(tmp_path, built=True, manifest=False)
    (root / compiled.MANIFEST_NAME).mkdir()
    monkeypatch.setattr(compiled, "ROOT", root)
    assert compiled.main(["clean"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gateway.compiled: cannot clean the tree at ") and err.count("\n") == 1


def test_every_hot_module_exists_and_is_this_trees() -> None:
    missing = [s for s in compiled.HOT_MODULES if not (compiled.ROOT / s).is_file()]
    assert missing == []


def test_kvgate_serve_refuses_a_stale_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main

    root = tree(tmp_path / "tree", built=True)
    (root / SOURCE).write_text("# edited\n")
    monkeypatch.setattr(compiled, "ROOT", root)
    config = tmp_path / "kvgate.toml"
    config.write_text('region = "r"\n[[regions]]\nname = "r"\nengines = []\n')
    assert main(["serve", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "the compiled build is stale: gateway/service.py changed" in err and "gateway.compiled" in err
