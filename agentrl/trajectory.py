"""The trajectory wire format: conversation trees in, training rows out, and their binary batch encoding.

This is the one module that owns the format; the gateway (export, leasing) and the trainer (decoding)
both import it. It is pure: no I/O, no gateway imports, only numpy.

A session is a tree of turns (interactions). Each turn stores only the token *delta* beyond its parent:
``prompt_ids`` (bridge tokens + newly rendered messages + generation prompt; the whole prompt for a root)
and ``output_ids`` (what the model generated). The full token sequence of a turn is therefore the
concatenation of ``prompt_ids + output_ids`` of every turn on its root-to-turn path.

Two export modes:

* :func:`export_concat` (default) -- one row per leaf: every turn on the root-to-leaf path concatenated.
* :func:`export_individual` -- one row per turn: the turn's full prompt (its ancestors' tokens, all
  masked) followed by its output.

Per-token columns of a row: ``input_ids``; ``loss_mask`` (1 exactly on model-generated tokens, 0 on
prompts, tool results and bridge tokens); ``logprobs`` (behaviour logprobs, 0 elsewhere); ``versions``
(weight version that generated the token, -1 elsewhere); ``turn_ids`` (index of the turn within the row's
``turn_rewards`` on generated tokens, -1 elsewhere).

Sampling: ``turn_temperatures`` holds, per trained turn (the same index as ``turn_rewards``), the
temperature its tokens were sampled at (greedy = 1: engines report temperature-1 logprobs for greedy
rows), so the trainer computes its logprobs of token ``t`` as ``log_softmax(logits / T)``, the
distribution the engine's behaviour logprobs come from (:meth:`Row.token_temperatures`). Nucleus
(``top_p < 1``) or top-k filtering is refused: the trainer does not recompute under a filter, so such a
session is not exported for training (:class:`UntrainableSampling`, a clear error in the gateway's log);
so are sessions sampled under penalties or a grammar (``response_format``, a forced ``tool_choice``,
``regex``, ``ebnf``: the engine reports the masked, renormalised logprobs, which the trainer does not
recompute).

Group identity: ``group_key`` is the key of the exported GRPO group (a group id cut into chunks of the
group size gives one key per chunk); the trainer normalises advantages by it (:attr:`Row.grpo_group`).

Rewards are discounted along each root-to-leaf path only, so sibling branches never leak into each other:
``turn_returns[t] = turn_rewards[t] + gamma * turn_returns[t+1]`` with a missing reward counted as 0.
``reward`` is ``turn_returns[0]`` (``reward_mode="discounted"``) or the leaf's reward
(``reward_mode="last"``). Raw rewards (``turn_rewards``) are never replaced by returns.

Retries: a leaf turn whose ``request_hash`` equals that of another turn of the session that has children
(the agent re-sent the same messages and continued from the other answer) is an abandoned retry; it is
dropped from both export modes. The ``n`` choices of one request (same ``request_id``) are samples, not
retries: all of them are kept, whichever was continued.

The binary batch layout is documented at :func:`encode_batch` and in ``docs/export.md``.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

RewardMode = Literal["discounted", "last"]
REWARD_MODES: tuple[str, ...] = ("discounted", "last")
EXPORT_MODES: tuple[str, ...] = ("concat", "individual")
TRUNCATED_FINISH_REASONS = frozenset({"length", "abort"})
GREEDY_TEMPERATURE = 1e-6  # below this a temperature means greedy decoding


class UntrainableSampling(ValueError):
    """A turn was sampled under a filter (``top_p < 1`` or top-k), penalties or a grammar mask whose
    logprobs the trainer cannot recompute; its session is not exported for training."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One recorded turn of a session, as the exporter needs it (a light view of the store's Interaction).

    ``prompt_ids``: tokens beyond the parent's prompt+output (the whole prompt for a root); the first
    ``bridge_len`` of them are end-of-turn tokens added because the parent was cut by length.
    ``logprobs`` and ``versions`` have one entry per output token.
    """

    id: str
    parent_id: str | None
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    bridge_len: int = 0
    finish_reason: str = "stop"
    reward: float | None = None
    request_hash: str = ""
    created_at: float = 0.0
    request_id: str = ""  # shared by the n choices of one request ("" = the turn's own id)
    temperature: float = 1.0  # effective: greedy (0) is recorded as 1, the distribution engines report
    top_p: float = 1.0
    top_k: int = -1
    penalties: tuple[str, ...] = ()  # names of the penalties it was sampled under (gateway.constraints)
    grammar: str = ""  # what constrained it, e.g. "json_schema (response_format)"; "" = unconstrained
    thread: str = ""  # its episode thread segment ("thread#segment", gateway.episodes); "" = not labelled

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", np.asarray(self.prompt_ids, dtype=np.int32))
        object.__setattr__(self, "output_ids", np.asarray(self.output_ids, dtype=np.int32))
        object.__setattr__(self, "logprobs", np.asarray(self.logprobs, dtype=np.float32))
        object.__setattr__(self, "versions", np.asarray(self.versions, dtype=np.int32))
        n_out = len(self.output_ids)
        if len(self.logprobs) != n_out or len(self.versions) != n_out:
            raise ValueError(
                f"turn {self.id}: {n_out} output tokens but {len(self.logprobs)} logprobs and "
                f"{len(self.versions)} versions; each output token needs one of each"
            )
        if not 0 <= self.bridge_len <= len(self.prompt_ids):
            raise ValueError(f"turn {self.id}: bridge_len {self.bridge_len} outside its {len(self.prompt_ids)} prompt tokens")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"turn {self.id}: reward {self.reward!r} is not a finite number")


def turn_from_interaction(record: Any) -> Turn:
    """A :class:`Turn` from any object with the store's ``Interaction`` attributes (duck-typed, so that
    this module does not import the gateway): ``id, parent_id, prompt_ids, output_ids, output_logprobs,
    output_versions, bridge_len, finish_reason, reward, request_hash, created_at``."""
    return Turn(
        id=record.id,
        parent_id=record.parent_id,
        prompt_ids=record.prompt_ids,
        output_ids=record.output_ids,
        logprobs=record.output_logprobs,
        versions=record.output_versions,
        bridge_len=record.bridge_len,
        finish_reason=record.finish_reason,
        reward=record.reward,
        request_hash=record.request_hash,
        created_at=record.created_at,
        request_id=str((getattr(record, "request", None) or {}).get("request_id") or ""),
        thread=thread_of(getattr(record, "request", None)),
        **sampling_of(getattr(record, "request", None)),
    )


def thread_of(request: Any) -> str:
    """``"thread#segment"`` of a turn recorded with an episode label (``request["episode"]``), else ``""``."""
    label = request.get("episode") if isinstance(request, dict) else None
    if not isinstance(label, dict) or "thread" not in label:
        return ""
    return f"{label['thread']}#{label.get('segment', '0')}"


def episode_reward(turns: Sequence[Turn], rows: list[Row], session_reward: float | None) -> None:
    """An episode of several threads or segments (a coding agent's sub-agents, its compacted windows) is ONE
    sample with one outcome: every row gets the episode's reward (the session's reward, else the mean of
    the rows' own), so that the trainer gives all of them one advantage. Per-turn rewards and returns stay
    as they are. Sessions of one thread are left alone."""
    if len({t.thread for t in turns if t.thread}) < 2 or not rows:
        return
    reward = float(session_reward) if session_reward is not None else float(np.mean([r.reward for r in rows]))
    for row in rows:
        row.reward = reward


def sampling_of(request: Any) -> dict[str, Any]:
    """``temperature`` (effective), ``top_p``, ``top_k``, penalties and grammar of a recorded request's
    ``params`` (the OpenAI defaults where the client sent none). Raises ValueError for values that are not
    numbers."""
    params = (request or {}).get("params") or {} if isinstance(request, dict) else {}
    temperature = params.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    if temperature < GREEDY_TEMPERATURE:
        temperature = 1.0
    top_p = params.get("top_p")
    top_k = params.get("top_k")
    return {"temperature": temperature, "top_p": 1.0 if top_p is None else float(top_p),
            "top_k": -1 if top_k is None else int(top_k),
            "penalties": tuple(sorted(k for k in PENALTY_PARAMS if params.get(k))),
            "grammar": _grammar_of(params)}


def _grammar_of(params: dict[str, Any]) -> str:
    """``"kind (origin)"`` of a recorded grammar constraint (``params.grammar``), "" for none."""
    grammar = params.get("grammar")
    if not isinstance(grammar, dict):
        return ""
    return f"{grammar.get('kind', 'grammar')} ({grammar.get('origin', 'request')})"


# penalties recorded in a turn's params (gateway.constraints.penalties_json): the engine sampled from the
# penalised distribution and reported its logprobs; the trainer recomputes unpenalised ones
PENALTY_PARAMS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens")


@dataclass(slots=True)
class Row:
    """One training row. Per-token arrays all have the same length; per-turn arrays one entry per turn."""

    input_ids: np.ndarray  # (T,) int32
    loss_mask: np.ndarray  # (T,) int8, 1 on generated tokens
    logprobs: np.ndarray  # (T,) float32, behaviour logprobs, 0 elsewhere
    versions: np.ndarray  # (T,) int32, -1 elsewhere
    turn_ids: np.ndarray  # (T,) int32, index into turn_rewards on generated tokens, -1 elsewhere
    turn_rewards: np.ndarray  # (K,) float64, raw rewards (missing = 0)
    turn_returns: np.ndarray  # (K,) float64, discounted along the path
    reward: float
    is_truncated: bool
    session_id: str
    group_id: str
    leaf_id: str
    row_id: str
    task_id: str | None = None
    turn_interaction_ids: list[str] = field(default_factory=list)
    turn_temperatures: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))  # (K,) f32; empty = all 1
    group_key: str = ""  # the exported GRPO group's key ("" in rows built before export: group_id stands in)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def grpo_group(self) -> str:
        """What advantages are normalised over: the exported group's key, else its group id."""
        return self.group_key or self.group_id

    def token_temperatures(self) -> np.ndarray:
        """(T,) float32 sampling temperature of each token (1 where the model generated nothing)."""
        out = np.ones(self.num_tokens, dtype=np.float32)
        if len(self.turn_temperatures):
            gen = self.turn_ids >= 0
            out[gen] = np.asarray(self.turn_temperatures, dtype=np.float32)[self.turn_ids[gen]]
        return out

    @property
    def min_version(self) -> int:
        """Oldest weight version among the generated tokens (-1 if the row generated nothing)."""
        gen = self.versions[self.loss_mask.astype(bool)]
        return int(gen.min()) if gen.size else -1


# --------------------------------------------------------------------------------------------- trees


def _children_index(turns: Sequence[Turn]) -> tuple[dict[str, Turn], dict[str | None, list[Turn]]]:
    by_id: dict[str, Turn] = {}
    for turn in turns:
        if turn.id in by_id:
            raise ValueError(f"turn id {turn.id} appears twice in one session")
        by_id[turn.id] = turn
    children: dict[str | None, list[Turn]] = {}
    for turn in turns:
        if turn.parent_id is not None and turn.parent_id not in by_id:
            raise ValueError(
                f"turn {turn.id}: parent {turn.parent_id} is not among the session's turns "
                "(export a session only once all of its turns are recorded)"
            )
        children.setdefault(turn.parent_id, []).append(turn)
    for kids in children.values():
        kids.sort(key=lambda t: (t.created_at, t.id))
    return by_id, children


def abandoned_retries(turns: Sequence[Turn]) -> set[str]:
    """Ids of leaf turns abandoned in favour of a retry of the same request that was continued.

    A retry is another *request* with the same messages: the ``n`` choices of one request (same
    ``request_id``) are samples, siblings that are all kept whichever of them was continued."""
    _, children = _children_index(turns)
    continued: dict[str, set[str]] = {}
    for t in turns:
        if t.request_hash and children.get(t.id):
            continued.setdefault(t.request_hash, set()).add(t.request_id or t.id)
    return {t.id for t in turns if not children.get(t.id) and t.request_hash in continued
            and (t.request_id or t.id) not in continued[t.request_hash]}


def _kept_tree(turns: Sequence[Turn]) -> tuple[dict[str, Turn], dict[str | None, list[Turn]]]:
    dropped = abandoned_retries(turns)
    kept = [t for t in turns if t.id not in dropped]
    return _children_index(kept)


def _path(by_id: dict[str, Turn], leaf: Turn) -> list[Turn]:
    path = [leaf]
    while path[-1].parent_id is not None:
        path.append(by_id[path[-1].parent_id])
        if len(path) > len(by_id):
            raise ValueError(f"turn {leaf.id}: parent chain has a cycle")
    path.reverse()
    return path


def discounted_returns(rewards: Sequence[float] | np.ndarray, gamma: float) -> np.ndarray:
    """``returns[t] = rewards[t] + gamma * returns[t+1]`` along one path (float64)."""
    out = np.zeros(len(rewards), dtype=np.float64)
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[t]) + gamma * acc
        out[t] = acc
    return out


