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

import torch

ATTENTION = "agentrl_packed"
METHOD = "agentrl_logprobs"
CHUNK_ELEMENTS = 2**28  # logits elements per LM-head chunk (1 GiB in float32)


# ------------------------------------------------------------------------------------------- attention


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: (B, H, T, D) q/k/v -> (B, T, H, D).

    With ``agentrl_pad = (index, rows, width)`` the batch is packed, ``(1, H, N, D)``: the tokens are spread
    to a right-padded ``(rows, H, width, D)`` layout (``index``: (N,) flat positions in ``rows x width``),
    attend causally row by row in one batched SDPA call, and are gathered back. Causal attention over
    right-padded rows never lets a real token see padding or another row, so this equals per-row attention;
    only attention itself pays for the padding, every other layer runs on the N real tokens. Without it:
    plain causal SDPA (a right-padded batch).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pad = kwargs.pop("agentrl_pad", None)
    kwargs.pop("is_causal", None)
    if pad is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=True, **kwargs)
    index, rows, width = pad

    def spread(x: torch.Tensor) -> torch.Tensor:  # (1, H, N, D) -> (rows, H, width, D)
        tokens = x[0].transpose(0, 1)  # (N, H, D)
        flat = tokens.new_zeros(rows * width, tokens.shape[1], tokens.shape[2]).index_copy(0, index, tokens)
        return flat.view(rows, width, tokens.shape[1], tokens.shape[2]).transpose(1, 2)

    out, _ = sdpa_attention_forward(module, spread(query), spread(key), spread(value), None, dropout=dropout,
                                    scaling=scaling, is_causal=True, **kwargs)  # (rows, width, H, D)
    return out.reshape(rows * width, out.shape[2], out.shape[3]).index_select(0, index).unsqueeze(0), None


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


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> Packed:
    """(B, T) right-padded ids and mask, (B, T-1) loss mask -> :class:`Packed` (on the same device)."""
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
                  targets=input_ids[rows, cols + 1], dst=rows * (t - 1) + cols)


# ------------------------------------------------------------------------------------------- LM head


class LinearLogprob(torch.autograd.Function):
    """(M, H) hidden, (V, H) LM head -> (M,) log p(target) and (M,) entropy, in chunks of rows.

    Forward keeps only the inputs; backward recomputes each chunk's logits, so memory is one chunk of
    ``(rows x V)`` at a time. Logits are ``h @ W.T / temperature`` in the hidden states' dtype, softmax in
    float32 (or float64 for float64 inputs), as ``log_softmax(logits.float())`` does. The entropy carries no gradient.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                temperature: torch.Tensor | float | None) -> tuple[torch.Tensor, torch.Tensor]:
        m = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        if isinstance(temperature, torch.Tensor):  # (M,): each target's own sampling temperature
            temps: torch.Tensor | None = temperature.to(acc)
        elif temperature is None or temperature == 1.0:
            temps = None
        else:
            temps = torch.full((m,), float(temperature), dtype=acc, device=hidden.device)
        logp = torch.empty(m, dtype=acc, device=hidden.device)
        entropy = torch.empty(m, dtype=acc, device=hidden.device)
        for s in range(0, m, chunk):
            logits = _chunk_logits(hidden[s:s + chunk], weight, None if temps is None else temps[s:s + chunk])
            lse = torch.logsumexp(logits, dim=-1)
            logp[s:s + chunk] = logits.gather(-1, targets[s:s + chunk, None])[:, 0] - lse
            probs = torch.softmax(logits, dim=-1)
            entropy[s:s + chunk] = lse - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, temps if temps is not None else torch.ones(m, dtype=acc, device=hidden.device))
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        hidden, weight, targets, temps = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=_acc_dtype(hidden.dtype), device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            t = temps[s:s + ctx.chunk]
            probs = torch.softmax(_chunk_logits(h, weight, t), dim=-1)
            # d logp / d logits = onehot(target) - softmax; chain through the 1/T scale and the upstream grad
            grad = probs.neg_()
            grad.scatter_add_(-1, targets[s:s + ctx.chunk, None], torch.ones_like(grad[:, :1]))
            grad.mul_((grad_logp[s:s + ctx.chunk] / t)[:, None])
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s:s + ctx.chunk] = grad @ weight.to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad.t() @ h).to(grad_weight.dtype)
        return grad_hidden, (grad_weight.to(weight.dtype) if grad_weight is not None else None), None, None, None


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """``temperature``: (rows,) the sampling temperature of each row's target, or None for 1."""
    logits = (hidden @ weight.to(hidden.dtype).t()).to(_acc_dtype(hidden.dtype))
    return logits / temperature[:, None] if temperature is not None else logits


# ------------------------------------------------------------------------------------------- the model


def _logprobs_method(self: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, src: torch.Tensor,
                     targets: torch.Tensor, pad: tuple[torch.Tensor, int, int],
                     temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound to the model as ``agentrl_logprobs``: body on the packed rows, LM head at ``src`` only."""
    out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, agentrl_pad=pad)
    hidden = out.last_hidden_state[0].index_select(0, src)  # (M, H)
    weight = self.get_output_embeddings().weight
    chunk = max(1, CHUNK_ELEMENTS // int(weight.shape[0]))
    return LinearLogprob.apply(hidden, weight, targets, chunk, temperature)


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
                    temperature: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like ``trainer.model.token_logprobs`` but computed only where ``loss_mask`` is 1 (0 elsewhere).

    (B, T) ids and attention mask (right-padded), (B, T-1) loss mask -> (B, T-1) logprobs (float32, with
    grad) and optionally (B, T-1) entropy. ``temperature``: one for all, or (B, T-1) per predicted token
    (the temperature it was sampled at): logprobs of ``softmax(logits / T)``.
    """
    if not hasattr(model, METHOD):
        install(model)
    p = pack(input_ids, attention_mask, loss_mask)
    b, t = input_ids.shape
    if isinstance(temperature, torch.Tensor):
        temps: torch.Tensor | None = temperature.reshape(-1)[p.dst]
    else:
        temps = None if temperature == 1.0 else torch.full(p.dst.shape, float(temperature), device=input_ids.device)
    logp_sel, ent_sel = getattr(model, METHOD)(p.input_ids, p.position_ids, p.src, p.targets, (p.index, b, t),
                                               temps)
    logp = torch.zeros(b * (t - 1), dtype=torch.float32, device=input_ids.device).index_put((p.dst,), logp_sel)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(b * (t - 1), dtype=torch.float32, device=input_ids.device).index_put((p.dst,), ent_sel)
        entropy = entropy.view(b, t - 1)
    return logp.view(b, t - 1), entropy
