"""The fast logprob path: packed rows, attention kept inside each row, logprobs only where the loss needs them.

A micro-batch arrives padded, ``(B, T)``. For the forward pass its rows are concatenated without padding
into one ``(1, N)`` sequence (``N`` = real tokens), with position ids that restart at 0 for every row, so
the projections, MLPs and norms spend nothing on padding; the attention function :func:`packed_attention`
(registered with transformers as ``agentrl_packed``) keeps attention inside each row (causal SDPA over the
rows laid out padded again, one batched call: a constant number of kernels per layer, which compiles). The model body returns hidden states; only the ``M`` positions whose
next token has loss mask 1 go through the LM head, in chunks, by :class:`LinearLogprob`, which never keeps
a ``(tokens x vocab)`` float32 tensor: its backward recomputes each chunk's logits. The ``(M,)`` results
are scattered back to the padded ``(B, T-1)`` layout, so the loss math (``trainer.core_algos``) is
unchanged and the numbers equal the unpacked path's within rounding (tests compare them).

FSDP2: the whole computation runs as a registered forward method of the root module
(``register_fsdp_forward_method``), so the root's parameters (embeddings, final norm, tied LM head) are
gathered for it and their gradients reduced exactly as for ``model.forward``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import numpy as np
import torch

ATTENTION = "agentrl_packed"
METHOD = "agentrl_logprobs"
COMPILED_HEAD = "_agentrl_compiled_head"  # model attribute set by trainer.model.compile_body on GPUs
CHUNK_ELEMENTS = 2**28  # logits elements per LM-head chunk (1 GiB in float32)


# ------------------------------------------------------------------------------------------- attention


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: (B, H, T, D) q/k/v -> (B, T, H, D).

    With ``agentrl_pad = (index, rows, width, dense)`` the batch is packed, ``(1, H, N, D)``: the tokens are spread
    to a right-padded ``(rows, H, width, D)`` layout (``index``: (N,) flat positions in ``rows x width``),
    attend causally row by row in one batched SDPA call, and are gathered back. Causal attention over
    right-padded rows never lets a real token see padding or another row, so this equals per-row attention;
    only attention itself pays for the padding, every other layer runs on the N real tokens (``dense``: no
    row is padded, so the packed tokens already are that layout and nothing is copied). Without it:
    plain causal SDPA (a right-padded batch).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pad = kwargs.pop("agentrl_pad", None)
    kwargs.pop("is_causal", None)
    if pad is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=True, **kwargs)
    index, rows, width, dense = pad
    h, d = query.shape[1], query.shape[3]

    def spread(x: torch.Tensor) -> torch.Tensor:  # (1, H, N, D) -> (rows, H, width, D)
        if dense:  # no padding (N = rows x width): a view, no copy
            return x[0].view(x.shape[1], rows, width, x.shape[3]).transpose(0, 1)
        tokens = x[0].transpose(0, 1)  # (N, H, D)
        flat = tokens.new_zeros(rows * width, tokens.shape[1], tokens.shape[2]).index_copy(0, index, tokens)
        return flat.view(rows, width, tokens.shape[1], tokens.shape[2]).transpose(1, 2)

    out, _ = sdpa_attention_forward(module, spread(query), spread(key), spread(value), None, dropout=dropout,
                                    scaling=scaling, is_causal=True, **kwargs)  # (rows, width, H, D)
    if dense:
        return out.reshape(1, rows * width, h, d), None
    return out.reshape(rows * width, h, d).index_select(0, index).unsqueeze(0), None


def register_attention() -> str:
    """Register :func:`packed_attention` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    return ATTENTION


# ------------------------------------------------------------------------------------------- packing


