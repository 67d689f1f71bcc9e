"""Building blocks for store tests."""

from __future__ import annotations

from gateway.store import Interaction


def make_turn(
    turn_id: str,
    session_id: str,
    parent_id: str | None,
    *,
    prompt: list[int],
    output: list[int],
    chain_hash: str | None = None,
    request_hash: str | None = None,
    version: int = 0,
    created_at: float | None = None,
    **extra: object,
) -> Interaction:
    """A turn with per-token logprobs/versions derived from the output (so they can be checked)."""
    kwargs: dict[str, object] = {}
    if created_at is not None:
        kwargs["created_at"] = created_at
    return Interaction(
        id=turn_id,
        session_id=session_id,
        parent_id=parent_id,
        request={"messages": [{"role": "user", "content": f"msg for {turn_id}"}], "temperature": 1.0},
        response_message={"role": "assistant", "content": f"answer {turn_id}", "tool_calls": None},
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[-0.5 * (k + 1) for k in range(len(output))],
        output_versions=[version] * len(output),
        finish_reason="stop",
        chain_hash=chain_hash or f"chain-{turn_id}",
        request_hash=request_hash or f"req-{turn_id}",
        root_reason=None if parent_id else "first_turn",
        timings={"engine_ms": 1.5},
        **kwargs,
        **extra,  # type: ignore[arg-type]
    )