def _check_options(gamma: float, reward_mode: str, session_reward: float | None) -> None:
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be within [0, 1], got {gamma}")
    if reward_mode not in REWARD_MODES:
        raise ValueError(f"unknown reward_mode {reward_mode!r}; valid: {', '.join(REWARD_MODES)}")
    if session_reward is not None and not math.isfinite(session_reward):
        raise ValueError(f"session_reward {session_reward!r} is not a finite number")


def _raw_reward(turn: Turn, is_leaf: bool, session_reward: float | None) -> float:
    """A turn's reward; a session-level reward stands in for a leaf that has none of its own."""
    if turn.reward is not None:
        return float(turn.reward)
    if is_leaf and session_reward is not None:
        return float(session_reward)
    return 0.0


def _assemble(path: Sequence[Turn], trained: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Concatenate a path's tokens; only turns whose path index is in ``trained`` get loss/logprob/version."""
    sizes = [len(t.prompt_ids) + len(t.output_ids) for t in path]
    total = sum(sizes)
    input_ids = np.empty(total, dtype=np.int32)
    loss_mask = np.zeros(total, dtype=np.int8)
    logprobs = np.zeros(total, dtype=np.float32)
    versions = np.full(total, -1, dtype=np.int32)
    turn_ids = np.full(total, -1, dtype=np.int32)
    pos = 0
    for index, turn in enumerate(path):
        n_prompt, n_out = len(turn.prompt_ids), len(turn.output_ids)
        input_ids[pos : pos + n_prompt] = turn.prompt_ids
        pos += n_prompt
        input_ids[pos : pos + n_out] = turn.output_ids
        if index in trained:
            loss_mask[pos : pos + n_out] = 1
            logprobs[pos : pos + n_out] = turn.logprobs
            versions[pos : pos + n_out] = turn.versions
            turn_ids[pos : pos + n_out] = trained.index(index)
        pos += n_out
    return input_ids, loss_mask, logprobs, versions, turn_ids


def export_concat(
    turns: Sequence[Turn],
    *,
    gamma: float,
    reward_mode: RewardMode = "discounted",
    session_reward: float | None = None,
    session_id: str = "",
    group_id: str = "",
    task_id: str | None = None,
) -> list[Row]:
    """One row per leaf (abandoned retries excluded), every turn of its root-to-leaf path concatenated.

    ``turn_ids`` on generated tokens is the turn's index along the path, so ``turn_rewards[turn_ids]``
    gives each generated token its turn's reward. Rows come in leaf creation order.
    """
    _check_options(gamma, reward_mode, session_reward)
    by_id, children = _kept_tree(turns)
    leaves = sorted((t for t in by_id.values() if not children.get(t.id)), key=lambda t: (t.created_at, t.id))
    rows = []
    for leaf in leaves:
        path = _path(by_id, leaf)
        rewards = np.array([_raw_reward(t, t is leaf, session_reward) for t in path], dtype=np.float64)
        returns = discounted_returns(rewards, gamma)
        input_ids, loss_mask, logprobs, versions, turn_ids = _assemble(path, list(range(len(path))))
        rows.append(
            Row(
                input_ids=input_ids,
                loss_mask=loss_mask,
                logprobs=logprobs,
                versions=versions,
                turn_ids=turn_ids,
                turn_rewards=rewards,
                turn_returns=returns,
                reward=float(returns[0] if reward_mode == "discounted" else rewards[-1]),
                is_truncated=leaf.finish_reason in TRUNCATED_FINISH_REASONS,
                session_id=session_id,
                group_id=group_id,
                leaf_id=leaf.id,
                row_id=f"concat:{session_id}:{leaf.id}",
                task_id=task_id,
                turn_interaction_ids=[t.id for t in path],
                turn_temperatures=np.array([t.temperature for t in path], dtype=np.float32),
            )
        )
    return rows


def export_individual(
    turns: Sequence[Turn],
    *,
    gamma: float,
    reward_mode: RewardMode = "discounted",
    session_reward: float | None = None,
    session_id: str = "",
    group_id: str = "",
    task_id: str | None = None,
) -> list[Row]:
    """One row per turn (abandoned retries excluded): the turn's full prompt, then its output.

    Only the turn's own output is trained (loss_mask 1, ``turn_ids`` 0); its ancestors' outputs are part
    of the prompt and masked. A turn's return is its reward plus gamma times the *mean* return of its
    kept children; on a linear conversation that equals the path return of :func:`export_concat`, and a
    branch point averages its branches rather than mixing one branch's reward into another.
    ``reward_mode="last"`` gives the mean leaf reward below the turn. ``leaf_id`` is the turn's own id.
    """
    _check_options(gamma, reward_mode, session_reward)
    by_id, children = _kept_tree(turns)
    order = sorted(by_id.values(), key=lambda t: (t.created_at, t.id))

    returns: dict[str, float] = {}
    last: dict[str, float] = {}

    def visit(turn: Turn) -> None:
        kids = children.get(turn.id, [])
        for kid in kids:
            if kid.id not in returns:
                visit(kid)
        own = _raw_reward(turn, not kids, session_reward)
        if kids:
            returns[turn.id] = own + gamma * float(np.mean([returns[k.id] for k in kids]))
            last[turn.id] = float(np.mean([last[k.id] for k in kids]))
        else:
            returns[turn.id] = own
            last[turn.id] = own

    for turn in order:
        if turn.id not in returns:
            # Walk from the root so that recursion depth is bounded by the tree depth.
            visit(_path(by_id, turn)[0])

    rows = []
    for turn in order:
        path = _path(by_id, turn)
        is_leaf = not children.get(turn.id)
        input_ids, loss_mask, logprobs, versions, turn_ids = _assemble(path, [len(path) - 1])
        rows.append(
            Row(
                input_ids=input_ids,
                loss_mask=loss_mask,
                logprobs=logprobs,
                versions=versions,
                turn_ids=turn_ids,
                turn_rewards=np.array([_raw_reward(turn, is_leaf, session_reward)], dtype=np.float64),
                turn_returns=np.array([returns[turn.id]], dtype=np.float64),
                reward=returns[turn.id] if reward_mode == "discounted" else last[turn.id],
                is_truncated=turn.finish_reason in TRUNCATED_FINISH_REASONS,
                session_id=session_id,
                group_id=group_id,
                leaf_id=turn.id,
                row_id=f"individual:{session_id}:{turn.id}",
                task_id=task_id,
                turn_interaction_ids=[turn.id],
                turn_temperatures=np.array([turn.temperature], dtype=np.float32),
            )
        )
    return rows


def check_trainable(turns: Sequence[Turn]) -> None:
    """Raise :class:`UntrainableSampling` if a kept turn was sampled under top-p / top-k filtering, under
    penalties (``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``,
    ``min_tokens``) or under a grammar (``response_format``, a forced ``tool_choice``, ``regex``, ``ebnf``)."""
    by_id, _ = _kept_tree(turns)
    for t in sorted(by_id.values(), key=lambda t: (t.created_at, t.id)):
        if t.top_p < 1.0 or t.top_k > 0:
            raise UntrainableSampling(
                f"turn {t.id} was sampled with top_p={t.top_p}, top_k={t.top_k}: the trainer recomputes "
                "logprobs of the whole (temperature-scaled) distribution, not of a filtered one, so every "
                "importance weight would be wrong; sample training sessions with top_p=1 and no top_k "
                "(temperature is fine), or mark the session metadata.eval")
        if t.penalties:
            raise UntrainableSampling(
                f"turn {t.id} was sampled under {', '.join(t.penalties)}: its behaviour logprobs are those of "
                "the penalised distribution, which the trainer does not recompute (it recomputes "
                "log_softmax(logits / T)), so every importance weight would be wrong; sample training sessions "
                "without penalties or logit_bias, or mark the session metadata.eval")
        if t.grammar:
            raise UntrainableSampling(
                f"turn {t.id} was sampled under a grammar ({t.grammar}): its behaviour logprobs are those of the "
                "masked distribution (renormalised over the tokens the grammar allowed), which the trainer does "
                "not recompute (it recomputes log_softmax(logits / T) over the whole vocabulary), so every "
                "importance weight would be wrong; sample training sessions without response_format / forced "
                "tool_choice / regex / ebnf, or mark the session metadata.eval")


def export_session(turns: Sequence[Turn], *, mode: str = "concat", **kwargs: Any) -> list[Row]:
    """Dispatch to :func:`export_concat` or :func:`export_individual` by name (after
    :func:`check_trainable`); the rows of an episode of several threads share its reward
    (:func:`episode_reward`)."""
    check_trainable(turns)
    if mode == "concat":
        rows = export_concat(turns, **kwargs)
    elif mode == "individual":
        rows = export_individual(turns, **kwargs)
    else:
        raise ValueError(f"unknown export mode {mode!r}; valid: {', '.join(EXPORT_MODES)}")
    episode_reward(turns, rows, kwargs.get("session_reward"))
    return rows


# ------------------------------------------------------------------------------------- binary batches

MEDIA_TYPE = "application/vnd.agentrl.trajectories"  # content type of GET /v1/trajectories
LEASE_HEADER = "X-Agentrl-Lease-Id"  # the lease id, also in the batch's meta["lease_id"]
MAGIC = b"AGRLTRJ1"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIIQ")  # magic, format version, reserved (0), header length
_ALIGN = 8

# name -> (dtype, axis): "token" columns have sum(n_tokens) entries, "turn" columns sum(n_turns), "row" n_rows.
COLUMNS: dict[str, tuple[str, str]] = {
    "input_ids": ("<i4", "token"),
    "loss_mask": ("<i1", "token"),
    "logprobs": ("<f4", "token"),
    "versions": ("<i4", "token"),
    "turn_ids": ("<i4", "token"),
    "turn_rewards": ("<f8", "turn"),
    "turn_returns": ("<f8", "turn"),
    "turn_temperatures": ("<f4", "turn"),
    "n_tokens": ("<i4", "row"),
    "n_turns": ("<i4", "row"),
    "reward": ("<f8", "row"),
    "is_truncated": ("<i1", "row"),
}
_STRING_FIELDS = ("session_id", "group_id", "leaf_id", "row_id", "task_id", "group_key")
# Filled in when a batch written before the column existed is read (queued groups survive an upgrade).
_STRING_DEFAULTS = {"group_key": ""}


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def encode_batch(rows: Sequence[Row], meta: dict[str, Any] | None = None) -> bytes:
    """Encode rows + JSON-able metadata into one buffer.

    Layout (all integers little-endian)::

        offset 0   8 bytes  magic b"AGRLTRJ1"
                   u32      format version (1)
                   u32      reserved (0)
                   u64      H = length of the JSON header in bytes
        24         H bytes  JSON header, UTF-8, then zero padding to a multiple of 8
        D          data section: one contiguous array per column, each starting on an 8-byte boundary

    The JSON header is ``{"meta": {...}, "n_rows": R, "strings": {"session_id": [...], "group_id": [...],
    "leaf_id": [...], "row_id": [...], "task_id": [...], "turn_interaction_ids": [[...], ...]},
    "columns": {name: {"dtype": "<i4", "offset": o, "count": c}}}`` where ``offset`` is relative to D.
    Token columns (input_ids, loss_mask, logprobs, versions, turn_ids) hold every row's tokens back to back
    (row i spans ``cumsum(n_tokens)[i-1] : cumsum(n_tokens)[i]``); turn columns (turn_rewards,
    turn_returns) likewise by ``n_turns``; row columns (n_tokens, n_turns, reward, is_truncated) have one
    entry per row. Numbers never appear as JSON lists.
    """
    n_tokens = np.array([r.num_tokens for r in rows], dtype=np.int32)
    n_turns = np.array([len(r.turn_rewards) for r in rows], dtype=np.int32)
    for r in rows:
        if len(r.turn_temperatures) not in (0, len(r.turn_rewards)):
            raise ValueError(f"row {r.row_id}: turn_temperatures has {len(r.turn_temperatures)} entries for "
                             f"{len(r.turn_rewards)} turns")
        lengths = {len(r.loss_mask), len(r.logprobs), len(r.versions), len(r.turn_ids)}
        if lengths != {r.num_tokens} or len(r.turn_returns) != len(r.turn_rewards):
            raise ValueError(f"row {r.row_id}: per-token or per-turn arrays differ in length")

    def cat(name: str, dtype: str) -> np.ndarray:
        if name == "turn_temperatures":
            parts = [r.turn_temperatures if len(r.turn_temperatures) else np.ones(len(r.turn_rewards), np.float32)
                     for r in rows]
        else:
            parts = [getattr(r, name) for r in rows]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

    arrays: dict[str, np.ndarray] = {}
    for name, (dtype, axis) in COLUMNS.items():
        if name == "n_tokens":
            arrays[name] = n_tokens.astype(dtype, copy=False)
        elif name == "n_turns":
            arrays[name] = n_turns.astype(dtype, copy=False)
        elif axis == "row":
            arrays[name] = np.array([getattr(r, name) for r in rows], dtype=dtype)
        else:
            arrays[name] = cat(name, dtype)

    strings: dict[str, Any] = {f: [getattr(r, f) for r in rows] for f in _STRING_FIELDS}
    strings["turn_interaction_ids"] = [list(r.turn_interaction_ids) for r in rows]
    return _pack(arrays, strings, len(rows), meta)


def _pack(arrays: dict[str, np.ndarray], strings: dict[str, Any], n_rows: int, meta: dict[str, Any] | None) -> bytes:
    columns: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, arr in arrays.items():
        columns[name] = {"dtype": COLUMNS[name][0], "offset": offset, "count": int(arr.shape[0])}
        offset += arr.nbytes + _pad(arr.nbytes)
    header = json.dumps(
        {"meta": meta or {}, "n_rows": n_rows, "strings": strings, "columns": columns},
        separators=(",", ":"),
    ).encode()

    out = bytearray(_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header)))
    out += header
    out += b"\0" * _pad(len(out))
    for name, arr in arrays.items():
        out += arr.astype(COLUMNS[name][0], copy=False).tobytes()
        out += b"\0" * _pad(arr.nbytes)
    return bytes(out)


