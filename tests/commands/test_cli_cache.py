"""``kvpool cache`` lists and clears what kvpool stored, and the suite never stores anything
in the user's own cache directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvpool.cli import main
from kvpool.engine.models import cache_dir


def fake_cache(folder: Path) -> None:
    model = folder / "models" / "smollm2-135m-instruct.q4_1-0123456789abcdef"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"x" * 3000)
    (model / "config.json").write_text("{}")
    (folder / "models" / ".smollm2-half-written").mkdir()


def test_list_then_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))
    fake_cache(tmp_path)
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "models/smollm2-135m-instruct.q4_1-0123456789abcdef" in out
    assert "(unfinished conversion)" in out and "in all" in out
    assert "2.93 KiB" in out  # 3,002 bytes
    assert main(["cache", "clear"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert list((tmp_path / "models").iterdir()) == []
    assert main(["cache", "list"]) == 0
    assert "holds nothing" in capsys.readouterr().out


def test_a_bad_action_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["cache", "wipe"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_the_suite_caches_outside_the_users_cache() -> None:
    """tests/conftest.py points KVPOOL_CACHE_DIR at a directory of the suite's own, which
    every process a test starts inherits."""
    here = cache_dir().resolve()
    assert os.environ["KVPOOL_CACHE_DIR"]
    assert not here.is_relative_to((Path.home() / ".cache" / "kvpool").resolve())
