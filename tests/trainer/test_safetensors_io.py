"""trainer.safetensors_io writes files that safetensors itself reads back exactly (CPU here; GPU where CUDA is)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer.safetensors_io import WRITE_CHUNK, HostBuffer, save_file_fast


def _tensors(device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(name, t.to(device)) for name, t in [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(5, generator=g)),  # float32 after bf16: reordered for alignment
        ("counts", torch.arange(3, dtype=torch.int64)),
        ("transposed", torch.randn(4, 6, generator=g).t()),  # not contiguous
        ("empty", torch.ones(0)),
        ("half", torch.randn(3, 3, generator=g).to(torch.float16)),
        ("flag", torch.tensor([True, False])),
    ]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_round_trip_through_safetensors_own_loader(tmp_path, device):
    tensors = _tensors(device)
    buffer = HostBuffer()
    for attempt in range(2):  # the second write reuses the buffer
        path = tmp_path / f"m{attempt}.safetensors"
        size = save_file_fast(tensors, path, metadata={"format": "pt"}, buffer=buffer, threads=3)
        assert path.stat().st_size == size
        loaded = load_file(str(path))
        assert set(loaded) == {n for n, _ in tensors}
        for name, t in tensors:
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t.cpu()), name
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}


def test_large_tensors_are_written_in_chunks_by_several_threads(tmp_path):
    big = torch.randn(WRITE_CHUNK // 4 * 2 + 123)  # three chunks, the last one short
    path = tmp_path / "big.safetensors"
    save_file_fast([("big", big), ("small", torch.ones(3))], path, threads=4)
    loaded = load_file(str(path))
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["small"], torch.ones(3))


def test_unsupported_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot be stored"):
        save_file_fast([("c", torch.zeros(2, dtype=torch.complex64))], tmp_path / "c.safetensors")
