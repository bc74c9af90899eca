"""The chat template stored in checkpoints: ChatML, tools in the system message, tool calls."""

import json

from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_default_template_is_chatml():
    text = ChatTemplate().render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_join_the_system_message_and_calls_go_back_in_tags():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = ChatTemplate().render(messages, [WEATHER], force_tool_call=True)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.loads(system.splitlines()[-1]) == WEATHER
    assert rest.count("<|im_start|>system") == 0  # the system message is not repeated
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rest
    )
    assert "<|im_start|>tool\nsunny<|im_end|>" in rest
    assert text.endswith("<|im_start|>assistant\n<tool_call>")
    # without a system message one is made for the tools
    assert (
        ChatTemplate().render([{"role": "user", "content": "hi"}], [WEATHER]).startswith("<|im_start|>system\n# Tools")
    )


def test_a_checkpoint_brings_its_own_template(tmp_path):
    (tmp_path / CHAT_TEMPLATE_FILE).write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert ChatTemplate.from_checkpoint(tmp_path).render([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    assert ChatTemplate.from_checkpoint(tmp_path / "missing").source == ChatTemplate().source
