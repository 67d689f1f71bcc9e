"""Plays the trainer (rank 0) of a weight broadcast to a running engine; run as a separate process.

    python -m tests.engine.push_weights URL MODEL_DIR OUT_DIR VERSION

Perturbs the tiny model's weights (seed 1), saves them to OUT_DIR (so the test can compute reference
logprobs), then joins the engine's weight group and pushes them in two buckets, both tagged VERSION.
"""

from __future__ import annotations

import sys
import threading

import httpx
import torch
from safetensors.torch import load_file, save_file

from agentrl.weight_group import broadcast_tensors, destroy_weight_group, init_weight_group
from tests.conftest import free_port


def post_in_thread(url: str, body: dict, results: list) -> threading.Thread:
    def run() -> None:
        results.append(httpx.post(url, json=body, timeout=120))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def main(url: str, model_dir: str, out_dir: str, version: str) -> int:
    weights = load_file(f"{model_dir}/model.safetensors")
    gen = torch.Generator().manual_seed(1)
    new = {name: t + 0.5 * t.std() * torch.randn(t.shape, generator=gen) if t.numel() > 1 else t.clone()
           for name, t in weights.items()}
    save_file(new, f"{out_dir}/model.safetensors")

    port = free_port()
    results: list = []
    thread = post_in_thread(url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "test_group", "backend": "gloo"}, results)
    group = init_weight_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                              group_name="test_group", backend="gloo")
    thread.join()
    assert results[0].status_code == 200 and results[0].json()["success"], results[0].text

    names = sorted(new)
    for bucket in (names[: len(names) // 2], names[len(names) // 2 :]):
        results.clear()
        body = {"names": bucket, "dtypes": [str(new[n].dtype).removeprefix("torch.") for n in bucket],
                "shapes": [list(new[n].shape) for n in bucket], "group_name": "test_group",
                "weight_version": version}
        thread = post_in_thread(url + "/update_weights_from_distributed", body, results)
        broadcast_tensors(group, [new[n] for n in bucket], src=0)
        thread.join()
        assert results[0].status_code == 200 and results[0].json()["success"], results[0].text
    destroy_weight_group(group)
    print("pushed", len(names), "tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
