"""SGLang's own code, loaded file by file from each release's wheel, for contract tests.

Two wheels are installed with ``--no-deps``, each into its own folder of the venv (``make test`` does it):
``sglang==0.5.19`` (the release ``docker-compose.yml`` pins) and ``sglang==0.5.23`` (the newest). Every
accessor takes the ``version`` (default: the pinned one). Both releases' files live under the same module
names (``sglang.srt...``), so one release's modules are in ``sys.modules`` at a time: each accessor first
makes its release the active one (:func:`_activate` swaps the two sets), which is what pydantic and msgspec
see when they resolve the request classes' annotations. Of the wheels' dependencies only ``msgspec`` and
``pyzmq`` are needed (``io_struct.py`` imports them). Importing ``sglang.srt`` the normal
way would pull CUDA-only packages (``triton``, ``torchvision``, ``sgl-kernel``), so the few files the
contracts need are executed in isolation:

* ``sampling/sampling_params.py`` and ``weight_sync/tensor_bucket.py`` import nothing heavy: loaded as they are.
* ``managers/io_struct.py`` (the request classes: ``GenerateReqInput``, ``UpdateWeightsFromDistributedReqInput``,
  ...) is executed as is, with every other ``sglang.*`` module it imports replaced by a placeholder whose
  attributes are inert classes (only its type annotations and a few helpers refer to them; the request
  classes the gateway and trainer use are plain dataclasses / msgspec structs of builtin types), except
  ``utils/msgspec_utils.py``, ``utils/field_validators.py`` and ``sampling_params.py``, which are loaded for
  real because the request classes use them to validate.
* ``init_custom_process_group`` lives in ``utils/common.py``, whose imports need CUDA packages: the function's
  own source is cut out of that file (``ast``) and executed with the two module globals it reads (``torch``,
  ``torch_release``).

Placeholders are removed from ``sys.modules`` once a file is loaded, so nothing else sees them; the real
files stay there under their own names (pydantic resolves their annotations through ``sys.modules``).
"""

from __future__ import annotations

import ast
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import pytest

PINNED = "0.5.19"
NEWEST = "0.5.23"
VERSIONS = (PINNED, NEWEST)


def sglang_root(version: str = PINNED) -> Path:
    """``sglang/`` of one release's wheel, installed apart from the venv's packages (its declared dependencies
    pin other transformers/tokenizers versions, so it must not be seen by pip's resolver or by imports):
    ``pip install --no-deps --target $VENV/sglang-X sglang==X``."""
    root = Path(sys.prefix) / f"sglang-{version}" / "sglang"
    if not (root / "srt" / "managers" / "io_struct.py").is_file():
        pytest.fail(f"SGLang {version} is not at {root.parent}: pip install --no-deps --target {root.parent} "
                    f"sglang=={version} (make test does)")
    return root


_modules: dict[str, dict[str, types.ModuleType]] = {}  # release -> its real sglang.* modules loaded so far
_active: list[str] = []  # the release whose modules are in sys.modules now


def _is_sglang(name: str) -> bool:
    return name == "sglang" or name.startswith("sglang.")


def _activate(version: str) -> None:
    """Put ``version``'s loaded modules into ``sys.modules`` (and the other release's out)."""
    if _active and _active[0] == version:
        return
    current = {k: sys.modules.pop(k) for k in [k for k in sys.modules if _is_sglang(k)]}
    if _active:
        _modules.setdefault(_active[0], {}).update(current)
    sys.modules.update(_modules.get(version, {}))
    _active[:] = [version]


def _versioned(fn: Any) -> Any:
    """Cache ``fn`` per release and make that release the active one on every call."""
    cached = cache(fn)

    @functools.wraps(fn)
    def call(version: str = PINNED) -> Any:
        _activate(version)
        return cached(version)
    return call


