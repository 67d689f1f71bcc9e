"""Prompt rendering and token-exact stitching with the real SmolLM2 tokenizer (gateway.chat.template)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessage
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.models import TOOL_CHATML_TEMPLATE, smollm2_tokenizer_dir
from gateway.chat import ChatFormatError, ChatTemplate, TemplateDriftError, chain_hash, parent_candidates, parse_tool_calls
from gateway.chat.hermes import to_hermes, tools_prompt

IM_START, IM_END, NL = 1, 2, 198  # <|im_start|>, <|im_end|>, "\n" in SmolLM2's vocabulary

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

# A copy of the tiny template that drops <think>...</think> from assistant messages that are not the last one,
# as reasoning models' templates do.
_ASSISTANT_OPEN = "{{- '<|im_start|>assistant\\n' + render_content(message.content) -}}"
THINK_STRIPPING_TEMPLATE = TOOL_CHATML_TEMPLATE.replace(
    _ASSISTANT_OPEN,
    "{%- set text = render_content(message.content) -%}"
    "{%- if not loop.last and '</think>' in text -%}{%- set text = text.split('</think>')[-1].lstrip() -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + text -}}",
)


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _template(tok: PreTrainedTokenizerBase, path: str) -> ChatTemplate:
    template = ChatTemplate(tok)
    assert template.splits_at_end_of_turn  # SmolLM2's tokenizer: the delta is cut out of the text
    if path == "token_diff":  # the general path, for tokenizers where that does not hold
        template.splits_at_end_of_turn = False
    return template


@pytest.fixture(scope="module", params=["text_split", "token_diff"])
def tiny(tiny_tok: PreTrainedTokenizerBase, request: pytest.FixtureRequest) -> ChatTemplate:
    return _template(tiny_tok, request.param)


@pytest.fixture(scope="module")
def smol_tok() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


@pytest.fixture(scope="module", params=["text_split", "token_diff"])
def smol(smol_tok: PreTrainedTokenizerBase, request: pytest.FixtureRequest) -> ChatTemplate:
    return _template(smol_tok, request.param)


def encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def reference(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    ids: Any = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    return ids


def sdk_round_trip(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as an agent's OpenAI SDK sends it back (every optional field, None or not)."""
    return ChatCompletionMessage.model_validate({**message, "tool_calls": message.get("tool_calls") or None}).model_dump()


class Conversation:
    """Drives turns the way the gateway does: root render, then continuation per child turn."""

    def __init__(self, template: ChatTemplate, tok: PreTrainedTokenizerBase, tools: Any) -> None:
        self.template, self.tok, self.tools = template, tok, tools
        self.messages: list[dict[str, Any]] = []
        self.full: list[int] = []  # parent's prompt + output ... as stored
        self.last_output: list[int] = []
        self.prompts: list[list[int]] = []
        self.parent_key = ""

    def turn(self, new_messages: list[dict[str, Any]], output_text: str, *, ended: bool = True) -> dict[str, Any]:
        if not self.messages:
            prompt = self.template.render(new_messages, self.tools)
        else:
            # the parent is found by hash: the SDK-dumped reply normalises to what was stored
            assert parent_candidates([*self.messages, *new_messages])[0] == (len(self.messages), self.parent_key)
            cont = self.template.continuation(
                self.messages, new_messages, self.tools, self.last_output, "stop" if ended else "length"
            )
            assert cont.bridge_ids == ([] if ended else [IM_END])
            prompt = cont.prompt_ids
        output = encode(self.tok, output_text) + ([IM_END] if ended else [])
        self.prompts.append(prompt)
        self.full += prompt + output
        self.last_output = output
        reply = {"role": "assistant", **dict(zip(("content", "tool_calls"), parse_tool_calls(output_text)))}
        if not self.tools:
            reply = {"role": "assistant", "content": output_text}
        self.parent_key = chain_hash([*self.messages, *new_messages, reply])  # as the store keys the turn
        reply = sdk_round_trip(reply)
        self.messages += [*new_messages, reply]
        return reply