@dataclass
class Packed:
    """One micro-batch packed for the forward pass."""

    input_ids: torch.Tensor  # (1, N) int64, the rows' real tokens back to back
    position_ids: torch.Tensor  # (1, N) int64, restarting at 0 for every row
    index: torch.Tensor  # (N,) int64: flat position of each packed token in the padded (B, T) layout
    src: torch.Tensor  # (M,) int64: packed positions whose next token is a loss token
    targets: torch.Tensor  # (M,) int64: those next tokens
    dst: torch.Tensor  # (M,) int64: flat index into the padded (B, T-1) layout
    dense: bool = False  # no row is padded: N = B x T

    def to(self, device: torch.device) -> Packed:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Packed(move(self.input_ids), move(self.position_ids), move(self.index), move(self.src),
                      move(self.targets), move(self.dst), self.dense)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> Packed:
    """(B, T) right-padded ids and mask, (B, T-1) loss mask -> :class:`Packed` (on the same device).

    Built from CPU tensors (``trainer.step`` does, before moving a micro-batch to the GPU) it costs the GPU
    nothing and runs in NumPy (torch's CPU indexing took milliseconds per call on the GPU machine); on GPU
    tensors its boolean indexing waits for the device."""
    if input_ids.device.type == "cpu":
        return _pack_numpy(input_ids.numpy(), attention_mask.numpy(), loss_mask.numpy())
    b, t = input_ids.shape
    lengths = attention_mask.sum(dim=1)
    keep = attention_mask.bool()
    starts = torch.cumsum(lengths, 0) - lengths  # (B,) packed offset of each row
    col = torch.arange(t, device=input_ids.device).expand(b, t)
    position_ids = col[keep].unsqueeze(0)
    index = torch.nonzero(keep.reshape(-1), as_tuple=True)[0]
    # loss position (row r, column c) predicts token c+1 from the hidden state at packed offset starts[r] + c
    rows, cols = torch.nonzero(loss_mask > 0, as_tuple=True)
    src = starts[rows] + cols
    return Packed(input_ids=input_ids[keep].unsqueeze(0), position_ids=position_ids, index=index, src=src,
                  targets=input_ids[rows, cols + 1], dst=rows * (t - 1) + cols, dense=index.numel() == b * t)


def _pack_numpy(input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray) -> Packed:
    """:func:`pack` on host arrays: the same layout, as CPU tensors."""
    b, t = input_ids.shape
    keep = attention_mask.astype(bool)
    lengths = keep.sum(axis=1)
    starts = np.cumsum(lengths) - lengths
    flat_keep = keep.reshape(-1)
    index = np.flatnonzero(flat_keep)
    position_ids = np.broadcast_to(np.arange(t), (b, t)).reshape(-1)[flat_keep]
    rows, cols = np.nonzero(loss_mask > 0)
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    return Packed(input_ids=as_t(input_ids.reshape(-1)[flat_keep]).unsqueeze(0), position_ids=as_t(position_ids).unsqueeze(0),
                  index=as_t(index), src=as_t(starts[rows] + cols), targets=as_t(input_ids[rows, cols + 1]),
                  dst=as_t(rows * (t - 1) + cols), dense=index.size == b * t)


# ------------------------------------------------------------------------------------------- LM head