class _Inert(type(msgspec.Struct)):  # type: ignore[misc]
    """Placeholder classes: tagged msgspec structs (io_struct builds a msgpack decoder over every request
    struct at import, which resolves their field types); any attribute is another placeholder."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


def _any_schema(cls: Any, source: Any, handler: Any) -> Any:
    from pydantic_core import core_schema

    return core_schema.any_schema()


def _placeholder(name: str) -> Any:
    # pydantic (FastAPI's body validation in SGLang) accepts anything where a placeholder type is annotated
    return _Inert(name, (msgspec.Struct,), {"__get_pydantic_core_schema__": classmethod(_any_schema)}, tag=True)


class _Placeholder(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Real files for ``real`` module names, placeholders for every other ``sglang`` module."""

    def __init__(self, root: Path, real: dict[str, str]) -> None:
        self.root, self.real = root, real

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "sglang" and not name.startswith("sglang."):
            return None
        if name in self.real:
            return importlib.util.spec_from_file_location(name, self.root.parent / self.real[name])
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Placeholder(spec.name)
        module.__path__ = []  # a package, so that submodules resolve through this finder
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _load(module: str, real: dict[str, str], version: str = PINNED) -> types.ModuleType:
    _activate(version)
    root = sglang_root(version)
    finder = _Finder(root, {**real, module: real[module]})
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module(module)
    finally:
        sys.meta_path.remove(finder)
        for name in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            if name not in saved and isinstance(sys.modules[name], _Placeholder):
                del sys.modules[name]  # real files stay: pydantic resolves annotations in their module


_MSGSPEC = {"sglang.srt.utils.msgspec_utils": "sglang/srt/utils/msgspec_utils.py",
            "sglang.srt.utils.field_validators": "sglang/srt/utils/field_validators.py",
            "sglang.srt.sampling.sampling_params": "sglang/srt/sampling/sampling_params.py",
            # 0.5.23: SamplingParams normalizes its watermark request (absent from 0.5.19, never imported there)
            **{f"sglang.srt.sampling.watermarking.{name}": f"sglang/srt/sampling/watermarking/{name}.py"
               for name in ("core", "config", "detector")}}


@_versioned
def io_struct(version: str) -> types.ModuleType:
    return _load("sglang.srt.managers.io_struct", {"sglang.srt.managers.io_struct": "sglang/srt/managers/io_struct.py",
                                                   **_MSGSPEC}, version)


@_versioned
def sampling_params(version: str) -> types.ModuleType:
    return _load("sglang.srt.sampling.sampling_params", _MSGSPEC, version)


@_versioned
def constants(version: str) -> types.ModuleType:
    """``srt/constants.py``: the memory tags (``GPU_MEMORY_ALL_TYPES``) of release/resume_memory_occupation."""
    return _load("sglang.srt.constants", {"sglang.srt.constants": "sglang/srt/constants.py"}, version)


@_versioned
def tensor_bucket(version: str) -> types.ModuleType:
    return _load("sglang.srt.weight_sync.tensor_bucket",
                 {"sglang.srt.weight_sync.tensor_bucket": "sglang/srt/weight_sync/tensor_bucket.py"}, version)


def cut(relpath: str, qualname: str, namespace: dict[str, Any], version: str = PINNED) -> Any:
    """The class or function (``name``) or method (``Class.name``, then taking ``self`` explicitly)
    ``qualname`` of SGLang's file ``relpath``, cut out with ``ast`` and executed in ``namespace`` (its module
    globals)."""
    path = sglang_root(version) / relpath
    tree = ast.parse(path.read_text())
    *owner, name = qualname.split(".")
    body = tree.body
    for cls in owner:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    if isinstance(node, ast.FunctionDef):  # decorators and annotations name what the namespace need not hold
        node.decorator_list = []
        node.returns = None
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            arg.annotation = None
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


