"""A standalone process group for pushing weights from the trainer to engines.

Shared by the trainer (sender, rank 0) and the embedded engine (receivers, ranks ``rank_offset`` ...). It is
built directly on its own TCPStore rendezvous at ``master_address:master_port`` and never touches
``torch.distributed``'s default group: under torchrun the trainer already has one (its FSDP group), and an
engine has none. Gloo on CPU, NCCL on CUDA, as SGLang's ``/init_weights_update_group``.

Protocol (mirrors SGLang, see docs/sglang-protocol.md):

    trainer                                        engine (HTTP)
    init_weight_group(rank=0, ...)          <->    POST /init_weights_update_group  (both block until formed)
    broadcast_tensors(group, bucket, src=0) <->    POST /update_weights_from_distributed {names, dtypes, shapes}

Both sides must enter each collective concurrently (the trainer sends the HTTP request from a thread, or
asynchronously, and then broadcasts), and broadcast the tensors of a bucket in the same order.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


@dataclass
class WeightGroup:
    backend: str
    rank: int
    world_size: int
    group_name: str
    process_group: Any  # ProcessGroupGloo / ProcessGroupNCCL
    store: Any  # kept alive for the group's lifetime

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")


def init_weight_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    group_name: str = "weight_update_group",
    timeout_s: float = 300.0,
) -> WeightGroup:
    """Join (rank 0: create) the group; blocks until all ``world_size`` ranks have joined.

    Rank 0 hosts the TCPStore at ``master_address:master_port``; that port must be free on its machine.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: use one of {BACKENDS} (gloo for CPU tensors, nccl for CUDA)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
    )
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    group = WeightGroup(backend, rank, world_size, group_name, pg, store)
    # One tiny collective so that join returns only once every rank is connected (NCCL connects lazily).
    probe = torch.zeros(1, device=group.device)
    pg.broadcast([probe], dist.BroadcastOptions()).wait()
    return group


def broadcast_tensors(group: WeightGroup, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast ``tensors`` from rank ``src`` in list order; receivers pass empty buffers to fill in place.

    All collectives are issued before waiting, so a bucket of many tensors costs one round of latency.
    """
    works = []
    for tensor in tensors:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        works.append(group.process_group.broadcast([tensor], opts))
    for work in works:
        work.wait()
    if group.backend == "nccl":
        torch.cuda.synchronize()


def destroy_weight_group(group: WeightGroup) -> None:
    """Release the group's resources (NCCL communicators); the object must not be used afterwards."""
    shutdown = getattr(group.process_group, "shutdown", None)
    if group.backend == "nccl" and shutdown is not None:
        shutdown()
