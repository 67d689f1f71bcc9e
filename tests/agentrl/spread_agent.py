"""An episode function for the short `agentrl up` runs of the tests (`--engine vllm`, `--lora-rank`).

The tiny random model never solves a real task, and a group whose rewards are all equal teaches nothing
(the trainer skips it: no push). So the reward is a spread-out function of the reply's text: the four
replies of a group, sampled at temperature 1 from a 49k-token vocabulary, all score the same only if four
different texts agree modulo 97 (about one group in a million), and every step trains and pushes.
"""

from __future__ import annotations


async def episode(client, task: dict) -> float:
    reply = await client.async_openai().chat.completions.create(
        model=client.model, temperature=client.temperature, max_tokens=8,
        messages=[{"role": "user", "content": task["question"]}])
    text = reply.choices[0].message.content or ""
    return (sum(map(ord, text)) % 97) / 97
