"""Tools and tool-call messages through the shared prompt path (kvgate.api.prompt): rendered by
the chat template as transformers' apply_chat_template does, identically for engine and EPP."""

from __future__ import annotations

import copy
import json

import pytest

from kvgate.api.chat_template import ChatTemplateError, render_untrusted_chat_template
from kvgate.api.prompt import chat_prompt_text, template_message, template_tools
from kvgate.api.tokenizer import load_tokenizer
from kvgate.engine.server.protocol import ChatMessage
from kvgate.engine.server.serving import ModelInfo, OpenAIServing
from kvgate.epp.request import InferenceRequest
from kvgate.epp.tokenization import SegmentCachingTokenizer

# A tool-use template in the shape of Qwen2.5's: tools as JSON in the system turn, an assistant's
# calls as <tool_call> blocks (arguments are objects), tool results as <tool_response> turns.
TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C, sunny"}]},
]


@pytest.fixture(scope="module")
def tool_tokenizer():
    tok = copy.copy(load_tokenizer("default"))
    tok.chat_template = TOOL_TEMPLATE
    return tok


def test_tool_round_trip_renders_through_the_template(tool_tokenizer) -> None:
    convo = [template_message(m) for m in MESSAGES]
    assert convo[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # parsed, as HF/vLLM
    assert convo[1]["content"] == "" and convo[2] == {
        "role": "tool",
        "content": "18 C, sunny",
        "tool_call_id": "call_1",
    }
    text = chat_prompt_text(tool_tokenizer, convo, tools=template_tools(TOOLS))
    assert json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response id="call_1">\n18 C, sunny\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]", '"x"'])
def test_tool_call_arguments_must_be_a_json_object(arguments: str) -> None:
    bad = {**CALL, "function": {"name": "f", "arguments": arguments}}
    with pytest.raises(ChatTemplateError, match="arguments"):
        template_message({"role": "assistant", "tool_calls": [bad]})


def test_request_templates_see_the_tools_too() -> None:
    text = render_untrusted_chat_template(
        TOOL_TEMPLATE, [template_message(m) for m in MESSAGES], tools=template_tools(TOOLS)
    )
    assert json.dumps(TOOLS[0]) in text and "<tool_response" in text


def test_engine_and_epp_tokenize_a_tool_request_alike(tool_tokenizer) -> None:
    serving = OpenAIServing(None, tool_tokenizer, ModelInfo(["default"], "default", 4096, 50_000, 0))  # type: ignore[arg-type]
    engine_ids = serving.chat_prompt(
        [ChatMessage.model_validate(m) for m in MESSAGES], True, False, None, None, TOOLS
    )
    body = {"model": "default", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"}
    epp = InferenceRequest("r", "default", "default", body, tokenizer=SegmentCachingTokenizer(tool_tokenizer))
    assert epp.token_ids == engine_ids
    assert tool_tokenizer.decode(engine_ids, skip_special_tokens=False).count("<tool_call>") == 1
