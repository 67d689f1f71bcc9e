"""Answer extraction and verification, on hand-written completions."""

from fractions import Fraction

import pytest

from agents.rewards import extract_answer, gold_answer, math_reward, parse_number, same_number


@pytest.mark.parametrize("text, expected", [
    ("so the total is \\boxed{18} eggs", "18"),
    ("first \\boxed{3} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),  # the last box, nested braces
    ("Janet sells 9 eggs.\n#### 18", "18"),
    ("#### 1,234 dollars\nthanks", "1,234 dollars"),
    ("She has 5 apples and buys 7 more, so 12.", "12"),
    ("The answer is 42. I checked it 3 times.", "42. I checked it 3 times."),  # parse_number takes 42
    ("no digits here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_answer_is_phrase_beats_later_numbers():
    assert parse_number(extract_answer("The answer is 42. I checked it 3 times.")) == 42


@pytest.mark.parametrize("text, value", [
    ("18", Fraction(18)),
    ("$1,234.50", Fraction(246900, 200)),
    ("-7", Fraction(-7)),
    ("\u22127", Fraction(-7)),  # unicode minus
    ("3/4", Fraction(3, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)),
    ("\\dfrac{-1}{8}", Fraction(-1, 8)),
    ("50%", Fraction(50)),
    ("\\$12", Fraction(12)),
    ("\\text{18 dollars}", Fraction(18)),
    ("0.5", Fraction(1, 2)),
    (".25", Fraction(1, 4)),
    ("1/0", None),
    ("abc", None),
    (None, None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_same_number_uses_six_significant_digits():
    assert same_number(Fraction(1, 3), 0.333333)
    assert same_number(18, 18.0000001)
    assert same_number(123456.4, 123456)
    assert not same_number(18, 18.01)
    assert not same_number(0.333, Fraction(1, 3))
    assert not same_number(-5, 5)
    assert same_number(0.0, -0.0)


@pytest.mark.parametrize("completion, reference, reward", [
    ("She makes 9 * 2 = $18 every day.\n#### 18", "Janet sells ... #### 18", 1.0),
    ("\\boxed{18.00}", "18", 1.0),
    ("The answer is $1,000.", "#### 1000", 1.0),
    ("x = 3/4", "0.75", 1.0),
    ("It drops to -12 degrees", "-12", 1.0),
    ("75%", "75", 1.0),
    ("#### 17", "#### 18", 0.0),
    ("I don't know", "18", 0.0),
    ("", "18", 0.0),
    # the final answer wins over numbers in the working
    ("16 - 3 - 4 = 9 eggs, 9 * 2 = 18\n#### 18", "18", 1.0),
    ("#### 18\nActually 17 would be wrong", "18", 1.0),
])
def test_math_reward(completion, reference, reward):
    assert math_reward(completion, reference) == reward


def test_gold_answer_and_bad_reference():
    assert gold_answer("work...\n#### 1,200") == "1,200"
    assert gold_answer(" 7 ") == "7"
    with pytest.raises(ValueError, match="holds no number"):
        math_reward("#### 3", "#### none")
