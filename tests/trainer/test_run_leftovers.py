"""What a run leaves on disk: the disk pushes' copies go, checkpoints hold the optimizer state only if asked.

A 3-step `agentrl up` of 2026-12-04 left 2.6-2.7 GB: `sync/v2` and `sync/v3` (517 MB each) after the run,
and 1.1 GB of optimizer state beside 514 MB of weights in the checkpoint. The loop runs against the fake
gateway of test_loop (the HTTP boundary), so each weight push is a real save of the tiny model's weights.
"""

from __future__ import annotations

import json

import pytest

from tests.trainer.helpers import synthetic_rows
from tests.trainer.test_loop import FakeGateway, _settings, _with_rewards
from trainer import checkpoint
from trainer.loop import train


class CopiesSeen(FakeGateway):
    """Also notes the sync copies on disk each time the engine is asked to load one."""

    def __init__(self, batches, sync_dir):
        super().__init__(batches)
        self.sync_dir = sync_dir
        self.on_disk: list[tuple[str, list[str]]] = []

    def handler(self, request):
        if request.url.host == "engine" and request.url.path == "/update_weights_from_disk":
            loading = json.loads(request.content)["model_path"]
            self.on_disk.append((loading, sorted(p.name for p in self.sync_dir.glob("v*"))))
        return super().handler(request)


def _batches(n: int):
    return [_with_rewards(synthetic_rows(1, 2, seed=20 + i), {"g0": [0, 1]}) for i in range(n)]


@pytest.mark.slow
def test_sync_copies_are_removed_after_acknowledged_pushes_and_at_the_end(tmp_path, dist_info):
    sync_dir = tmp_path / "ckpt" / "sync"
    gw = CopiesSeen(_batches(4), sync_dir)
    state = train(_settings(tmp_path, steps=4, batch_groups=1, group_size=2, sync_mode="disk"), http=gw.client())
    assert state.version == 4 and [loading.rsplit("/", 1)[1] for loading, _ in gw.on_disk] == ["v1", "v2", "v3", "v4"]
    for n, (loading, copies) in enumerate(gw.on_disk, 1):
        # while v<n> loads: it, the served v<n-1> (what a failed push rolls back to) and nothing older
        assert copies == sorted(f"v{v}" for v in range(max(1, n - 1), n + 1)), (loading, copies)
    assert list(sync_dir.glob("v*")) == []  # the run is over: the engines loaded them, the checkpoint has them


@pytest.mark.slow
def test_weights_only_checkpoint_and_a_resume_from_it(tmp_path, dist_info, caplog):
    settings = _settings(tmp_path, steps=1, batch_groups=1, group_size=2, save_optimizer=False)
    train(settings, http=FakeGateway(_batches(1)).client())
    saved = checkpoint.latest(tmp_path / "ckpt")
    assert saved is not None and (saved / "trainer_state.json").is_file() and any(saved.glob("*.safetensors"))
    assert not (saved / "optimizer").exists()

    # resuming from it trains on with a fresh optimizer, and says so
    state = train(_settings(tmp_path, steps=1, batch_groups=1, group_size=2), http=FakeGateway(_batches(2)[1:]).client())
    assert (state.step, state.version) == (2, 2)
    assert "holds no optimizer state" in caplog.text
    assert (checkpoint.latest(tmp_path / "ckpt") / "optimizer").is_dir()  # the trainer's default keeps it
