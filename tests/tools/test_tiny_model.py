"""The tiny model is deterministic and has what vLLM and the chat API need."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbroker.tools.tiny_model import build_tiny_model, is_tiny_model_dir


def test_build_is_deterministic(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_model_dir / name).read_bytes() == (again / name).read_bytes(), name
    assert is_tiny_model_dir(again)


def test_other_seed_gives_other_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (tiny_model_dir / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_config_fits_vllm_cpu(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    head_size = config["hidden_size"] // config["num_attention_heads"]
    assert head_size >= 32  # smallest head size of vLLM's CPU attention
    assert config["max_position_embeddings"] >= 4096
    assert config["vocab_size"] == 512


def test_tokenizer_round_trip_and_chat_template(tiny_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "hello world, tell me about the cache block."
    ids = tok(text).input_ids
    assert 0 < len(ids) < len(text)  # merges were learned
    assert tok.decode(ids) == text
    messages = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    # Turn 2's prompt extends turn 1's prompt, so its KV blocks can be reused.
    turn2 = [*messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    assert tok.apply_chat_template(turn2, tokenize=False).startswith(prompt)


def test_rejects_head_size_vllm_cpu_cannot_serve(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head size"):
        build_tiny_model(tmp_path, hidden=64, heads=4)