class LinearLogprob(torch.autograd.Function):
    """(M, H) hidden, (V, H) LM head -> (M,) log p(target) and (M,) entropy, in chunks of rows.

    Forward keeps only the inputs and each row's log-sum-exp; backward recomputes each chunk's logits, so
    memory is one chunk of ``(rows x V)`` at a time. Logits are ``h @ W.T`` in the hidden states' dtype,
    divided by the temperature and normalised in float32 (or float64 for float64 inputs), as
    ``log_softmax(logits.float())`` does. The entropy carries no gradient. ``compiled``: the per-chunk
    softmax math (:func:`head_stats`, :func:`head_grad`) runs as ``torch.compile`` kernels that read the
    low-precision logits once instead of materialising float32 copies (GPUs; same math).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                temperature: torch.Tensor | float | None, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        m = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        if isinstance(temperature, torch.Tensor):  # (M,): each target's own sampling temperature
            temps = temperature.to(acc)
        else:
            temps = torch.full((m,), 1.0 if temperature is None else float(temperature), dtype=acc, device=hidden.device)
        stats, _ = _head_fns(compiled)
        w = weight.to(hidden.dtype)
        logp = torch.empty(m, dtype=acc, device=hidden.device)
        entropy = torch.empty(m, dtype=acc, device=hidden.device)
        lse = torch.empty(m, dtype=acc, device=hidden.device)
        for s in range(0, m, chunk):
            e = s + chunk
            logp[s:e], entropy[s:e], lse[s:e] = stats(hidden[s:e] @ w.t(), targets[s:e], temps[s:e])
        ctx.save_for_backward(hidden, weight, targets, temps, lse)
        ctx.chunk = chunk
        ctx.compiled = compiled
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        hidden, weight, targets, temps, lse = ctx.saved_tensors
        _, grad_fn = _head_fns(ctx.compiled)
        w = weight.to(hidden.dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=_acc_dtype(hidden.dtype), device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = s + ctx.chunk
            h = hidden[s:e]
            grad = grad_fn(h @ w.t(), targets[s:e], temps[s:e], lse[s:e], grad_logp[s:e])  # (rows, V), hidden's dtype
            if grad_hidden is not None:
                grad_hidden[s:e] = grad @ w
            if grad_weight is not None:
                grad_weight += (grad.t() @ h).to(grad_weight.dtype)
        return grad_hidden, (grad_weight.to(weight.dtype) if grad_weight is not None else None), None, None, None, None


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def head_stats(logits: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor):
    """One chunk: (rows, V) logits in the compute dtype, (rows,) targets and temperatures ->
    (rows,) log p(target), entropy and log-sum-exp, in float32 (float64 for float64 logits)."""
    x = logits.to(_acc_dtype(logits.dtype)) / temps[:, None]
    lse = torch.logsumexp(x, dim=-1)
    probs = torch.exp(x - lse[:, None])
    return x.gather(-1, targets[:, None])[:, 0] - lse, lse - (probs * x).sum(-1), lse


def head_grad(logits: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor, lse: torch.Tensor,
              grad_logp: torch.Tensor) -> torch.Tensor:
    """One chunk's gradient of ``sum(grad_logp * logp)`` with respect to the logits, in the logits' dtype:
    ``(onehot(target) - softmax(logits / T)) * grad_logp / T``."""
    x = logits.to(_acc_dtype(logits.dtype)) / temps[:, None]
    probs = torch.exp(x - lse[:, None])
    onehot = torch.arange(x.shape[-1], device=x.device)[None, :] == targets[:, None]
    return ((onehot.to(x.dtype) - probs) * (grad_logp / temps)[:, None]).to(logits.dtype)


_COMPILED: dict[str, object] = {}


def _head_fns(compiled: bool):
    if not compiled:
        return head_stats, head_grad
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(head_stats, dynamic=True)
        _COMPILED["grad"] = torch.compile(head_grad, dynamic=True)
    return _COMPILED["stats"], _COMPILED["grad"]


# ------------------------------------------------------------------------------------------- the model


def _logprobs_method(self: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, src: torch.Tensor,
                     targets: torch.Tensor, pad: tuple[torch.Tensor, int, int],
                     temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound to the model as ``agentrl_logprobs``: body on the packed rows, LM head at ``src`` only."""
    out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, agentrl_pad=pad)
    hidden = out.last_hidden_state[0].index_select(0, src)  # (M, H)
    weight = self.get_output_embeddings().weight
    chunk = max(1, CHUNK_ELEMENTS // int(weight.shape[0]))
    return LinearLogprob.apply(hidden, weight, targets, chunk, temperature, bool(getattr(self, COMPILED_HEAD, False)))


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Give ``model`` the packed forward method (call after ``fully_shard``; also fine without FSDP)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if not hasattr(model, "model") or not hasattr(model, "get_output_embeddings"):
        raise ValueError(f"{type(model).__name__}: packing needs a causal LM with a .model body and an LM head")
    setattr(model, METHOD, types.MethodType(_logprobs_method, model))
    register_fsdp_forward_method(model, METHOD)
    return model


def packed_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    loss_mask: torch.Tensor, *, with_entropy: bool = False,
                    temperature: float | torch.Tensor = 1.0,
                    packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like ``trainer.model.token_logprobs`` but computed only where ``loss_mask`` is 1 (0 elsewhere).

    (B, T) ids and attention mask (right-padded), (B, T-1) loss mask -> (B, T-1) logprobs (float32, with
    grad) and optionally (B, T-1) entropy. ``temperature``: one for all, or (B, T-1) per predicted token
    (the temperature it was sampled at): logprobs of ``softmax(logits / T)``. ``packed``: :func:`pack` of
    these tensors, made beforehand (on the CPU, so that the GPU never waits for it).
    """
    if not hasattr(model, METHOD):
        install(model)
    p = packed if packed is not None else pack(input_ids, attention_mask, loss_mask)
    b, t = input_ids.shape
    if isinstance(temperature, torch.Tensor):
        temps: torch.Tensor | None = temperature.reshape(-1)[p.dst]
    else:
        temps = None if temperature == 1.0 else torch.full(p.dst.shape, float(temperature), device=input_ids.device)
    logp_sel, ent_sel = getattr(model, METHOD)(p.input_ids, p.position_ids, p.src, p.targets, (p.index, b, t, p.dense),
                                               temps)
    logp = torch.zeros(b * (t - 1), dtype=torch.float32, device=input_ids.device).index_put((p.dst,), logp_sel)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(b * (t - 1), dtype=torch.float32, device=input_ids.device).index_put((p.dst,), ent_sel)
        entropy = entropy.view(b, t - 1)
    return logp.view(b, t - 1), entropy
