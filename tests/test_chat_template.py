"""The packaged ChatML+tools template: exact rendering, null content, and the generation spans TRL's
`assistant_only_loss` trains on (rendered by transformers' own renderer)."""

from __future__ import annotations

import json

from transformers.utils.chat_template_utils import render_jinja_template

from builder.llm.weights import chatml_tools_template

TOOL = {"type": "function", "function": {"name": "f", "description": "F.", "parameters": {
    "type": "object", "properties": {"x": {"type": "string", "description": "X."}}}}}  # fmt: skip
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": "1"}'}}
CONVERSATION = [
    {"role": "system", "content": "Sys."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
    {"role": "tool", "content": "{}", "tool_call_id": "c1"},
    {"role": "tool", "content": "{}", "tool_call_id": "c1"},
    {"role": "assistant", "content": "Done.", "tool_calls": None},
]


def render(messages, tools=None, **kwargs):
    (text,), (spans,) = render_jinja_template(
        [messages], tools=tools, chat_template=chatml_tools_template().read_text(), return_assistant_tokens_mask=True,
        **kwargs,
    )  # fmt: skip
    return text, [text[start:end] for start, end in spans]


def test_a_tool_conversation_renders_exactly():
    text, _ = render(CONVERSATION, [TOOL])
    call = '<tool_call>\n{"name": "f", "arguments": {"x": "1"}}\n</tool_call>'
    assert text == (
        "<|im_start|>system\nSys.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(TOOL, ensure_ascii=False)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        "\n</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        f"<|im_start|>assistant\n{call}\n{call}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{}\n</tool_response>\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nDone.<|im_end|>\n"
    )


def test_generation_spans_are_what_the_assistant_writes_with_its_end_token():
    _, spans = render(CONVERSATION, [TOOL])
    call = '<tool_call>\n{"name": "f", "arguments": {"x": "1"}}\n</tool_call>'
    assert spans == [f"{call}\n{call}<|im_end|>", "Done.<|im_end|>"]
    text, spans = render(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a", "tool_calls": [CALL]}]
    )
    assert spans == [f"a\n{call}<|im_end|>"]
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_null_content_renders_as_empty_text_in_every_role():
    messages = [
        {"role": "system", "content": None},
        {"role": "user", "content": None},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": None},
        {"role": "assistant", "content": None},
    ]
    for tools in ([TOOL], None):
        text, spans = render(messages, tools)
        assert "None" not in text
        assert "<tool_response>\n\n</tool_response>" in text and spans[-1] == "<|im_end|>"


def test_the_generation_prompt_is_the_prefix_of_every_assistant_turn():
    prompt, _ = render(CONVERSATION[:2], [TOOL], add_generation_prompt=True)
    full, _ = render(CONVERSATION[:3], [TOOL])
    assert prompt.endswith("<|im_start|>assistant\n") and full.startswith(prompt)
