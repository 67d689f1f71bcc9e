"""One GRPO step on a batch of rows: advantages, proximal logprobs, micro-batched loss, optimizer step.

Every rank holds the whole batch (rank 0 leased it and broadcast the bytes), computes the same advantages,
and trains on its own share of the rows (:func:`trainer.data.shard_rows`). The loss of every micro-batch is
normalised by batch-wide counts, so the sum over micro-batches and ranks is the loss of the batch in one
piece; FSDP2 averages gradients over ranks, so each rank's loss is scaled by the world size to turn that
average back into the sum. Ranks with fewer micro-batches run all-masked dummy ones so that every rank
enters the same number of FSDP collectives.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from agentrl.trajectory import Row
from trainer import core_algos
from trainer.config import TrainerSettings, check_row_fits
from trainer.data import (MicroBatch, collate, dummy_micro_batch, index_of, pack_micro_batches, row_rewards,
                          shard_rows, split_by_group)
from trainer import shadow
from trainer.model import DistInfo, token_logprobs
from trainer.packing import pack, packed_logprobs

_SUM_KEYS = ("tokens", "clipped", "capped", "is_weight_sum", "ratio_sum", "entropy_sum", "gap_sum",
             "gap_same_sum", "same_tokens", "loss", "input_tokens")
_MAX_KEYS = ("is_weight_max", "gap_max")


def advantages_for(rows: Sequence[Row], settings: TrainerSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """(N,) row advantages and their metrics for the whole batch."""
    rewards = torch.from_numpy(row_rewards(rows, settings.gamma_or_none))
    adv, metrics = core_algos.group_advantages(
        rewards, index_of([r.grpo_group for r in rows]), index_of([r.session_id for r in rows]),
        estimator=settings.adv_estimator,
    )
    metrics["reward/mean"] = float(rewards.mean())
    metrics["reward/max"] = float(rewards.max())
    metrics["reward/min"] = float(rewards.min())
    return adv, metrics


def plan_micro_batches(rows: Sequence[Row], index: Sequence[int], adv: torch.Tensor, settings: TrainerSettings,
                       info: DistInfo) -> list[MicroBatch]:
    """This rank's micro-batches for the rows ``index``, padded with dummies to the most any rank has.

    Everything is laid out on the CPU (the packed layout too), then moved: the GPU never waits for it."""
    lengths = [rows[i].num_tokens for i in index]
    mine = [index[j] for j in shard_rows(lengths, info.world_size)[info.rank]]
    packs = pack_micro_batches([rows[i].num_tokens for i in mine], settings.micro_batch_tokens)
    micro = [collate(rows, [mine[j] for j in pack], adv) for pack in packs]
    count = torch.tensor([len(micro)], dtype=torch.int64)
    if info.world_size > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    micro += [dummy_micro_batch() for _ in range(int(count) - len(micro))]
    if settings.packing:
        for m in micro:
            m.packed = pack(m.input_ids, m.attention_mask, m.loss_mask)
    return [m.to(info.device) for m in micro]


def micro_logprobs(model: torch.nn.Module, m: MicroBatch, *, packing: bool = True,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T-1) logprobs (and entropy) of a micro-batch: packed and only at loss positions, or the full padded way.

    Both give the same numbers where the loss mask is 1 (the packed path leaves 0 elsewhere).
    """
    temperature = m.temperature  # each token's sampling temperature: the distribution behaviour came from
    with shadow.compute_weights(model):  # one rank, bf16: the compute copy of the weights (trainer.shadow)
        if packing:
            return packed_logprobs(model, m.input_ids, m.attention_mask, m.loss_mask, with_entropy=with_entropy,
                                   temperature=1.0 if temperature is None else temperature, packed=m.packed)
        return token_logprobs(model, m.input_ids, m.attention_mask, with_entropy=with_entropy,
                              temperature=temperature)


