"""A tiny random-weight Llama model and tokenizer, built offline in seconds.

Tests, the demo and the benchmarks need a model that real vLLM can serve on a
CPU without downloading anything. This module writes one: a 2-layer Llama with
random weights (transformers `LlamaForCausalLM`, saved as config.json +
safetensors) and a byte-level BPE tokenizer trained with the `tokenizers`
library on a generated corpus, with a chat template so
`/v1/chat/completions` works.

Everything is deterministic from `seed`: two builds with the same arguments
produce byte-identical weights and the same tokenizer, so engines built from
separate directories still agree on token ids and block hashes.

CLI: `python -m kvbroker.tools.tiny_model OUT_DIR [--layers N] [--seed S] ...`
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# Special tokens of the chat format. Ids are assigned first, in this order.
BOS = "<s>"
EOS = "</s>"
UNK = "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (BOS, EOS, UNK, *ROLE_TOKENS, END_OF_TURN)

# The chat format: each message is "<|role|>\ncontent<|end|>\n"; the generation
# prompt opens an assistant turn. No BOS, so a chat prompt is a plain prefix of
# the next turn's prompt (turn 2 can reuse turn 1's KV blocks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Words for the generated training corpus; the tokenizer learns merges for them,
# so ordinary English prompts tokenize into a sensible number of tokens.
_CORPUS_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "be",
    "this",
    "are",
    "from",
    "or",
    "have",
    "not",
    "what",
    "which",
    "who",
    "when",
    "where",
    "why",
    "how",
    "can",
    "will",
    "would",
    "should",
    "could",
    "do",
    "does",
    "did",
    "has",
    "had",
    "cache",
    "block",
    "token",
    "prompt",
    "model",
    "engine",
    "broker",
    "lease",
    "prefill",
    "decode",
    "transfer",
    "memory",
    "turn",
    "chat",
    "question",
    "answer",
    "hello",
    "world",
    "tell",
    "me",
    "about",
    "story",
    "tiny",
    "random",
    "fast",
    "slow",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "first",
    "second",
    "next",
    "last",
    "time",
    "day",
    "user",
    "assistant",
    "system",
    "please",
    "thanks",
    "yes",
    "no",
    "more",
    "less",
    "many",
    "few",
    "big",
    "small",
    "long",
    "short",
]


def _training_corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    corpus = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        corpus.append(" ".join(rng.choice(_CORPUS_WORDS) for _ in range(n)))
    # Digits and punctuation, so they get their own merges too.
    corpus.extend(f"{i}, {i * 7}. {i}? {i}!" for i in range(100))
    return corpus


def _build_tokenizer(vocab_size: int, seed: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed), trainer=trainer)
    return tok


def build_tiny_model(
    out_dir: str | Path,
    *,
    num_layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    max_position_embeddings: int = 8192,
    seed: int = 0,
) -> Path:
    """Write the tiny model to `out_dir` (created if needed) and return its path.

    The defaults give head_size = hidden / heads = 32, the smallest head size
    vLLM's CPU attention backend supports. The tokenizer's vocabulary is the
    byte alphabet plus learned merges up to `vocab` entries; the model's
    embedding table has exactly `vocab` rows.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % heads != 0 or heads % kv_heads != 0:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}), heads by kv_heads ({kv_heads})")
    if hidden // heads < 32:
        raise ValueError(f"head size {hidden // heads} < 32: vLLM's CPU attention needs at least 32")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(vocab, seed)
    vocab_size = max(vocab, tokenizer.get_vocab_size())
    bos_id = tokenizer.token_to_id(BOS)
    eos_id = tokenizer.token_to_id(EOS)

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    # Larger-than-default init spreads the logits, so greedy decoding does not
    # collapse onto one token and outputs of different prompts differ.
    config.initializer_range = 0.2
    model = LlamaForCausalLM(config)  # float32: torch's default dtype
    model.eval()
    model.save_pretrained(out, safe_serialization=True)

    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return out


def is_tiny_model_dir(path: str | Path) -> bool:
    """True when `path` already holds a complete model (config, weights, tokenizer)."""
    p = Path(path)
    return all((p / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbroker.tools.tiny_model",
        description="Build a tiny random-weight Llama model and tokenizer for vLLM, offline.",
    )
    parser.add_argument("out_dir", help="directory to write config.json, model.safetensors, tokenizer files")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    parser.add_argument(
        "--heads", type=int, default=4, help="attention heads (default 4; head size = hidden/heads)"
    )
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for weights and tokenizer corpus (default 0)"
    )
    args = parser.parse_args(argv)
    out = build_tiny_model(
        args.out_dir,
        num_layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        seed=args.seed,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
