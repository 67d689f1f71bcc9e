"""Multi-turn math agent with self-correction: the reference workload, written with the plain `openai` SDK.

The agent asks the question; if the answer is wrong (or cannot be parsed) it tells the model so and lets
it try again, up to ``max_turns``. Every turn is rewarded by its response id, so the gateway's tree holds
a path of turns with a reward on each, and the trainer can send credit back to the first turn.

Point it at the gateway with `agentrl.client`: reserve a group, and give each episode's OpenAI client to
the agent, with the episode's ``reward`` as the reward sink::

    import asyncio
    from agentrl.client import AsyncGateway
    from agents.datasets import Sample
    from agents.math_agent import run_math_agent

    async def main():
        sample = Sample(id="q1", question="What is 6 * 7?", answer="42")
        async with AsyncGateway("http://127.0.0.1:8000", "ADMIN_KEY") as gateway:
            async with gateway.group(sample.id, size=4) as group:   # finished when the block ends
                async def one(e):
                    async def post(response_id, reward):
                        await e.reward(reward, response_id=response_id)
                    return await run_math_agent(e.async_openai(), sample, model=e.model, rewards=post)
                episodes = await asyncio.gather(*(one(e) for e in group))
        print([[t.reward for t in ep.turns] for ep in episodes])

    asyncio.run(main())

Nothing here knows about the gateway beyond its URL: the same function works against any OpenAI-compatible
server (then pass ``rewards=None``).
"""

from __future__ import annotations

from openai import AsyncOpenAI

from agents.datasets import Sample
from agents.episode import Episode, RewardSink, Scorer, Turn, local_scorer

SYSTEM_PROMPT = (
    "You are a careful math assistant. Solve the problem step by step. "
    "End your reply with the final answer as a single number on its own line, written as: #### <number>"
)

CORRECTION = (
    "That answer is wrong, or I could not find a number in it. Read the question again, check each step "
    "of your work above, and answer again. End with the final number on its own line as: #### <number>"
)


async def run_math_agent(
    client: AsyncOpenAI,
    sample: Sample,
    *,
    model: str,
    max_turns: int = 2,
    temperature: float = 1.0,
    max_tokens: int = 256,
    score: Scorer = local_scorer,
    rewards: RewardSink | None = None,
    system_prompt: str = SYSTEM_PROMPT,
    correction: str = CORRECTION,
) -> Episode:
    """Ask ``sample.question``; on a wrong answer append ``correction`` and retry, up to ``max_turns``.

    Each turn's answer is scored with ``score(answer_text, sample.answer)`` and, when ``rewards`` is given,
    posted as that turn's reward. Stops at the first correct answer.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    messages: list[dict] = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": sample.question},
    ]
    episode = Episode()
    for _ in range(max_turns):
        response = await client.chat.completions.create(
            model=model, messages=messages, temperature=temperature, max_tokens=max_tokens,
        )
        choice = response.choices[0]
        content = choice.message.content or ""
        reward = await score(content, sample.answer)
        turn = Turn(response.id, content, choice.finish_reason or "", reward=reward)
        episode.turns.append(turn)
        if rewards is not None:
            await rewards(response.id, reward)
        if turn.correct:
            break
        # Continue the same conversation: the gateway finds the previous turn as this one's parent.
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": correction})
    return episode
