"""Checking and loading new weights for a running model.

All weight paths (disk, broadcast and tensor handles) end in the same place: a dict of named tensors, checked against the
running model's state dict (every name known, every shape equal) before anything is copied, so a bad update
never leaves the model half-changed. The copy itself happens in the scheduler thread between steps.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
from pathlib import Path

import torch


class WeightUpdateError(ValueError):
    """A weight update was refused; the old weights keep serving. The message says why."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}; use a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


def check_names_and_shapes(model, shapes: dict[str, tuple[int, ...]], *, complete: bool) -> None:
    """Refuse unknown names, wrong shapes and (with ``complete``) missing tensors.

    A tensor counts as present when any name sharing its storage is given (tied embeddings are saved once).
    """
    state = model.state_dict()
    unknown = sorted(set(shapes) - set(state))
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise WeightUpdateError(f"unknown parameter names {unknown[:5]}{more}: not in the served model")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != tuple(shape):
            raise WeightUpdateError(
                f"shape mismatch for {name}: update has {list(shape)}, served model has {list(state[name].shape)}"
            )
    if complete:
        given = {state[n].data_ptr() for n in shapes}
        missing = sorted(n for n, t in state.items() if t.data_ptr() not in given)
        if missing:
            raise WeightUpdateError(f"incomplete checkpoint: missing {missing[:5]} ({len(missing)} tensors)")


def load_from_disk(model, model_path: str) -> dict[str, torch.Tensor]:
    """Read all safetensors of an HF model directory and check them against ``model``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(model_path)
    if not path.is_dir():
        raise WeightUpdateError(f"model_path {model_path!r} is not a directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {model_path!r}; save the model with save_pretrained")
    config_file = path / "config.json"
    if config_file.exists():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise WeightUpdateError(f"{config_file} is not valid JSON: {exc}") from exc
        served = model.config.model_type
        if config.get("model_type") not in (None, served):
            raise WeightUpdateError(f"model_type {config.get('model_type')!r} does not match the served {served!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise WeightUpdateError(f"cannot read {file}: {exc}") from exc
    check_names_and_shapes(model, {n: tuple(t.shape) for n, t in tensors.items()}, complete=True)
    return tensors


def parse_manifest(names, dtypes, shapes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The (name, dtype, shape) list of an /update_weights_from_distributed call."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise WeightUpdateError("names, dtypes and shapes must be lists")
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise WeightUpdateError(
            f"names, dtypes and shapes must be non-empty and of equal length (got {len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise WeightUpdateError(f"bad manifest entry {name!r}: {dtype!r} {shape!r}")
        out.append((name, _dtype(str(dtype)), tuple(shape)))
    return out


# ForkingPickler writes tensors as torch rebuild functions (CUDA IPC handles, or shared-memory file names for
# CPU tensors) plus a few containers; nothing else may be unpickled from the wire.
_SAFE_BUILTINS = {"list", "tuple", "dict", "set", "frozenset", "int", "float", "str", "bytes", "bool", "slice"}


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" or module.startswith("torch.") or (module == "builtins" and name in _SAFE_BUILTINS) \
                or (module, name) in {("collections", "OrderedDict"), ("copyreg", "_reconstructor")}:
            return super().find_class(module, name)
        raise WeightUpdateError(f"refused to unpickle {module}.{name}: the payload may hold only named torch tensors")


def unpickle_tensors(serialized_named_tensors: list[str]):
    """``serialized_named_tensors[0]`` (one tensor-parallel rank): base64 of a ``ForkingPickler`` dump holding
    torch tensors in plain containers (CUDA IPC handles, or shared-memory files for CPU tensors)."""
    if not serialized_named_tensors:
        raise WeightUpdateError("serialized_named_tensors is empty: send one base64 payload per tensor-parallel rank")
    try:
        raw = base64.b64decode(serialized_named_tensors[0], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WeightUpdateError(f"serialized_named_tensors[0] is not base64: {exc}") from exc
    try:
        return _TensorUnpickler(io.BytesIO(raw)).load()
    except WeightUpdateError:
        raise
    except Exception as exc:  # noqa: BLE001 - unpickling and rebuilding handles raise many kinds
        raise WeightUpdateError(f"cannot rebuild the tensors (same machine and GPU as the sender?): {exc!r}") from exc


def decode_named_tensors(model, serialized_named_tensors: list[str], load_format: str | None) -> dict[str, torch.Tensor]:
    """The payload of SGLang's ``/update_weights_from_tensor`` -> checked named tensors (not yet copied).

    ``serialized_named_tensors[0]`` (this engine has one tensor-parallel rank) is base64 of a ``ForkingPickler``
    dump of ``[(name, tensor), ...]``: CUDA tensors arrive as IPC handles into the sender's memory (same
    GPU), CPU tensors as shared-memory files. The sender keeps them alive until the reply.
    """
    if load_format not in (None, "direct"):
        raise WeightUpdateError(f"load_format {load_format!r} is not supported here; send null (a list of (name, tensor))")
    named = unpickle_tensors(serialized_named_tensors)
    if not isinstance(named, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in named):
        raise WeightUpdateError("the payload must be a list of (name, tensor) pairs")
    tensors = dict(named)
    check_names_and_shapes(model, {n: tuple(t.shape) for n, t in tensors.items()}, complete=False)
    return tensors
