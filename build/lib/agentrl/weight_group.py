"""A standalone process group for pushing weights from the trainer to engines, formed as SGLang forms it.

Shared by the trainer (sender, rank 0) and the embedded engine (receivers). SGLang builds its side with its
own helper (``sglang.srt.utils.common.init_custom_process_group``, called by ``WeightUpdater.
init_weights_update_group`` with ``init_method="tcp://master_address:master_port"`` and ``rank =
rank_offset + tp_rank``): torch's ``rendezvous`` (rank 0 hosts the TCPStore), a ``PrefixStore(group_name)``
over it, then torch's private ``_new_process_group_helper`` (which adds torch's own per-group and per-device
prefixes), and no collective at all. :func:`init_weight_group` does the same steps, so the store keys and
the first collective of both sides meet; tests form the group with SGLang's own helper on the engine side.
It never touches ``torch.distributed``'s default group: under torchrun the trainer already has one (its
FSDP group), an engine may have none. Gloo on CPU, NCCL on CUDA.

Protocol (see docs/sglang-protocol.md):

    trainer                                        engine (HTTP)
    init_weight_group(rank=0, ...)          <->    POST /init_weights_update_group  (both block until formed)
    broadcast_flat(group, bucket, src=0)    <->    POST /update_weights_from_distributed
                                                        {names, dtypes, shapes, load_format: "flattened_bucket"}

``flattened_bucket`` (SGLang's ``FlattenedTensorBucket``): the bucket's tensors, each flattened and viewed as
bytes, concatenated in request order into one ``uint8`` tensor, sent with ONE broadcast; the receiver cuts
it back by the names/dtypes/shapes of the request. One collective per bucket instead of one per tensor.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
FLATTENED_BUCKET = "flattened_bucket"


@dataclass
class WeightGroup:
    backend: str
    rank: int
    world_size: int
    group_name: str
    process_group: Any  # ProcessGroup (gloo / NCCL backend)

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
    """Join (rank 0: host the store of) the group. Gloo returns once every rank has joined; NCCL connects
    at the first collective. Rank 0 binds ``master_address:master_port``, which must be free there."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: use one of {BACKENDS} (gloo for CPU tensors, nccl for CUDA)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{int(master_port)}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return WeightGroup(backend, rank, world_size, group_name, pg)


def _sync(group: WeightGroup) -> None:
    if group.backend == "nccl":
        torch.cuda.synchronize()


def broadcast_tensors(group: WeightGroup, tensors: list[torch.Tensor], src: int = 0) -> None:
    """One broadcast per tensor, in list order (SGLang's default load format); receivers pass empty buffers."""
    works = [dist.broadcast(t, src=src, group=group.process_group, async_op=True) for t in tensors]
    for work in works:
        work.wait()
    _sync(group)


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The ``flattened_bucket`` layout: every tensor's bytes, in order, as one ``uint8`` tensor."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unflatten(flat: torch.Tensor, manifest: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor]:
    """Views of ``flat`` (``uint8``) as the tensors of ``manifest`` ``(dtype, shape)``, in order."""
    out, start = [], 0
    for dtype, shape in manifest:
        numel = 1
        for d in shape:
            numel *= int(d)
        size = numel * torch.empty(0, dtype=dtype).element_size()
        out.append(flat[start:start + size].view(dtype).reshape(shape))
        start += size
    if start != flat.numel():
        raise ValueError(f"flattened bucket holds {flat.numel()} bytes, the manifest {start}")
    return out


def flat_size(manifest: list[tuple[torch.dtype, list[int]]]) -> int:
    total = 0
    for dtype, shape in manifest:
        numel = 1
        for d in shape:
            numel *= int(d)
        total += numel * torch.empty(0, dtype=dtype).element_size()
    return total


def broadcast_flat(group: WeightGroup, flat: torch.Tensor, src: int = 0) -> None:
    """One broadcast of a ``flattened_bucket`` tensor (sender: :func:`flatten`; receivers: an empty
    ``uint8`` tensor of :func:`flat_size` bytes)."""
    dist.broadcast(flat, src=src, group=group.process_group)
    _sync(group)


def destroy_weight_group(group: WeightGroup) -> None:
    """Release the group (as SGLang's ``destroy_weights_update_group``); its name can then be used again."""
    try:
        dist.destroy_process_group(group.process_group)
    except (ValueError, RuntimeError):  # already destroyed, or torch refuses a broken group
        pass
