"""Run one GRPO step under torchrun and save loss + full weights (used by test_fsdp.py).

    torchrun --nproc-per-node N tests/trainer/fsdp_worker.py OUT.pt MICRO_BATCH_TOKENS
"""

from __future__ import annotations

import sys

import torch

from engine.models import tiny_dir
from tests.trainer.helpers import synthetic_rows
from trainer.config import TrainerSettings
from trainer.model import close_distributed, init_distributed, iter_full_tensors, load_model
from trainer.step import train_step


def one_step(budget: int) -> dict:
    """One GRPO step on the tiny model and a fixed synthetic batch; every rank calls it."""
    info = init_distributed("cpu")
    torch.manual_seed(0)
    model = load_model(tiny_dir())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = TrainerSettings(engine_urls=["unused"], micro_batch_tokens=budget, is_cap=2.0)
    metrics = train_step(model, optimizer, synthetic_rows(n_groups=3, group_size=3), settings, info, version=0)
    weights = dict(iter_full_tensors(model, to_cpu=True))
    return {"metrics": metrics, "weights": weights, "world_size": info.world_size, "rank": info.rank}


def main(out: str, budget: int) -> None:
    result = one_step(budget)
    if result["rank"] == 0:
        torch.save(result, out)
    close_distributed(finished=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