def decode_columns(data: bytes | bytearray | memoryview) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Decode a batch into zero-copy column arrays plus the parsed JSON header (``meta``, ``strings``)."""
    buf = memoryview(data)
    if len(buf) < _PREFIX.size:
        raise ValueError("trajectory batch is shorter than its fixed prefix")
    magic, version, _, header_len = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ValueError(f"not an agentrl trajectory batch (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise ValueError(f"trajectory batch format {version} is not supported (this reader knows {FORMAT_VERSION})")
    start = _PREFIX.size
    if start + header_len > len(buf):
        raise ValueError("trajectory batch header runs past the end of the buffer")
    header = json.loads(bytes(buf[start : start + header_len]))
    data_start = start + header_len + _pad(start + header_len)
    columns: dict[str, np.ndarray] = {}
    for name, spec in header["columns"].items():
        dtype = np.dtype(spec["dtype"])
        begin = data_start + spec["offset"]
        if begin + dtype.itemsize * spec["count"] > len(buf):
            raise ValueError(f"column {name} runs past the end of the trajectory batch")
        columns[name] = np.frombuffer(buf, dtype=dtype, count=spec["count"], offset=begin)
    if "turn_temperatures" not in columns:  # written before the column existed: temperature 1
        columns["turn_temperatures"] = np.ones(int(columns["n_turns"].sum()), dtype=np.float32)
    for name, default in _STRING_DEFAULTS.items():
        header["strings"].setdefault(name, [default] * header["n_rows"])
    return columns, header


def decode_batch(data: bytes | bytearray | memoryview) -> tuple[list[Row], dict[str, Any]]:
    """Inverse of :func:`encode_batch`: ``(rows, meta)``. Row arrays are read-only views into ``data``."""
    cols, header = decode_columns(data)
    strings = header["strings"]
    tok_end = np.cumsum(cols["n_tokens"], dtype=np.int64)
    turn_end = np.cumsum(cols["n_turns"], dtype=np.int64)
    rows = []
    for i in range(header["n_rows"]):
        t0 = int(tok_end[i - 1]) if i else 0
        t1 = int(tok_end[i])
        k0 = int(turn_end[i - 1]) if i else 0
        k1 = int(turn_end[i])
        rows.append(
            Row(
                input_ids=cols["input_ids"][t0:t1],
                loss_mask=cols["loss_mask"][t0:t1],
                logprobs=cols["logprobs"][t0:t1],
                versions=cols["versions"][t0:t1],
                turn_ids=cols["turn_ids"][t0:t1],
                turn_rewards=cols["turn_rewards"][k0:k1],
                turn_returns=cols["turn_returns"][k0:k1],
                reward=float(cols["reward"][i]),
                is_truncated=bool(cols["is_truncated"][i]),
                session_id=strings["session_id"][i],
                group_id=strings["group_id"][i],
                leaf_id=strings["leaf_id"][i],
                row_id=strings["row_id"][i],
                task_id=strings["task_id"][i],
                turn_interaction_ids=list(strings["turn_interaction_ids"][i]),
                turn_temperatures=cols["turn_temperatures"][k0:k1],
                group_key=strings["group_key"][i],
            )
        )
    return rows, header["meta"]


def merge_batches(blobs: Sequence[bytes], meta: dict[str, Any] | None = None) -> bytes:
    """Concatenate encoded batches into one (column by column, without building Row objects)."""
    decoded = [decode_columns(b) for b in blobs]
    arrays = {
        name: np.concatenate([cols[name] for cols, _ in decoded]) if decoded else np.zeros(0, dtype=dtype)
        for name, (dtype, _) in COLUMNS.items()
    }
    strings: dict[str, list[Any]] = {f: [] for f in (*_STRING_FIELDS, "turn_interaction_ids")}
    for _, header in decoded:
        for name, values in header["strings"].items():
            strings[name].extend(values)
    n_rows = sum(header["n_rows"] for _, header in decoded)
    return _pack(arrays, strings, n_rows, meta)


def rows_to_json(rows: Iterable[Row], meta: dict[str, Any] | None = None) -> bytes:
    """The naive JSON-lists encoding (for comparison in bench/export.py only; never on the wire)."""
    return json.dumps(
        {
            "meta": meta or {},
            "rows": [
                {
                    "input_ids": r.input_ids.tolist(),
                    "loss_mask": r.loss_mask.tolist(),
                    "logprobs": r.logprobs.tolist(),
                    "versions": r.versions.tolist(),
                    "turn_ids": r.turn_ids.tolist(),
                    "turn_rewards": r.turn_rewards.tolist(),
                    "turn_returns": r.turn_returns.tolist(),
                    "reward": r.reward,
                    "is_truncated": r.is_truncated,
                    "session_id": r.session_id,
                    "group_id": r.group_id,
                    "leaf_id": r.leaf_id,
                    "row_id": r.row_id,
                    "task_id": r.task_id,
                }
                for r in rows
            ],
        }
    ).encode()


def stable_id(*parts: str) -> str:
    """A short stable hash of some strings (used for lease and group ids that must not depend on order)."""
    return hashlib.sha1("\x1f".join(parts).encode()).hexdigest()[:16]
