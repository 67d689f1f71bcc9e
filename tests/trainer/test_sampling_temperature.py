"""Train on exactly what was sampled: the trainer's logprobs under the turn's temperature equal the engine's.

Real path: the embedded engine on the tiny model (its own process) -> a gateway process -> the real
``openai`` SDK at temperature 0.7 and 1.3 -> the recorded turns exported with ``agentrl.trajectory`` and
sent through the binary wire format -> ``trainer.data.collate`` -> ``trainer.model.token_logprobs`` on the
same weights, packed (as ``train_step`` does) and padded. Same version, so the gap must be ~0; plain temperature-1 logprobs (the old behaviour) are
far off, which shows the check can fail.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
import torch

from agentrl.trajectory import decode_batch, encode_batch, export_session, turn_from_interaction
from gateway.store import Store
from trainer.data import collate
from trainer.model import token_logprobs
from trainer.step import micro_logprobs


async def _rows(db: str, session_ids: list[str]) -> list:
    store = await Store.open(db, migrate=False)
    try:
        rows = []
        for sid in session_ids:
            turns = [turn_from_interaction(i) for i in await store.session_interactions(session_id=sid)]
            rows += export_session(turns, gamma=1.0, session_id=sid, group_id="g")
        return rows
    finally:
        await store.close()


def _gaps(model: torch.nn.Module, rows: list) -> tuple[float, float]:
    """Mean |trainer - engine| logprob on generated tokens: under the exported temperatures, and at T=1."""
    micro = collate(rows, list(range(len(rows))), torch.zeros(len(rows)))
    with torch.no_grad():
        scaled, _ = micro_logprobs(model, micro, packing=True)  # what train_step computes
        padded, _ = micro_logprobs(model, micro, packing=False)
        plain, _ = token_logprobs(model, micro.input_ids, micro.attention_mask)
    mask = micro.loss_mask.bool()
    assert int(mask.sum()) > 20
    gap = max((scaled - micro.behaviour).abs()[mask].mean().item(), (padded - micro.behaviour).abs()[mask].mean().item())
    plain_gap = (plain - micro.behaviour).abs()[mask].mean().item()
    return gap, plain_gap


def test_same_version_logprob_gap_is_zero_at_temperatures_07_and_13(gateway_factory, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    gateway = gateway_factory()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    for temperature in (0.7, 1.3):
        _check(gateway, model, temperature)


def _check(gateway, model: torch.nn.Module, temperature: float) -> None:
    sessions = [gateway.create_session(group_id=f"temp-{temperature}") for _ in range(2)]
    for i, s in enumerate(sessions):
        client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        messages = [{"role": "user", "content": f"Count to {i + 5}."}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                               temperature=temperature, seed=i)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Again."}]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=temperature,
                                       seed=i + 10)
    rows, _ = decode_batch(encode_batch(asyncio.run(_rows(gateway.db, [s["session_id"] for s in sessions]))))
    assert rows and all(r.turn_temperatures.tolist() == pytest.approx([temperature] * 2) for r in rows)
    gap, plain_gap = _gaps(model, rows)
    print(f"T={temperature}: gap {gap:.2e} under the turn's temperature, {plain_gap:.2e} at temperature 1")
    assert gap < 1e-3
    assert plain_gap > 20 * max(gap, 1e-5)
