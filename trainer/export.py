"""`agentrl export-model`: a trainer checkpoint as something to serve or share, without the trainer's state.

    agentrl export-model --checkpoint runs/trainer/step_000040 --out my-adapter            # peft adapter
    agentrl export-model --checkpoint runs/trainer/step_000040 --out my-model --merge      # merged HF model

A LoRA checkpoint holds only the adapter (peft's layout): exported as is it loads with
``PeftModel.from_pretrained``, vLLM's ``--lora-modules`` / ``/v1/load_lora_adapter`` and SGLang's
``--lora-paths`` / ``/load_lora_adapter``; ``--merge`` folds it into the base weights
(``W + alpha / r * B A``) and writes a plain Hugging Face model directory that any engine or
``agentrl eval --checkpoint`` serves without LoRA support. A full fine-tuning checkpoint is already a
Hugging Face directory: it is copied without the optimizer and trainer state.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from trainer import lora

TRAINER_ONLY = {"optimizer", "trainer_state.json"}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("export-model", help="a trainer checkpoint as a peft adapter or a (merged) HF model",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory (runs/.../step_NNNNNN)")
    parser.add_argument("--out", required=True, help="directory to write (created; must not hold files)")
    parser.add_argument("--merge", action="store_true", help="LoRA checkpoints: write base + adapter as one HF model")
    parser.add_argument("--model", default="", help="the base model (smollm2, tiny or a directory); default: the "
                                                    "adapter's base_model_name_or_path")
    parser.add_argument("--dtype", default="", choices=["", "float32", "bfloat16", "float16"],
                        help="--merge: the merged weights' dtype (default: the one the base model declares)")


def run(args: argparse.Namespace) -> int:
    try:
        out = export(args.checkpoint, args.out, merge=args.merge, model=args.model, dtype=args.dtype or None)
    except (ValueError, OSError) as exc:
        print(f"agentrl export-model: {exc}", file=sys.stderr)
        return 2
    print(f"agentrl export-model: wrote {out}", file=sys.stderr)
    return 0


def export(checkpoint: str | Path, out: str | Path, *, merge: bool = False, model: str = "",
           dtype: str | None = None) -> Path:
    from engine.models import resolve_model

    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_dir():
        raise ValueError(f"--checkpoint {checkpoint} is not a directory")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty; give a new directory")
    adapter = lora.is_adapter_dir(checkpoint)
    if not adapter and merge:
        raise ValueError(f"{checkpoint} holds full weights (no adapter_config.json): there is nothing to merge; "
                         "export it without --merge")
    if not adapter and not (checkpoint / "config.json").is_file():
        raise ValueError(f"{checkpoint} is neither a LoRA checkpoint nor a Hugging Face model directory")
    if adapter:
        config = json.loads((checkpoint / lora.CONFIG_FILE).read_text())
        base = resolve_model(model) if model else Path(config.get("base_model_name_or_path") or "")
        if not (base / "config.json").is_file():
            raise ValueError(f"the adapter's base model {str(base)!r} is not a model directory here: give --model")
        if merge:
            return lora.merge(checkpoint, base, out, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.name in TRAINER_ONLY:
            continue
        (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
    if adapter:  # the base it was trained on, as a path that resolves here
        config["base_model_name_or_path"] = str(base)
        (out / lora.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    return out