@_versioned
def init_custom_process_group_fn(version: str) -> Any:
    """``sglang.srt.utils.common.init_custom_process_group`` (its file imports CUDA packages; the function
    reads two module globals, ``torch`` and ``torch_release``)."""
    import torch
    from packaging import version as pkg_version

    return cut("srt/utils/common.py", "init_custom_process_group",
               {"torch": torch, "torch_release": pkg_version.parse(torch.__version__).release}, version)


@_versioned
def network(version: str) -> types.ModuleType:
    return _load("sglang.srt.utils.network", {"sglang.srt.utils.network": "sglang/srt/utils/network.py"}, version)


@_versioned
def serializer(version: str) -> Any:
    """``MultiprocessingSerializer`` of ``utils/common.py`` (with its ``SafeUnpickler``, the allow-list every
    tensor payload passes): how each TP rank opens its ``serialized_named_tensors`` entry."""
    import base64
    import io
    import pickle

    import torch

    namespace: dict[str, Any] = {"io": io, "pickle": pickle, "torch": torch, "pybase64": base64}
    from multiprocessing.reduction import ForkingPickler

    namespace["ForkingPickler"] = ForkingPickler
    source = (sglang_root(version) / "srt/utils/common.py").read_text()
    if "def _safe_load_torch_storage" in source:
        cut("srt/utils/common.py", "_safe_load_torch_storage", namespace, version)
    cut("srt/utils/common.py", "SafeUnpickler", namespace, version)
    return cut("srt/utils/common.py", "MultiprocessingSerializer", namespace, version)


@_versioned
def weight_updater_methods(version: str) -> dict[str, Any]:
    """The receiving side of SGLang's weight sync, ``WeightUpdater`` methods of
    ``model_executor/model_runner_components/weight_updater.py``: ``init_weights_update_group``,
    ``update_weights_from_distributed`` (with ``_update_bucketed_weights_from_distributed``) and
    ``destroy_weights_update_group``. Their module imports the model loader (CUDA), so they run with the
    globals they use; the guard against an active CUDA-IPC weight cache is a no-op here."""
    import logging

    import torch

    namespace: dict[str, Any] = {
        "torch": torch, "logger": logging.getLogger("sglang.weight_updater"), "Optional": Any,
        "init_custom_process_group": init_custom_process_group_fn(version),
        "NetworkAddress": network(version).NetworkAddress,
        "FlattenedTensorBucket": tensor_bucket(version).FlattenedTensorBucket,
        "_unsupported_derived_weight_cache_error": lambda *model: None,
        # 0.5.23's tensor path: the CUDA-IPC reduction patch has nothing to patch for CPU tensors, and the
        # rank comes from SGLang's parallel state (the caller sets ``get_parallel``)
        "monkey_patch_torch_reductions": lambda: None, "get_parallel": None,
    }
    where = "srt/model_executor/model_runner_components/weight_updater.py"
    names = (("init_weights_update_group", "update_weights_from_distributed",
              "_update_bucketed_weights_from_distributed", "update_weights_from_tensor",
              "destroy_weights_update_group") if version == PINNED else
             ("init_weights_update_group", "receive_weights_from_distributed",
              "_receive_bucketed_weights_from_distributed", "load_weights_from_distributed",
              "update_weights_from_tensor", "begin_weight_update", "end_weight_update",
              "destroy_weights_update_group"))
    _activate(version)
    methods = {name: cut(where, f"WeightUpdater.{name}", namespace, version) for name in names}
    namespace["LocalSerializedTensor"] = cut(where, "LocalSerializedTensor",
                                             {"dataclass": __import__("dataclasses").dataclass, "List": list,
                                              "MultiprocessingSerializer": serializer(version)}, version)
    cut(where, "_unwrap_tensor", namespace, version)
    # how each TP rank opens its own ``serialized_named_tensors`` entry (``managers/tp_worker.py``)
    worker = {"monkey_patch_torch_reductions": lambda: None, "MultiprocessingSerializer": serializer(version),
              "get_parallel": None}
    methods["deserialize_own_rank"] = cut("srt/managers/tp_worker.py", "BaseTpWorker._deserialize_own_rank"
                                          if version == PINNED else "BaseTpWorker.deserialize_own_rank",
                                          worker, version)
    return {"globals": namespace, "worker_globals": worker, **methods}


