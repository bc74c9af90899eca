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


def test_a_template_cannot_ask_for_unbounded_memory_or_time_and_a_refusal_is_the_clients_400():
    """A template is data from a checkpoint. Jinja's sandbox keeps it from Python objects but
    not from size: each way of asking for gigabytes (`'a' * 2**36`, folded when the template
    compiles; padding, %-widths, joins, `~` doubling) or hours (loops nested over a message, or
    over range(100000)) is refused at render, quickly, as is a macro without end; what a
    template refuses reaches a client as a 400 naming the messages."""
    import time
    from types import SimpleNamespace

    import pytest

    from lmfoundry.model.chat_template import ChatTemplateError
    from lmfoundry.serving.api import ApiError, render_chat

    hi = [{"role": "user", "content": "hi"}]
    loops = "{% for a in messages[0].content %}{% for b in messages[0].content %}{% endfor %}{% endfor %}"
    for source, why in [
        ("{{ 'a' * 2**36 }}", "repeated a sequence past"),
        ("{{ 7 ** 10000000 }}", "power above 64"),
        ("{{ [0] * 100000000 }}", "repeated a sequence past"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "over more than"),
        (loops.replace("messages[0].content", "'x' * 400"), "over more than"),
        ("{{ 'x'.center(1000000000) }}{{ '1'.zfill(10**9) }}", "padded a string past"),
        ("{{ 'x'|center(1000000000) }}", "padded a string past"),
        ("{{ '%1000000000s' % 'x' }}", "formatted a field wider"),
        ("{{ '{:>1000000000}'.format('x') }}", "formatted a field wider"),
        ("{{ '%1000000000s'|format('x') }}", "formatted a field wider"),
        ("{{ ([('a' * 1048576)] * 1024)|join }}", "joined a string past"),
        ("{{ (['x']|batch(200000000, 'y')|first)|length }}", "asked for rows past"),
        (
            "{% set ns = namespace(s='a') %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "concatenated a string past",
        ),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
        ("{% for m in messages %}{{ raise_exception('roles must alternate') }}{% endfor %}", "roles must alternate"),
    ]:
        started = time.perf_counter()
        template = ChatTemplate(source)
        with pytest.raises(ChatTemplateError, match=why):
            template.render(hi)
        assert time.perf_counter() - started < 1.0, source
        with pytest.raises(ApiError) as refused:
            render_chat(SimpleNamespace(chat_template=template), hi)
        assert refused.value.status == 400 and refused.value.param == "messages"
    # within the limits, a template renders as before, range and repetition included
    fine = ChatTemplate(
        "{% for i in range(3) %}{{ '-' * 2 }}{% endfor %}{{ messages[0].content * 2 }}"
        "{{ ' ' ~ 'x'.center(5) ~ '%3d' % 7 ~ '{:>3}'.format(8) ~ (['a', 'b']|join(',')) }}"
    )
    assert fine.render(hi) == "------hihi   x    7  8a,b"
