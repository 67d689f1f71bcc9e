"""docker-compose.yml's SGLang command line, parsed by the argument parser of each SGLang release the suite
installs (the pinned one and the newest), in a process of its own with only that wheel on the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.deploy.compose_file import REPO, argv, compose
from tests.sglang.own_code import VERSIONS, sglang_root


def compose_sglang_args() -> list[str]:
    args = argv(compose()["services"]["sglang"])
    assert args[:3] == ["python3", "-m", "sglang.launch_server"], args
    return args[3:]


# the check can fail: a flag 0.5.23 removed (its old streaming flag) is refused there, accepted by 0.5.19
OLD_FLAG = ["--model-path", "/m", "--stream-output"]


@pytest.fixture(scope="module")
def parsed() -> dict[str, list[dict]]:
    """Each release's answers for (compose's command, OLD_FLAG), the releases' processes run side by side."""
    procs = {}
    for version in VERSIONS:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sglang_root(version).parent), str(REPO)])}
        procs[version] = subprocess.Popen(
            [sys.executable, "-m", "tests.sglang.server_args", json.dumps(compose_sglang_args()), json.dumps(OLD_FLAG)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    answers = {}
    for version, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"SGLang {version}: {err[-3000:]}"
        answers[version] = [json.loads(line) for line in out.splitlines()]
    return answers


@pytest.mark.parametrize("version", VERSIONS)
def test_each_release_parses_the_compose_command_as_the_gateway_needs_it(version, parsed):
    compose_line, old_flag = parsed[version]
    assert compose_line["ok"], f"SGLang {version} refuses docker-compose.yml's command: {compose_line['error']}"
    parsed = compose_line["args"]
    assert str(parsed["weight_version"]) == "0"  # the gateway's integer versions start at 0
    assert parsed["enable_deterministic_inference"] is True  # the OpenAI `seed` is read only in this mode
    assert parsed["enable_metrics"] is True
    assert parsed["port"] == 30000
    assert not parsed.get("skip_tokenizer_init"), "stop strings and text need SGLang's detokenizer"
    assert not parsed.get("incremental_streaming_output"), "the engine client reads cumulative streams"
    if version == "0.5.19":
        assert old_flag["ok"]
    else:
        assert not old_flag["ok"] and "--stream-output" in old_flag["error"]
