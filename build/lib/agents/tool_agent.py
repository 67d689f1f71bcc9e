"""Tool-calling agent: the model may call a `calculator` (and any tools you pass) before it answers.

Each turn the model either answers or asks for tools. The agent runs *all* tool calls of the turn (at the
same time, with ``asyncio.gather``, when there are several), appends one ``tool`` message per call with
the matching ``tool_call_id``, and asks again, until the model answers or ``max_turns`` is reached. The
answer is scored and its reward posted against the answering turn's response id; the tool-call turns get
no reward of their own (the trainer's discounted returns carry the answer's reward back to them).

Point it at the gateway exactly like the math agent (see `agents.math_agent`), with your own tools::

    def lookup_price(item: str) -> str:
        return {"apple": "0.5"}.get(item, "unknown")

    price_tool = Tool("lookup_price", "Price of one item in dollars",
                      {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]},
                      lookup_price)
    # e: an agentrl.client.AsyncEpisode of a reserved group
    async def post(response_id, reward):
        await e.reward(reward, response_id=response_id)

    episode = await run_tool_agent(e.async_openai(), sample, model=e.model, tools=[price_tool], rewards=post)

Tool functions may be plain or ``async``; plain ones run in a thread so a slow tool does not block others.
Whatever a tool returns is sent back as text (JSON for non-strings); an exception becomes ``"error: ..."``.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from openai import AsyncOpenAI

from agents.datasets import Sample
from agents.episode import Episode, RewardSink, Scorer, Turn, local_scorer

SYSTEM_PROMPT = (
    "You are a careful math assistant. Use the calculator tool for arithmetic. "
    "When you know the result, reply with the final answer as a single number on its own line, "
    "written as: #### <number>"
)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its OpenAI schema (name, description, JSON-schema parameters) and code."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    def spec(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


# --- the calculator: arithmetic only, evaluated from the syntax tree (never eval) -------------------------


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its result would be too large."""


MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**100
MAX_EXPONENT = 100

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., float]] = {"sqrt": math.sqrt, "abs": abs, "round": round,
                                               "min": min, "max": max}


def _check(value: float) -> float:
    if not isinstance(value, (int, float)):  # e.g. (-8) ** 0.5 is complex in Python
        raise CalculatorError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result is too large")
    return value


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
        except OverflowError as exc:
            raise CalculatorError("result is too large") from exc
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords and node.args):
        try:
            return _check(_FUNCTIONS[node.func.id](*(_eval(a) for a in node.args)))
        except (TypeError, ValueError) as exc:
            raise CalculatorError(f"{node.func.id}: {exc}") from exc
    raise CalculatorError(f"not allowed in an arithmetic expression: {ast.dump(node)[:60]}")


def calculate(expression: str) -> str:
    """Value of an arithmetic expression: numbers, + - * / // % ** (or ^), parentheses, and
    sqrt/abs/round/min/max. Anything else (names, attributes, strings, calls of other functions) is
    refused with `CalculatorError`. Integral results print without a decimal point (``6/3`` -> ``2``)."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.replace("^", "**").replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2212", "-")
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text).replace("$", "")  # 1,000 -> 1000
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {expression!r}") from exc
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression, e.g. '(12 + 7) * 3 / 2'. Supports + - * / // % ** and "
                "parentheses, sqrt, abs, round, min, max.",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string", "description": "the arithmetic expression"}},
                "required": ["expression"]},
    fn=calculate,
)


# --- the agent ----------------------------------------------------------------------------------------


async def call_tool(tools: dict[str, Tool], name: str, arguments: str, *, timeout_s: float = 30.0) -> str:
    """Run one tool call and return the text for its ``tool`` message (``"error: ..."`` on any failure)."""
    tool = tools.get(name)
    if tool is None:
        return f"error: unknown tool {name!r}; available: {sorted(tools)}"
    try:
        kwargs = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"error: arguments are not valid JSON ({exc.msg})"
    if not isinstance(kwargs, dict):
        return "error: arguments must be a JSON object"
    try:
        if inspect.iscoroutinefunction(tool.fn):
            result = await asyncio.wait_for(tool.fn(**kwargs), timeout_s)
        else:
            result = await asyncio.wait_for(asyncio.to_thread(tool.fn, **kwargs), timeout_s)
    except TimeoutError:
        return f"error: {name} took longer than {timeout_s:.0f}s"
    except Exception as exc:  # a tool's failure is information for the model, not a crash of the agent
        return f"error: {exc}"
    return result if isinstance(result, str) else json.dumps(result)


async def run_tool_agent(
    client: AsyncOpenAI,
    sample: Sample,
    *,
    model: str,
    tools: Sequence[Tool] = (),
    max_turns: int = 4,
    temperature: float = 1.0,
    max_tokens: int = 256,
    score: Scorer = local_scorer,
    rewards: RewardSink | None = None,
    system_prompt: str = SYSTEM_PROMPT,
    tool_timeout_s: float = 30.0,
) -> Episode:
    """Let the model use `CALCULATOR` plus ``tools`` to answer ``sample.question`` in at most ``max_turns``
    model calls. The answering turn is scored and rewarded; if the turn limit ends the episode while the
    model is still calling tools, the last turn gets reward 0.0."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    available = {t.name: t for t in (CALCULATOR, *tools)}
    specs = [t.spec() for t in available.values()]
    messages: list[dict] = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": sample.question},
    ]
    episode = Episode()
    for turn_index in range(max_turns):
        response = await client.chat.completions.create(
            model=model, messages=messages, tools=specs, temperature=temperature, max_tokens=max_tokens,
        )
        choice = response.choices[0]
        message = choice.message
        calls = message.tool_calls or []
        turn = Turn(response.id, message.content or "", choice.finish_reason or "", tool_calls=len(calls))
        episode.turns.append(turn)
        last = turn_index == max_turns - 1
        if not calls or last:
            turn.reward = await score(turn.content, sample.answer) if not calls else 0.0
            if rewards is not None:
                await rewards(response.id, turn.reward)
            break
        # Echo the assistant turn exactly as returned (tool calls included), then one result per call.
        messages.append({
            "role": "assistant",
            "content": message.content,
            "tool_calls": [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": c.function.arguments}}
                           for c in calls],
        })
        results = await asyncio.gather(*(call_tool(available, c.function.name, c.function.arguments,
                                                   timeout_s=tool_timeout_s) for c in calls))
        messages.extend({"role": "tool", "tool_call_id": c.id, "content": result} for c, result in zip(calls, results))
    return episode