@torch.no_grad()
def recompute_proximal(model: torch.nn.Module, micro: Sequence[MicroBatch], packing: bool = True) -> None:
    """Fill ``m.prox`` with logprobs under the current weights (before this step's update)."""
    for m in micro:
        m.prox, _ = micro_logprobs(model, m, packing=packing)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: Sequence[Row],
               settings: TrainerSettings, info: DistInfo, *, version: int) -> dict[str, Any]:
    """Train on ``rows`` (the whole batch, identical on every rank); returns the step's metrics."""
    start = time.perf_counter()
    for row in rows:
        check_row_fits(row.num_tokens, settings, row.row_id)
    with record_function("agentrl.plan"):
        adv, metrics = advantages_for(rows, settings)
        # episodes, not rows, weigh in the loss (core_algos.episode_weights): a row's advantage is scaled by
        # its weight and the loss normalised by the weighted counts; rows of one session share a group, so
        # a mini-batch (split by group) holds all the rows of its episodes
        weights = core_algos.episode_weights(index_of([r.session_id for r in rows]))
        loss_tokens = torch.tensor([float(r.loss_mask[1:].sum()) for r in rows], dtype=torch.float64)
        minis = split_by_group(rows, settings.mini_batches)
        plans = [plan_micro_batches(rows, idx, adv * weights, settings, info) for idx in minis]
    model.train()
    # The first mini-batch trains on the weights the proximal policy is defined by, so its proximal
    # logprobs are the (detached) logprobs of its own training forward: one forward pass fewer per step.
    with record_function("agentrl.proximal"):
        for micro in plans[1:]:
            recompute_proximal(model, micro, settings.packing)

    sums = {k: torch.zeros((), dtype=torch.float64, device=info.device) for k in _SUM_KEYS}
    maxes = {k: torch.zeros((), dtype=torch.float64, device=info.device) for k in _MAX_KEYS}
    grad_norms = []
    for k, (idx, micro) in enumerate(zip(minis, plans)):
        global_tokens, global_seqs = core_algos.weighted_counts(weights[list(idx)], loss_tokens[list(idx)])
        optimizer.zero_grad(set_to_none=True)
        for m in micro:
            with record_function("agentrl.forward"):
                logp, entropy = micro_logprobs(model, m, packing=settings.packing, with_entropy=True)
                if k == 0:
                    m.prox = logp.detach()
                loss, stats = core_algos.ppo_loss(
                    logp, m.prox, m.behaviour, core_algos.token_advantages(m.advantages, m.loss_mask), m.loss_mask,
                    clip_low=settings.clip_low, clip_high=settings.clip_high, is_cap=settings.is_cap_or_none,
                    agg_mode=settings.loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                )
            with record_function("agentrl.backward"):
                (loss * info.world_size).backward()
                shadow.collect_grads(model)  # one rank, bf16: the gradients onto the float32 masters
            _accumulate(sums, maxes, stats, m, entropy, loss, version)
        with record_function("agentrl.optimizer"):
            grad_norms.append(_clip_and_step(model, optimizer, settings.max_grad_norm))

    with record_function("agentrl.metrics"):
        if info.world_size > 1:
            for v in sums.values():
                dist.all_reduce(v, op=dist.ReduceOp.SUM)
            for v in maxes.values():
                dist.all_reduce(v, op=dist.ReduceOp.MAX)
        # one device-to-host copy for all of them (each float() would wait for the device once)
        names = [*sums, *maxes]
        values = torch.stack([*sums.values(), *maxes.values(), *grad_norms]).tolist()
        s = dict(zip(names, values[:len(names)]))
        grad_norms = values[len(names):]
    elapsed = time.perf_counter() - start
    tokens = max(s["tokens"], 1.0)
    finite = [g for g in grad_norms if math.isfinite(g)]
    metrics.update(core_algos.summarise_stats(s))
    metrics.update({
        "actor/loss": s["loss"] / max(len(minis), 1),
        "actor/entropy": s["entropy_sum"] / tokens,
        "actor/grad_norm": sum(finite) / len(finite) if finite else math.nan,
        "actor/skipped_updates": float(len(grad_norms) - len(finite)),  # non-finite norms: no update made
        "logprob_gap/mean": s["gap_sum"] / tokens,
        "logprob_gap/max": s["gap_max"],
        "logprob_gap/same_version_mean": s["gap_same_sum"] / max(s["same_tokens"], 1.0),
        "logprob_gap/same_version_tokens": s["same_tokens"],
        "batch/rows": float(len(rows)),
        "batch/loss_tokens": s["tokens"],
        "batch/tokens": s["input_tokens"],
        "perf/step_s": elapsed,
        "perf/tokens_per_s": s["input_tokens"] / max(elapsed, 1e-9),
    })
    return metrics


def _accumulate(sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor], stats: dict[str, torch.Tensor],
                m: MicroBatch, entropy: torch.Tensor | None, loss: torch.Tensor, version: int) -> None:
    with torch.no_grad():
        mask = m.loss_mask
        gap = (m.prox - m.behaviour).abs() * mask
        same = mask * (m.versions == version).to(mask.dtype)
        for key in ("tokens", "clipped", "capped", "is_weight_sum", "ratio_sum"):
            sums[key] += stats[key].double()
        sums["entropy_sum"] += (entropy * mask).sum().double() if entropy is not None else 0.0
        sums["gap_sum"] += gap.sum().double()
        sums["gap_same_sum"] += ((m.prox - m.behaviour).abs() * same).sum().double()
        sums["same_tokens"] += same.sum().double()
        sums["loss"] += loss.detach().double()
        sums["input_tokens"] += float(m.real_tokens)
        maxes["is_weight_max"] = torch.maximum(maxes["is_weight_max"], stats["is_weight_max"].double())
        maxes["gap_max"] = torch.maximum(maxes["gap_max"], gap.max().double())


def _clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the gradients to ``max_norm`` (0: no clipping) and step; returns the norm before clipping (a
    0-d tensor on the device: reading it waits for the device, so the caller reads all metrics at once).

    A fused AdamW over plain tensors (one GPU) takes the clipping as its ``grad_scale`` (the gradients are
    divided by it inside the update kernel, the hook ``torch.amp.GradScaler`` uses) instead of a separate
    multiply over every gradient; otherwise ``clip_grad_norm_``. Then the compute copy of the weights, if
    any, is brought up to the new master weights (``trainer.shadow``).

    A non-finite norm (an inf or NaN gradient: an overflow, a NaN loss) skips the update: one bad batch
    would otherwise turn every weight into NaN. ``train_step`` reports the skips (``actor/skipped_updates``).
    """
    shadow.collect_grads(model)  # (a no-op after train_step's own backward passes)
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_norm if max_norm > 0 else float("inf")
    fused = bool(optimizer.defaults.get("fused")) and not any(hasattr(p, "full_tensor") for p in params)
    if fused and params:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]).to(torch.float32)
        # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); dividing by its inverse is the same
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / limit, min=1.0).reshape(1)
        # a non-finite norm skips the update inside the kernel (weights, moments and step count stay), the
        # way GradScaler skips an overflowed step: no wait for the device
        optimizer.found_inf = (~torch.isfinite(norm)).to(torch.float32).reshape(())
        try:
            optimizer.step()
        finally:
            optimizer.grad_scale = None
            optimizer.found_inf = None
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if bool(torch.isfinite(norm)):  # one wait for the device per update; every rank has the same norm
            optimizer.step()
    shadow.refresh(model)
    return norm.detach().to(torch.float64).reshape(())