@_versioned
def scheduler_weight_updater(version: str) -> dict[str, Any]:
    """0.5.23's scheduler side of weight updates (``managers/scheduler_components/weight_updater.py``,
    ``SchedulerWeightUpdaterManager``): the session routes (``begin_weight_update`` / ``end_weight_update``),
    the session check of ``update_weights_from_distributed`` and ``update_weights_from_tensor``, the flush
    after an update, and the TP barrier; with ``TpModelWorker.deserialize_own_rank``
    (``managers/tp_worker.py``: each rank opens ``serialized_named_tensors[tp_rank]``). Cut out and run with
    the globals they read; the caller sets ``get_parallel`` (the rank) in ``globals``."""
    import contextlib
    import logging

    import msgspec
    import torch

    io = io_struct(version)
    namespace: dict[str, Any] = {
        "torch": torch, "msgspec": msgspec, "logger": logging.getLogger("sglang.scheduler_weight_updater"),
        "Optional": Any, "get_parallel": None, "monkey_patch_torch_reductions": lambda: None,
        "MultiprocessingSerializer": serializer(version), "Set": set, "List": list, "Tuple": tuple, "Dict": dict,
        **{name: getattr(io, name) for name in dir(io) if name.endswith(("ReqInput", "ReqOutput"))},
    }
    where = "srt/managers/scheduler_components/weight_updater.py"
    cut(where, "_parse_runner_selector", namespace, version)
    cut(where, "_WeightUpdateSession", namespace, version)
    methods = {name: cut(where, f"SchedulerWeightUpdaterManager.{name}", namespace, version)
               for name in ("_select_runners", "flush_cache_after_weight_update",
                            "record_weight_version_after_update", "begin_weight_update", "end_weight_update",
                            "update_weights_from_distributed", "update_weights_from_tensor",
                            "init_weights_update_group", "destroy_weights_update_group")}
    methods["_observe_weight_load"] = contextlib.contextmanager(
        cut(where, "SchedulerWeightUpdaterManager._observe_weight_load", {**namespace, "time": __import__("time")},
            version))
    return {"globals": namespace, **methods}


@_versioned
def weight_versions(version: str) -> types.ModuleType:
    """``utils/weight_versions.py``: per-request weight version events and the ``weight_versions`` spans
    SGLang adds to a finished output's ``meta_info``."""
    return _load("sglang.srt.utils.weight_versions",
                 {"sglang.srt.utils.weight_versions": "sglang/srt/utils/weight_versions.py", **_MSGSPEC}, version)