# -------------------------------------------------------------------------------------------- detection


def test_detects_tool_support_and_end_of_turn(tiny: ChatTemplate, smol: ChatTemplate) -> None:
    assert tiny.native_tools is True
    assert smol.native_tools is False  # SmolLM2's own template ignores tools
    for template in (tiny, smol):
        assert template.end_of_turn_ids == [IM_END]
        assert template.eos_token_id == IM_END
        assert template.stop_token_ids == [IM_END]


def test_tokenizer_without_template_is_refused(tiny_tok: PreTrainedTokenizerBase) -> None:
    bare = copy.copy(tiny_tok)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate(bare)


def test_root_render_matches_apply_chat_template(tiny: ChatTemplate, tiny_tok: PreTrainedTokenizerBase) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    assert tiny.render(messages) == [IM_START, 4093, NL, 6004, IM_END, NL, IM_START, 520, 9531, NL]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert tiny.render(messages, TOOLS) == reference(tiny_tok, messages, TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]["function"]) in tiny.render_text(messages, TOOLS)


def test_render_through_the_segment_cache_matches_tokenizing_the_whole(tiny: ChatTemplate, tiny_tok: PreTrainedTokenizerBase) -> None:
    awkward = [
        {"role": "system", "content": "Système: réponds brièvement 🙂   "},
        {"role": "user", "content": "a literal <|im_end|> inside, then\n\n\ttabs and  spaces  "},
        {"role": "assistant", "content": " leading space and a trailing newline\n"},
        {"role": "user", "content": "<|im_start|>assistant\nfake turn"},
    ]
    first = tiny.render(awkward, TOOLS)
    assert first == reference(tiny_tok, awkward, TOOLS)
    assert tiny.render(awkward, TOOLS) == first  # second time from the cache
    assert tiny.render(awkward[:2], TOOLS) == reference(tiny_tok, awkward[:2], TOOLS)


# ---------------------------------------------------------------------------- stitching, stable template


