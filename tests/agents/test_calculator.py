"""The calculator tool evaluates arithmetic only; anything else is refused."""

import pytest

from agents.tool_agent import CALCULATOR, CalculatorError, Tool, calculate, call_tool


@pytest.mark.parametrize("expression, result", [
    ("1 + 2 * 3", "7"),
    ("(12 + 7) * 3 / 2", "28.5"),
    ("6 / 3", "2"),
    ("2 ^ 10", "1024"),
    ("-4 + +2", "-2"),
    ("17 // 5 + 17 % 5", "5"),
    ("sqrt(16) + abs(-3)", "7"),
    ("max(1, 5, 3) - min(2, 4)", "3"),
    ("1,000 * 3", "3000"),
    ("$12 \u00d7 4", "48"),
])
def test_arithmetic(expression, result):
    assert calculate(expression) == result


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "not allowed"),
    ("open('/etc/passwd')", "not allowed"),
    ("x + 1", "not allowed"),
    ("(1).__class__", "not allowed"),
    ("'a' * 3", "not allowed"),
    ("[1, 2]", "not allowed"),
    ("lambda: 1", "not allowed"),
    ("True + 1", "not allowed"),
    ("2 ** 1000", "exponent larger"),
    ("10 ** 99 * 10 ** 99", "too large"),
    ("1 / 0", "division by zero"),
    ("sqrt(-1)", "sqrt"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "cannot parse"),
    ("1" * 300, "longer than"),
])
def test_refuses(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculate(expression)


async def test_call_tool_reports_errors_as_text():
    tools = {"calculator": CALCULATOR}
    assert await call_tool(tools, "calculator", '{"expression": "2 * 21"}') == "42"
    assert (await call_tool(tools, "calculator", '{"expression": "x"}')).startswith("error: not allowed")
    assert (await call_tool(tools, "calculator", "{not json")).startswith("error: arguments are not valid JSON")
    assert (await call_tool(tools, "calculator", "[1]")) == "error: arguments must be a JSON object"
    assert (await call_tool(tools, "weather", "{}")).startswith("error: unknown tool 'weather'")
    assert (await call_tool(tools, "calculator", '{"expr": "1"}')).startswith("error:")


async def test_call_tool_async_and_non_string_results():
    async def lookup(item: str) -> dict:
        return {"item": item, "price": 0.5}

    tool = Tool("lookup", "price", {"type": "object", "properties": {"item": {"type": "string"}}}, lookup)
    assert await call_tool({"lookup": tool}, "lookup", '{"item": "apple"}') == '{"item": "apple", "price": 0.5}'