@cache
def abort_path() -> dict[str, Any]:
    """How SGLang answers a request aborted in its waiting queue (e.g. retracted by a ``retract`` pause,
    then aborted): the scheduler's ``_make_abort_req`` (``managers/scheduler.py``) and the tokenizer
    manager's ``_handle_abort_req``, ``add_logprob_to_meta_info`` and ``detokenize_logprob_tokens``
    (``managers/tokenizer_manager.py``), cut out and run with the module globals they read. ``get_serving()``
    (SGLang's server-args context) is given as a parameter-free stand-in holding ``weight_version`` and
    ``skip_tokenizer_init``; the caller sets ``serving.weight_version``."""
    import logging

    versions = weight_versions()
    serving = types.SimpleNamespace(weight_version="default", skip_tokenizer_init=False)
    constants = "HEALTH_CHECK"  # sglang/srt/constants.py HEALTH_CHECK_RID_PREFIX
    common: dict[str, Any] = {"Optional": Any, "List": list, "Req": Any, "FinishReasonDict": Any, "Any": Any,
                              "get_serving": lambda: serving, "logger": logging.getLogger("sglang.tm")}
    is_health = cut("srt/managers/utils.py", "is_health_check_generate_req",
                    {**common, "HEALTH_CHECK_RID_PREFIX": constants})
    make_abort = cut("srt/managers/scheduler.py", "_make_abort_req",
                     {**common, "AbortReq": io_struct().AbortReq,
                      "compute_weight_version_spans": versions.compute_weight_version_spans})
    tm = "srt/managers/tokenizer_manager.py"
    tm_globals = {**common, "is_health_check_generate_req": is_health,
                  "add_weight_versions_to_meta_info": versions.add_weight_versions_to_meta_info}
    return {"serving": serving, "make_abort_req": make_abort,
            "handle_abort_req": cut(tm, "TokenizerManager._handle_abort_req", tm_globals),
            "add_logprob_to_meta_info": cut(tm, "TokenizerManager.add_logprob_to_meta_info", tm_globals),
            "detokenize_logprob_tokens": cut(tm, "TokenizerManager.detokenize_logprob_tokens", tm_globals),
            "record_weight_version_events": versions.record_weight_version_events,
            "compute_weight_version_spans": versions.compute_weight_version_spans,
            "add_weight_versions_to_meta_info": versions.add_weight_versions_to_meta_info}


def waiting_abort_output(ids: list[int], logprobs: list[float], *, stream: bool, text: str = "", version: str = "0",
                         pushed_to: str | None = None, rid: str = "r1", e2e_latency: float = 0.0012) -> dict[str, Any]:
    """What SGLang sends for a request aborted in its waiting queue after it produced ``ids`` (a ``retract``
    pause put it back there; then ``/abort_request`` or an ``abort`` pause), by running ``abort_path()``:
    the scheduler's request (``output_ids``, ``weight_version_events``) and the tokenizer manager's
    ``ReqState`` (the ids and logprobs streamed so far) are stand-ins holding what those code paths read.
    With ``pushed_to``, the server's version changed from ``version`` to it while the request waited
    (``Scheduler.record_weight_version_change`` records an event for every waiting request). The result
    is the JSON the HTTP server writes (tuples become arrays)."""
    import json

    sg = abort_path()
    sg["serving"].weight_version = version
    req = types.SimpleNamespace(rid=rid, output_ids=list(ids), weight_version_events=[])
    if pushed_to is not None:
        sg["record_weight_version_events"]([req], old_version=version)
        sg["serving"].weight_version = pushed_to
    state = types.SimpleNamespace(
        finished=False, out_list=[], event=types.SimpleNamespace(set=lambda: None),
        time_stats=types.SimpleNamespace(set_finished_time=lambda: None, get_e2e_latency=lambda: e2e_latency),
        obj=types.SimpleNamespace(stream=stream, return_logprob=True, top_logprobs_num=0, token_ids_logprob=None,
                                  return_text_in_logprobs=False, rid=rid),
        output_ids=list(ids), get_text=lambda: text,
        input_token_logprobs_val=[], input_token_logprobs_idx=[], input_token_logprobs=[],
        output_token_logprobs_val=list(logprobs), output_token_logprobs_idx=list(ids),
        output_token_logprobs=[(lp, t, None) for lp, t in zip(logprobs[:1], ids[:1])])  # some already sent
    manager = types.SimpleNamespace(rid_to_state={rid: state},
                                    config_value=lambda key: sg["serving"].weight_version)
    manager.add_logprob_to_meta_info = lambda *a: sg["add_logprob_to_meta_info"](manager, *a)
    manager.detokenize_logprob_tokens = lambda *a: sg["detokenize_logprob_tokens"](manager, *a)
    sg["handle_abort_req"](manager, sg["make_abort_req"](req))
    (out,) = state.out_list
    return json.loads(json.dumps(out))