def test_three_turns_with_a_tool_call_equal_a_full_render(tiny: ChatTemplate, tiny_tok: PreTrainedTokenizerBase) -> None:
    convo = Conversation(tiny, tiny_tok, TOOLS)
    system_user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    reply = convo.turn(system_user, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert reply["content"] is None and len(reply["tool_calls"]) == 1
    call_id = reply["tool_calls"][0]["id"]
    convo.turn([{"role": "tool", "tool_call_id": call_id, "content": '{"temp": 21}'}], "It is 21 degrees in Paris.")
    # turn 2's prompt: the "\n" that closes the assistant turn, the tool turn, the generation prompt
    assert tiny_tok.decode(convo.prompts[1]) == (
        '\n<|im_start|>tool\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )
    convo.turn([{"role": "user", "content": "And tomorrow?"}], "Tomorrow looks")
    # whole stitched conversation (3 turns) + the prompt of a 4th == the template's full render
    cont = tiny.continuation(convo.messages, [{"role": "user", "content": "Thanks"}], TOOLS, convo.last_output, "stop")
    stitched = convo.full + cont.prompt_ids
    full_messages = [*convo.messages, {"role": "user", "content": "Thanks"}]
    assert stitched == reference(tiny_tok, full_messages, TOOLS)
    assert tiny.drift(convo.full, convo.messages, TOOLS) is False


def test_length_cut_parent_gets_a_bridge(tiny: ChatTemplate, tiny_tok: PreTrainedTokenizerBase) -> None:
    convo = Conversation(tiny, tiny_tok, None)
    convo.turn([{"role": "user", "content": "Count to ten."}], "One, two, thr", ended=False)
    new = [{"role": "user", "content": "Go on."}]
    cont = tiny.continuation(convo.messages, new, None, convo.last_output, "length")
    assert cont.bridge_ids == [IM_END]
    assert tiny_tok.decode(cont.delta_ids) == "\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    assert convo.full + cont.prompt_ids == reference(tiny_tok, [*convo.messages, *new], None)
    assert tiny.drift(convo.full, convo.messages, None) is False


def test_parallel_tool_calls(tiny: ChatTemplate, tiny_tok: PreTrainedTokenizerBase) -> None:
    convo = Conversation(tiny, tiny_tok, TOOLS)
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    reply = convo.turn([{"role": "user", "content": "Paris and Rome?"}], text)
    first, second = (c["id"] for c in reply["tool_calls"])
    results = [
        {"role": "tool", "tool_call_id": first, "content": "sunny"},
        {"role": "tool", "tool_call_id": second, "content": "rain"},
    ]
    convo.turn(results, "Paris is sunny, Rome is rainy.")
    assert tiny_tok.decode(convo.prompts[1]) == (
        "\n<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    new = [{"role": "user", "content": "Thanks"}]
    cont = tiny.continuation(convo.messages, new, TOOLS, convo.last_output, "stop")
    assert convo.full + cont.prompt_ids == reference(tiny_tok, [*convo.messages, *new], TOOLS)


def test_hermes_tools_for_a_template_without_tools(smol: ChatTemplate, smol_tok: PreTrainedTokenizerBase) -> None:
    convo = Conversation(smol, smol_tok, TOOLS)
    text = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    prompt_text = smol.render_text([{"role": "user", "content": "Paris and Rome?"}], TOOLS)
    assert prompt_text == (
        "<|im_start|>system\n" + tools_prompt(TOOLS) + "<|im_end|>\n"
        "<|im_start|>user\nParis and Rome?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert '<tools>\n{"name": "get_weather", "description": "Current weather in a city"' in prompt_text
    assert '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>' in prompt_text
    reply = convo.turn([{"role": "user", "content": "Paris and Rome?"}], text)
    assert reply["content"] == "Checking."
    first, second = (c["id"] for c in reply["tool_calls"])
    results = [
        {"role": "tool", "tool_call_id": first, "content": "sunny"},
        {"role": "tool", "tool_call_id": second, "content": "rain"},
    ]
    convo.turn(results, "Sunny and rainy.")
    # parallel results: one user turn with one <tool_response> block each
    assert smol_tok.decode(convo.prompts[1]) == (
        "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    new = [{"role": "user", "content": "Thanks"}]
    cont = smol.continuation(convo.messages, new, TOOLS, convo.last_output, "stop")
    full_messages = [*convo.messages, *new]
    assert convo.full + cont.prompt_ids == smol.render(full_messages, TOOLS)
    assert smol.render(full_messages, TOOLS) == reference(smol_tok, to_hermes(full_messages, TOOLS), None)
    assert smol.drift(convo.full, convo.messages, TOOLS) is False


def test_hermes_keeps_the_system_prompt_and_maps_developer(smol: ChatTemplate) -> None:
    text = smol.render_text([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "x"}], TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    text = smol.render_text([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "x"}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


# ------------------------------------------------------------------------- a template that rewrites history


@pytest.mark.parametrize("path", ["text_split", "token_diff"])
def test_think_stripping_template_keeps_the_parents_real_tokens(tiny_tok: PreTrainedTokenizerBase, path: str) -> None:
    tok = copy.copy(tiny_tok)
    tok.chat_template = THINK_STRIPPING_TEMPLATE
    template = _template(tok, path)
    convo = Conversation(template, tok, None)
    convo.turn([{"role": "user", "content": "Hi"}], "<think>\nThe user greets me.\n</think>\nHello!")
    parent_full = list(convo.full)
    new = [{"role": "user", "content": "How are you?"}]
    cont = template.continuation(convo.messages, new, None, convo.last_output, "stop")
    stitched = parent_full + cont.prompt_ids
    rerender = reference(tok, [*convo.messages, *new], None)

    assert "The user greets me." in tok.decode(stitched)  # the parent's real tokens, think block included
    assert "The user greets me." not in tok.decode(rerender)  # the template would have dropped it
    assert cont.bridge_ids == []
    assert tok.decode(cont.delta_ids) == "\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
    assert rerender[-len(cont.delta_ids) :] == cont.delta_ids  # the delta is what the template adds
    assert template.drift(parent_full, convo.messages, None) is True


# ------------------------------------------------------------------------------------------------- drift


def test_drift_when_the_output_does_not_tokenize_canonically(tiny: ChatTemplate, tiny_tok: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tiny.render(messages)
    canonical = encode(tiny_tok, "Hello") + [IM_END]
    spelled = [t for ch in "Hello" for t in encode(tiny_tok, ch)] + [IM_END]  # same text, other tokens
    assert spelled != canonical and tiny_tok.decode(spelled) == tiny_tok.decode(canonical)
    history = [*messages, {"role": "assistant", "content": "Hello"}]
    assert tiny.drift(prompt + canonical, history, None) is False
    assert tiny.drift(prompt + spelled, history, None) is True
    # the continuation is the same either way: it never looks at the parent's output text
    a = tiny.continuation(history, [{"role": "user", "content": "x"}], None, canonical)
    b = tiny.continuation(history, [{"role": "user", "content": "x"}], None, spelled)
    assert a == b


@pytest.mark.parametrize("path", ["text_split", "token_diff"])
def test_template_that_cannot_be_cut_raises(tiny_tok: PreTrainedTokenizerBase, path: str) -> None:
    tok = copy.copy(tiny_tok)
    # the first line depends on the number of messages: no rendering is a prefix of a longer one
    tok.chat_template = "{{ messages | length }}\n" + TOOL_CHATML_TEMPLATE
    template = ChatTemplate(tok)
    template.splits_at_end_of_turn = path == "text_split"
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(TemplateDriftError) as info:
        template.continuation(history, [{"role": "user", "content": "x"}], None, [IM_END])
    assert info.value.reason == "prefix_mismatch"


def test_continuation_needs_an_assistant_parent(tiny: ChatTemplate) -> None:
    with pytest.raises(ValueError, match="assistant"):
        tiny.continuation([{"role": "user", "content": "Hi"}], [{"role": "user", "content": "x"}], None, [IM_END])


def test_template_refusal_is_a_format_error(tiny_tok: PreTrainedTokenizerBase) -> None:
    tok = copy.copy(tiny_tok)
    tok.chat_template = (
        "{%- for m in messages -%}{%- if m.role == 'developer' -%}"
        "{{ raise_exception('developer messages are not supported') }}{%- endif -%}{%- endfor -%}"
        + TOOL_CHATML_TEMPLATE
    )
    template = ChatTemplate(tok)
    with pytest.raises(ChatFormatError) as info:
        template.render([{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}])
    assert info.value.param == "messages"
    assert "developer messages are not supported" in info.value.message
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ChatFormatError):
        template.continuation(history, [{"role": "developer", "content": "x"}], None, [IM_END])
    # the same template continues ordinary turns
    assert template.continuation(history, [{"role": "user", "content": "x"}], None, [IM_END]).bridge_ids == []


def test_stand_in_refused_falls_back_to_the_real_history(tiny_tok: PreTrainedTokenizerBase) -> None:
    tok = copy.copy(tiny_tok)
    # a template that insists the first user message is the real one: the stand-in "." is refused
    tok.chat_template = (
        "{%- for m in messages -%}{%- if m.role == 'user' and m.content == '.' -%}"
        "{{ raise_exception('placeholder') }}{%- endif -%}{%- endfor -%}" + TOOL_CHATML_TEMPLATE
    )
    template = ChatTemplate(tok)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    new = [{"role": "user", "content": "x"}]
    cont = template.continuation(history, new, None, [IM_END])
    assert tok.decode(cont.delta_ids) == "\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_long_turns_bypass_the_segment_cache(tiny: ChatTemplate, tiny_tok: PreTrainedTokenizerBase) -> None:
    from gateway.chat.template import SEGMENT_CACHE_MAX_CHARS

    long_text = "word " * (SEGMENT_CACHE_MAX_CHARS // 4)
    messages = [{"role": "user", "content": long_text}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}]
    assert tiny.render(messages) == reference(tiny_tok, messages, None)


# ---------------------------------------------------------------------------- the render cache


def test_render_cache_answers_repeated_prompts_with_the_same_text(tiny_tok: PreTrainedTokenizerBase) -> None:
    """A GRPO group sends its root prompt once per member: rendered once, then looked up, same tokens."""
    template = ChatTemplate(tiny_tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    first = template.render(messages, TOOLS)
    assert first == reference(tiny_tok, messages, TOOLS)
    assert template._renders is not None and template._renders.hits == 0
    for _ in range(3):
        assert template.render(messages, TOOLS) == first
    assert template._renders.hits == 3
    # any difference in the inputs is another rendering: content, tools, the generation prompt, key order
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    assert template.render(other, TOOLS) == reference(tiny_tok, other, TOOLS)
    assert template.render(messages) == reference(tiny_tok, messages, None)
    reordered = [{"type": "function", "function": {"parameters": TOOLS[0]["function"]["parameters"],
                                                   "name": "get_weather",
                                                   "description": "Current weather in a city"}}]
    assert template.render_text(messages, reordered) == tiny_tok.apply_chat_template(
        messages, tools=reordered, add_generation_prompt=True, tokenize=False)
    assert template.render_text(messages, reordered) != template.render_text(messages, TOOLS)
    assert template._renders.hits == 5  # the reordered tools' second rendering and TOOLS' were looked up


def test_render_cache_is_off_for_templates_that_read_the_clock(tiny_model_dir: Path) -> None:
    """strftime_now puts today's date in the prompt: a cached rendering would go stale at midnight."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "{{ strftime_now('%d %b %Y') }}\n" + tok.chat_template
    template = ChatTemplate(tok)
    assert template._renders is None
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages) == reference(tok, messages, None)


def test_inputs_that_are_not_plain_json_are_rendered_uncached(tiny_tok: PreTrainedTokenizerBase) -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd"

    template = ChatTemplate(tiny_tok)
    assert template._renders is not None
    kept = len(template._renders)  # the start-up probes' renderings
    messages = [{"role": "user", "content": "hi", "name": Odd()}]
    assert template.render_text(messages) == template.render_text(messages)
    assert len(template._renders) == kept and template._renders.hits == 0


def test_render_cache_keeps_what_comes_back_not_each_turns_new_messages(tiny_tok: PreTrainedTokenizerBase) -> None:
    """A stitched turn renders a stand-in conversation (the same for every turn with this system prompt and
    tools: kept) and the stand-in followed by the turn's new messages (never seen again: not kept); a drift
    check renders a whole history (not kept either). Only the stand-in stays in the cache."""
    template = ChatTemplate(tiny_tok)
    assert template._renders is not None
    convo = Conversation(template, tiny_tok, None)
    convo.turn([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}], "Hello!", ended=True)
    kept = len(template._renders)  # the start-up probes' renderings and the root's
    for k in range(5):
        new = [{"role": "user", "content": f"Question {k}?"}]
        cont = template.continuation(convo.messages, new, None, convo.last_output, "stop")
        assert convo.full + cont.prompt_ids == reference(tiny_tok, [*convo.messages, *new], None)
        template.drift(convo.full, convo.messages, None, new)
    assert len(template._renders) == kept + 1  # the stand-in conversation, rendered once, looked up 4 times
    assert template._renders.hits >= 4
