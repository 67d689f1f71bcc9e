"""LoRA adapters served on top of the base model, chosen per request, several in one batch.

Why hooks and not peft's layers: the served model keeps its module tree and state-dict names (full weight
updates, memory release and every check in ``engine.weights`` see the base model as before), and one
batch mixes rows of different adapters (and rows of the base model), which peft's one-active-adapter layers
do not do. Each adapted ``nn.Linear`` gets a forward hook; before every forward pass the scheduler says which
adapter each batch row uses (:meth:`AdapterSet.rows`), and the hook adds, for each adapter present, its
``scale * (x @ A.T) @ B.T`` to that adapter's rows only: the math of peft's ``lora.Linear`` (``lora_B(lora_A(x))
* scaling``), so the engine's logprobs equal the trainer's peft model's.

Adapters come in peft's layout (``adapter_config.json`` + ``adapter_model.safetensors``, keys
``base_model.model.<module>.lora_A.weight``), from disk or as tensors (SGLang 0.5.19's
``/load_lora_adapter_from_tensors``: a dict of those keys). Checked before anything changes: LoRA only (no
DoRA, no bias, no ``modules_to_save`` / embedding adapters), every key names a linear module of the served
model, ``A`` is ``(r, in)`` and ``B`` ``(out, r)``. The scale is ``lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``), per module with ``rank_pattern`` / ``alpha_pattern`` as peft resolves them.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.weights import WeightUpdateError

PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


@dataclass
class Adapter:
    """One loaded adapter: per module name, ``A (r, in)``, ``B (out, r)`` and the scale, on the model's device."""

    name: str
    path: str  # where it came from (``__tensor__`` for tensors, as SGLang's registry says)
    rank: int
    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b, _ in self.layers.values())


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's rank_pattern / alpha_pattern lookup: a key matches a module path that ends with it (whole parts)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def build_adapter(model: torch.nn.Module, name: str, path: str, config: dict[str, Any],
                  tensors: dict[str, torch.Tensor]) -> Adapter:
    """Check a peft LoRA adapter against the served ``model`` and put it on its device and dtype."""
    if not isinstance(config, dict):
        raise WeightUpdateError("the adapter config must be a JSON object (adapter_config.json)")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise WeightUpdateError(f"peft_type {config.get('peft_type')!r}: only LoRA adapters are served")
    if config.get("use_dora"):
        raise WeightUpdateError("DoRA adapters (use_dora) are not served; train a plain LoRA adapter")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise WeightUpdateError("adapters with bias terms are not served (bias must be 'none')")
    if config.get("modules_to_save") or config.get("trainable_token_indices"):
        raise WeightUpdateError("adapters with modules_to_save or trainable tokens are not served: LoRA weights only")
    if config.get("fan_in_fan_out"):
        raise WeightUpdateError("fan_in_fan_out adapters (Conv1D layouts) are not served")
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightUpdateError(f"the adapter config needs an integer r and a numeric lora_alpha: {exc}") from exc
    modules = dict(model.named_modules())
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.match(key[len(PREFIX):] if key.startswith(PREFIX) else "")
        if match is None:
            raise WeightUpdateError(f"tensor {key!r} is not a LoRA weight in peft's layout "
                                    f"({PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise WeightUpdateError("the adapter has no tensors")
    param = next(model.parameters())
    adapter = Adapter(name, path, rank)
    for module, ab in sorted(parts.items()):
        target = modules.get(module)
        if not isinstance(target, torch.nn.Linear):
            raise WeightUpdateError(f"the adapter adapts {module!r}, which is not a linear layer of the served model")
        if set(ab) != {"A", "B"}:
            raise WeightUpdateError(f"{module}: the adapter has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, target.in_features) \
                or tuple(b.shape) != (target.out_features, r):
            raise WeightUpdateError(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit a "
                                    f"linear layer of {target.in_features} -> {target.out_features}")
        expected = int(_pattern_value(config.get("rank_pattern"), module, rank))
        if r != expected:
            raise WeightUpdateError(f"{module}: rank {r} in the tensors, {expected} in the adapter config")
        module_alpha = float(_pattern_value(config.get("alpha_pattern"), module, alpha))
        scale = module_alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        # copies, always: tensors from /load_lora_adapter_from_tensors may be CUDA IPC views of the trainer's
        # memory, which it frees once the engine has answered
        adapter.layers[module] = (a.to(device=param.device, dtype=param.dtype, copy=True).contiguous(),
                                  b.to(device=param.device, dtype=param.dtype, copy=True).contiguous(), scale)
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()  # the copies are done before the answer lets the sender reuse its memory
    return adapter


def read_adapter_dir(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` of a peft adapter directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise WeightUpdateError(f"lora_path {path!r} is not a directory")
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise WeightUpdateError(f"{path} is not a peft adapter directory: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise WeightUpdateError(f"{config_file} is not valid JSON: {exc}") from exc
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as exc:
        raise WeightUpdateError(f"cannot read {weights_file}: {exc}") from exc
    return config, tensors


class AdapterSet:
    """The adapters a model serves, by name, and the hooks that apply them to the rows that ask."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded: dict[str, Adapter] = {}
        self._modules = dict(model.named_modules())
        self._hooked: set[str] = set()
        self._groups: list[tuple[Adapter, torch.Tensor]] = []  # during one forward pass: adapter, its rows
        self.default: str | None = None  # --default-lora: serves the rows that name no adapter, once loaded

    def add(self, adapter: Adapter) -> None:
        """Serve ``adapter`` under its name (the scheduler calls this between steps)."""
        for module in adapter.layers:
            if module not in self._hooked:
                self._modules[module].register_forward_hook(self._make_hook(module))
                self._hooked.add(module)
        self.loaded[adapter.name] = adapter

    def remove(self, name: str) -> Adapter:
        return self.loaded.pop(name)

    def paths(self) -> dict[str, str]:
        """Name -> where it came from; safe from the HTTP thread (``dict()`` copies in one step under the GIL while
        the scheduler thread may be adding or removing one)."""
        return {name: a.path for name, a in dict(self.loaded).items()}

    @contextlib.contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """Run one forward pass with row ``i`` under adapter ``names[i]``. Every name must be loaded (the
        scheduler drops requests whose adapter is gone first). None: :attr:`default` if it is loaded, else the
        base model; resolved at every forward pass, so a request that arrived while a push had the default
        adapter unloaded is still served with the new one (pushes happen while nothing runs, or paused)."""
        fallback = self.default if self.default in self.loaded else None
        names = [name or fallback for name in names]
        if not any(names):
            yield
            return
        device = next(self.model.parameters()).device
        groups: dict[str, list[int]] = {}
        for row, name in enumerate(names):
            if name:
                groups.setdefault(name, []).append(row)
        self._groups = [(self.loaded[n], torch.tensor(idx, dtype=torch.long, device=device)) for n, idx in groups.items()]
        try:
            yield
        finally:
            self._groups = []

    def _make_hook(self, module: str):
        def hook(_mod: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if not self._groups:
                return None
            x = args[0]
            for adapter, index in self._groups:
                layer = adapter.layers.get(module)
                if layer is None:
                    continue
                a, b, scale = layer
                if len(index) == x.shape[0]:  # every row under this adapter: no gather
                    output = output + (x @ a.t()) @ b.t() * scale
                else:
                    delta = (x.index_select(0, index) @ a.t()) @ b.t() * scale
                    output = output.index_add(0, index, delta.to(output.dtype))
            return output
        return hook
