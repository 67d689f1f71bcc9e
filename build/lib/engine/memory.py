"""Giving the engine's GPU memory back while a colocated trainer runs, and taking it again after.

SGLang 0.5.19's ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation`` (body
``{"tags": [...] | null}``, ``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``; tags
``kv_cache``, ``weights``, ``cuda_graph``; none or ``null`` = all of them). SGLang asserts that the server is
idle before a release; here a busy engine is refused with a 400 instead. What each tag means here:

* ``kv_cache``: the embedded engine keeps no preallocated KV pool: each running batch owns its cache, and
  PyTorch's caching allocator keeps the freed blocks reserved for the next batch. Releasing drops the
  batch's cache (there is none when idle) and returns every cached block to the driver
  (``torch.cuda.empty_cache``), so ``nvidia-smi`` shows the memory free for the trainer.
* ``weights``: every parameter is copied to pinned host memory and its GPU storage freed; resuming copies
  it back, so the engine serves the same weights afterwards (like SGLang with
  ``--enable-weights-cpu-backup``; SGLang without it discards them and expects a weight update after the
  resume). Weight updates are refused while the weights are released.
* ``cuda_graph``: the embedded engine captures no CUDA graphs; accepted, nothing to free.

While anything is released, generation is refused (``/generate`` answers 503, ``/health`` 503) until every
tag is resumed. All changes run on the scheduler thread between steps (no forward pass sees a half-moved
model). On a CPU the same steps run (the host copy of a CPU tensor is the tensor itself), so the state
machine is tested without a GPU; only the freed bytes need one.
"""

from __future__ import annotations

import torch

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
MEMORY_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # SGLang's GPU_MEMORY_ALL_TYPES, in its order


class MemoryStateError(ValueError):
    """A release or resume that cannot be done (busy engine, unknown or not-released tag): answered 400."""


def parse_tags(tags: list[str] | None) -> list[str]:
    """SGLang's rule: no tags (``null`` or ``[]``) means all of them. Unknown names are refused."""
    if not tags:
        return list(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise MemoryStateError(f"unknown memory tags {unknown}; valid: {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))


def device_memory(device: torch.device) -> dict[str, int]:
    """Bytes held by this process's allocator on ``device`` (allocated, reserved); empty on a CPU."""
    if device.type != "cuda":
        return {}
    return {"memory_allocated_bytes": int(torch.cuda.memory_allocated(device)),
            "memory_reserved_bytes": int(torch.cuda.memory_reserved(device))}


class MemoryOccupation:
    """Which tags are released, and the host copy of the weights while ``weights`` is."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.released: set[str] = set()
        self._host: dict[str, torch.Tensor] = {}

    @property
    def asleep(self) -> bool:
        return bool(self.released)

    def release(self, tags: list[str], *, idle: bool) -> list[str]:
        """Scheduler thread. ``idle``: no request running or waiting. Returns the tags now released."""
        if not idle:
            raise MemoryStateError("release_memory_occupation needs an idle engine: requests are running or "
                                   "waiting; pause generation first (POST /pause_generation {\"mode\": \"abort\"}) "
                                   "and wait for them to finish")
        if WEIGHTS in tags and WEIGHTS not in self.released:
            self._offload_weights()
        self.released.update(tags)
        self._return_cached_blocks()
        return sorted(self.released)

    def resume(self, tags: list[str] | None) -> list[str]:
        """Scheduler thread. ``tags`` None: everything released. Returns the tags still released."""
        wanted = sorted(self.released) if not tags else parse_tags(tags)
        if not tags and not self.released:
            raise MemoryStateError("nothing is released: call /release_memory_occupation first")
        missing = sorted(set(wanted) - self.released)
        if missing:
            raise MemoryStateError(f"tags {missing} are not released (released: {sorted(self.released)})")
        if WEIGHTS in wanted:
            self._restore_weights()
        self.released.difference_update(wanted)
        return sorted(self.released)

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.model.named_parameters())  # tied parameters appear once

    def _offload_weights(self) -> None:
        cuda = self.device.type == "cuda"
        for name, param in self._params():
            if cuda:
                host = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=True)
                host.copy_(param.data, non_blocking=True)
            else:
                host = param.data  # a CPU tensor's host copy is itself
            self._host[name] = host
        if cuda:
            torch.cuda.synchronize(self.device)  # the host copies are complete before the storage goes
        for _, param in self._params():
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)

    def _restore_weights(self) -> None:
        for name, param in self._params():
            param.data = self._host[name].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._host.clear()

    def _return_cached_blocks(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
