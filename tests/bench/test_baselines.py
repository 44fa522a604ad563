"""The one NixlConnector baseline (bench.harness.baselines): every benchmark's "NixlConnector"
engine is built by nixl_engine(), so its command line and environment are checked here once,
without starting vLLM."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.harness.baselines import NIXL_BASELINE, nixl_engine
from testkit.processes import REPO_ROOT


def _config(cmd: list[str]) -> dict[str, object]:
    return dict(json.loads(cmd[cmd.index("--kv-transfer-config") + 1]))


def test_the_baseline_engine(tmp_path: Path) -> None:
    engine = nixl_engine(tmp_path / "model", tmp_path, "P-nixl", max_model_len=1024)
    cmd = engine.command()
    assert _config(cmd) == {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "bench.harness.nixl_quiet",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "engine_id": "P-nixl",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
    }
    assert "--disable-log-stats" not in cmd  # NixlConnector reports transfers only in the stats lines
    assert cmd[cmd.index("--block-size") + 1] == "32"
    assert cmd[cmd.index("--max-model-len") + 1] == "1024"
    assert engine.log_path == tmp_path / "P-nixl.log"
    env = engine.env
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_LOG_STATS_INTERVAL"] == "2"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)  # vLLM imports nixl_quiet from the tree
    # Each engine of a pair gets a side channel of its own.
    other = nixl_engine(tmp_path / "model", tmp_path, "D-nixl")
    assert other.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    for word in ("kv_both", "cpu", "bidirectional_kv_xfer on", "nixl_quiet"):
        assert word in NIXL_BASELINE


def test_the_connector_module_is_importable_by_its_configured_path() -> None:
    """vLLM loads `kv_connector_module_path` by name: the room move must not have broken it."""
    import importlib.util

    assert importlib.util.find_spec("bench.harness.nixl_quiet") is not None
