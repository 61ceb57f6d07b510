"""util/: the replace-a-directory rule (checkpoint saves, exports and prepared datasets use it)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from util import replace_dir


def _tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): p.read_text() for p in d.rglob("*") if p.is_file()}


def _make(d: Path, **files: str) -> Path:
    d.mkdir()
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_replace_dir_puts_new_in_place_and_leaves_no_aside(tmp_path: Path) -> None:
    dest = _make(tmp_path / "out", a="old", stale="x")
    replace_dir(_make(tmp_path / ".out.tmp", a="new"), dest)
    assert _tree(dest) == {"a": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    replace_dir(_make(tmp_path / ".fresh.tmp", b="1"), tmp_path / "fresh")  # no dest yet
    assert _tree(tmp_path / "fresh") == {"b": "1"}


def test_replace_dir_keeps_the_old_directory_when_the_move_fails(tmp_path: Path, monkeypatch) -> None:
    dest = _make(tmp_path / "out", a="old")
    src = _make(tmp_path / ".out.tmp", a="new")
    real = os.replace

    def failing(a, b):
        if Path(a) == src:
            raise OSError("disk gone")
        return real(a, b)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="disk gone"):
        replace_dir(src, dest)
    assert _tree(dest) == {"a": "old"}  # the old one is back in place, the new one untouched
    assert _tree(src) == {"a": "new"}


def test_replace_dir_uses_the_given_aside_name(tmp_path: Path, monkeypatch) -> None:
    dest = _make(tmp_path / "out", a="old")
    seen = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (seen.append(Path(b).name), real(a, b)))
    replace_dir(_make(tmp_path / "new", a="new"), dest, aside=tmp_path / ".old_out")
    assert seen == [".old_out", "out"]
    assert not (tmp_path / ".old_out").exists()
