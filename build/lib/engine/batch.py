"""The running batch: one left-padded KV cache shared by every running request.

Layout: row ``i`` of the batch holds one request. ``mask`` (B, L) marks which cache columns are real tokens
(left padding is 0). Every row's cache holds its prompt and all its output tokens except the last sampled
one, which is ``pending`` and is fed at the next decode step. Positions are explicit (the count of real
tokens before a column), so a row's tokens see exactly the positions and keys they would see alone; only
padded keys, masked out, differ.

- ``prefill`` builds a batch for newly admitted requests (one forward over their left-padded prompts).
- ``merge`` joins two batches: the shorter cache is left-padded to the longer one, then rows concatenate.
- ``keep`` drops finished rows and trims columns that became padding in every row.
- ``decode`` runs one batched forward for all rows and returns the next-token logits.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Batch:
    cache: DynamicCache  # per layer keys/values (B, H, L, D)
    mask: torch.Tensor  # (B, L) long, 1 = real token
    pending: torch.Tensor  # (B,) long, last sampled token, not yet in the cache

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])


def _cache_kwarg(model) -> str:
    """transformers 5 calls the KV cache argument ``cache``; earlier releases ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _layers(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def _cache(keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    return DynamicCache(ddp_cache_data=list(zip(keys, values)))


@torch.no_grad()
def prefill(
    model, prompts: list[list[int]], pad_id: int, *, all_logits: bool = False
) -> tuple[Batch, torch.Tensor]:
    """Forward the left-padded prompts; returns the new batch (``pending`` unset) and logits.

    Logits are (n, V) for the last prompt position, or (n, P, V) for every position when ``all_logits``.
    """
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, longest - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=0 if all_logits else 1,
        **{_cache_kwarg(model): cache},
    )
    batch = Batch(cache, mask, torch.zeros(len(prompts), dtype=torch.long, device=device))
    logits = out.logits if all_logits else out.logits[:, -1, :]
    return batch, logits


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if width == 0:
        return t
    shape = list(t.shape)
    shape[dim] = width
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def merge(a: Batch | None, b: Batch) -> Batch:
    """Rows of ``a`` then rows of ``b`` in one batch."""
    if a is None or a.size == 0:
        return b
    length = max(a.length, b.length)
    da, db = length - a.length, length - b.length
    (ak, av), (bk, bv) = _layers(a.cache), _layers(b.cache)
    keys = [torch.cat([_pad_left(x, da, 2), _pad_left(y, db, 2)]) for x, y in zip(ak, bk)]
    values = [torch.cat([_pad_left(x, da, 2), _pad_left(y, db, 2)]) for x, y in zip(av, bv)]
    mask = torch.cat([_pad_left(a.mask, da, 1), _pad_left(b.mask, db, 1)])
    return Batch(_cache(keys, values), mask, torch.cat([a.pending, b.pending]))


def keep(batch: Batch, rows: list[int]) -> Batch | None:
    """Only the given rows (in that order); leading columns that are padding in all of them are dropped."""
    if not rows:
        return None
    if rows == list(range(batch.size)):
        return batch
    index = torch.tensor(rows, dtype=torch.long, device=batch.mask.device)
    mask = batch.mask.index_select(0, index)
    first = int(mask.any(dim=0).nonzero()[0].item())
    old_keys, old_values = _layers(batch.cache)
    keys = [k.index_select(0, index)[:, :, first:] for k in old_keys]
    values = [v.index_select(0, index)[:, :, first:] for v in old_values]
    return Batch(_cache(keys, values), mask[:, first:], batch.pending.index_select(0, index))


@torch.no_grad()
def decode(model, batch: Batch) -> torch.Tensor:
    """One step for every row: feed ``pending``, extend the cache in place; returns logits (B, V)."""
    positions = batch.mask.sum(dim=1, keepdim=True)  # real tokens already cached = next position
    mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
    out = model(
        input_ids=batch.pending[:, None],
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **{_cache_kwarg(model): batch.cache},
    )
    batch.mask = mask
    return out.logits[:, -1, :]
