"""One device, no FSDP: low-precision compute weights kept beside the float32 master weights between steps.

With one rank there is nothing to shard, and FSDP2's mixed precision would still cast every float32 weight
to bfloat16 before each forward pass and copy every gradient through its reduce hook (17 ms and 8 ms of a
225 ms step on an H200 for the 1.5B shape, docs/trainer.md). Instead the module keeps its float32
parameters (what ``state_dict``, checkpoints, weight pushes and the optimizer see) and a :class:`Shadow`
holds one bfloat16 leaf per parameter (tied parameters share one). :func:`compute_weights` swaps the leaves
into the modules for a forward pass; autograd then produces bfloat16 gradients on the leaves, and
:func:`collect_grads`, called after each backward pass, adds them into the masters' float32 ``.grad`` in two
foreach calls (so micro-batches accumulate in float32, as FSDP2's float32 reduction did; per-parameter
Python hooks cost milliseconds of CPU time inside the backward pass, where the GPU waited for it). After the
optimizer updated the masters, :func:`refresh` copies them into the leaves in one ``_foreach_copy_`` (one
pass over the weights instead of a cast per step inside every forward). A master changed any other way (``load_state_dict``, a test's ``copy_``) bumps its version
counter, which the next swap notices and refreshes for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

ATTR = "_agentrl_shadow"


class Shadow:
    """The low-precision leaves of a module's parameters and where each one goes."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.masters: list[torch.nn.Parameter] = []
        self.leaves: list[torch.nn.Parameter] = []
        by_id: dict[int, int] = {}
        self.slots: list[tuple[torch.nn.Module, str, int]] = []  # (module, parameter name, index of the leaf)
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is None or (param.dtype == dtype and not param.requires_grad):
                    continue  # frozen and already in the compute dtype (a LoRA run's base): used as it is
                k = by_id.get(id(param))
                if k is None:
                    k = by_id[id(param)] = len(self.masters)
                    self.masters.append(param)
                    leaf = torch.nn.Parameter(torch.empty_like(param, dtype=dtype), requires_grad=param.requires_grad)
                    self.leaves.append(leaf)
                self.slots.append((module, name, k))
        self.versions: list[int] = []
        self.refresh()

    @torch.no_grad()
    def collect_grads(self) -> None:
        """Move the leaves' gradients into the masters' ``.grad`` (float32; added to what is there).

        Masters without a gradient get views into one new float32 buffer (one allocation, not one each)."""
        pairs = [(m, leaf) for m, leaf in zip(self.masters, self.leaves) if leaf.grad is not None]
        fresh = [(m, leaf) for m, leaf in pairs if m.grad is None]
        more = [(m, leaf) for m, leaf in pairs if m.grad is not None]
        if fresh and len({(m.dtype, m.device) for m, _ in fresh}) > 1:  # (not from load_model: all float32)
            for m, _ in fresh:
                m.grad = torch.empty_like(m)
        elif fresh:
            flat = torch.empty(sum(m.numel() for m, _ in fresh), dtype=fresh[0][0].dtype, device=fresh[0][0].device)
            for (m, _), g in zip(fresh, flat.split([m.numel() for m, _ in fresh])):
                m.grad = g.view_as(m)
        if fresh:
            torch._foreach_copy_([m.grad for m, _ in fresh], [leaf.grad for _, leaf in fresh])
        if more:
            torch._foreach_add_([m.grad for m, _ in more], [leaf.grad for _, leaf in more])
        for _, leaf in pairs:
            leaf.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy (cast) the masters into the leaves: after every optimizer step."""
        torch._foreach_copy_([leaf.data for leaf in self.leaves], [m.data for m in self.masters])
        self.versions = [m._version for m in self.masters]

    def stale(self) -> bool:
        return any(m._version != v for m, v in zip(self.masters, self.versions)) or any(
            module._parameters.get(name) is not self.masters[k] for module, name, k in self.slots)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        if self.stale():
            self._rebind()
            self.refresh()
        for module, name, k in self.slots:
            module._parameters[name] = self.leaves[k]
        try:
            yield
        finally:
            for module, name, k in self.slots:
                module._parameters[name] = self.masters[k]

    def _rebind(self) -> None:
        """A parameter was replaced by another tensor (e.g. ``load_state_dict(assign=True)``): follow it."""
        for module, name, k in self.slots:
            current = module._parameters.get(name)
            if current is not None and current is not self.masters[k]:
                self.masters[k] = current


def attach(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Give ``model`` (float32 parameters, one device) a :class:`Shadow` of ``dtype`` compute weights."""
    setattr(model, ATTR, Shadow(model, dtype))
    return model


def get(model: torch.nn.Module) -> Shadow | None:
    return getattr(model, ATTR, None)


def compute_weights(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Run the forward passes inside this to compute with the shadow weights (a no-op without a shadow)."""
    shadow = get(model)
    return shadow.swapped() if shadow is not None else contextlib.nullcontext()


def collect_grads(model: torch.nn.Module) -> None:
    """After a backward pass through :func:`compute_weights`: the gradients onto the float32 masters."""
    shadow = get(model)
    if shadow is not None:
        shadow.collect_grads()


def refresh(model: torch.nn.Module) -> None:
    """After the optimizer stepped: bring the compute weights up to the masters (a no-op without a shadow)."""
    shadow = get(model)
    if shadow is not None:
        shadow.refresh()
