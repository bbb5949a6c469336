"""--reasoning-parser end to end, with the official openai client: a chat answer's
`<think>...</think>` comes apart as `reasoning_content`, whole and streamed, and tool calls and
structured outputs apply to the answer after it.

- The real SmolLM2 with `--reasoning-parser deepseek_r1`: regexes make it write a reasoning
  then an answer or a tool call; few-shot turns make it close a free reasoning by itself, and a
  JSON schema then holds for the answer only.
- A tiny random Qwen3 (its tokenizer has `<think>` and `</think>` as added tokens, its chat
  template thinks as Qwen3's does) with `--reasoning-parser qwen3`: regexes shape its random
  text; `enable_thinking=False` renders the closed think block that makes it all content.

The raw text to split by hand is the same greedy answer from /v1/completions, which parses
nothing, on the prompt /tokenize renders."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.server.util import RunningServer, client, run_server

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def r1_server(r1_lora_server) -> RunningServer:
    """SmolLM2 with --reasoning-parser deepseek_r1 (tests/server/conftest.py; its LoRA adapter
    is test_lora.py's, and these tests ask the base model)."""
    return r1_lora_server


def _extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def _raw(server: RunningServer, model: str, messages, max_tokens: int, **extra) -> str:
    """The greedy answer as the model writes it, through /v1/completions (no parser)."""
    template_kwargs = extra.pop("chat_template_kwargs", None)
    kwargs = {"chat_template_kwargs": template_kwargs} if template_kwargs else {}
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages, **kwargs}, timeout=30)
    r.raise_for_status()
    return (
        client(server)
        .completions.create(
            model=model,
            prompt=r.json()["tokens"],
            max_tokens=max_tokens,
            temperature=0,
            extra_body=extra or None,
        )  # fmt: skip
        .choices[0]
        .text
    )


def _chat(server: RunningServer, model: str, messages, max_tokens: int, **kwargs):
    """(message, (reasoning, content, tool calls, finish) joined from the same request
    streamed)."""
    c = client(server)
    args = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs)
    message = c.chat.completions.create(**args).choices[0].message
    reasoning = content = ""
    calls: list[dict[str, str]] = []
    finish = None
    for chunk in c.chat.completions.create(**args, stream=True):
        (choice,) = chunk.choices
        reasoning += _extra(choice.delta, "reasoning_content") or ""
        content += choice.delta.content or ""
        for fragment in choice.delta.tool_calls or []:
            if fragment.id:
                calls.append({"name": fragment.function.name, "arguments": ""})
            calls[fragment.index]["arguments"] += fragment.function.arguments or ""
        finish = choice.finish_reason or finish
    return message, (reasoning or None, content or None, calls, finish)


def _split(raw: str) -> tuple[str | None, str | None]:
    reasoning, _, content = raw.removeprefix("<think>").partition("</think>")
    return reasoning or None, content or None


# ---- SmolLM2, deepseek_r1 ----------------------------------------------------------------------

ASK = [{"role": "user", "content": "What is the capital of France?"}]
THOUGHT_THEN_ANSWER = r"<think>[A-Za-z ,.]{10,40}</think>[A-Za-z ,.]{3,16}"


def _assert_split_as_by_hand(server: RunningServer, model: str, messages, max_tokens, regex):
    """The answer the regex shapes comes apart, whole and streamed, as its raw text split by
    hand."""
    extra = {"structured_outputs": {"regex": regex}}
    raw = _raw(server, model, messages, max_tokens, **extra)
    assert re.fullmatch(regex, raw)
    reasoning, content = _split(raw)
    message, streamed = _chat(server, model, messages, max_tokens, extra_body=extra)
    assert (_extra(message, "reasoning_content"), message.content) == (reasoning, content)
    assert streamed == (reasoning, content, [], "stop")


def test_a_reasoning_and_an_answer_come_apart_whole_and_streamed(r1_server):
    _assert_split_as_by_hand(r1_server, SMOLLM2, ASK, 80, THOUGHT_THEN_ANSWER)


def test_an_answer_cut_before_its_end_of_thought_is_all_reasoning(r1_server):
    raw = _raw(r1_server, SMOLLM2, ASK, 6)
    message, streamed = _chat(r1_server, SMOLLM2, ASK, 6)
    assert "</think>" not in raw
    assert (_extra(message, "reasoning_content"), message.content) == (raw, None)
    assert streamed == (raw, None, [], "length")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
THOUGHT_THEN_CALL = (
    r"<think>[A-Za-z ,.]{10,40}</think><tool_call>\n"
    r'\{"name": "get_weather", "arguments": \{"city": "[A-Za-z]{2,12}"\}\}\n</tool_call>'
)


def test_a_tool_call_after_the_reasoning_is_parsed(r1_server):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    extra = {"structured_outputs": {"regex": THOUGHT_THEN_CALL}}
    message, (reasoning, content, calls, finish) = _chat(
        r1_server, SMOLLM2, ask, 120, tools=[WEATHER], extra_body=extra
    )
    thought = _extra(message, "reasoning_content")
    assert re.fullmatch(r"[A-Za-z ,.]{10,40}", thought)
    assert message.content is None
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    city = json.loads(call.function.arguments)["city"]
    assert re.fullmatch(r"[A-Za-z]{2,12}", city)
    assert (reasoning, content, finish) == (thought, None, "tool_calls")
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]


# Earlier turns that close their thought, so that the model closes its own.
FEW_SHOT = [
    {"role": "system", "content": "Think first, end your thoughts with </think>, then answer."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "<think>The capital of France is Paris.</think>"
                                     '{"city": "Paris"}'},
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "<think>The capital of Italy is Rome.</think>"
                                     '{"city": "Rome"}'},
    {"role": "user", "content": "What is the capital of Spain?"},
]  # fmt: skip
CAPITAL = {
    "type": "object",
    "properties": {
        "capital": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["capital", "country"],
    "additionalProperties": False,
}


def test_a_json_schema_holds_for_the_answer_after_a_free_reasoning(r1_server):
    # Unconstrained, the model thinks this, then answers {"city": "Madrid"}.
    assert _split(_raw(r1_server, SMOLLM2, FEW_SHOT, 40)) == (
        "The capital of Spain is Madrid.",
        '{"city": "Madrid"}',
    )
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": CAPITAL}}
    message, (reasoning, content, _, finish) = _chat(
        r1_server, SMOLLM2, FEW_SHOT, 80, response_format=response_format
    )
    # The reasoning is the model's own (a grammar from the start would have made it JSON);
    # the answer has the schema's keys, not the turns' "city".
    assert _extra(message, "reasoning_content") == "The capital of Spain is Madrid."
    answer = json.loads(message.content)
    assert list(answer) == ["capital", "country"]
    assert all(isinstance(v, str) and len(v) <= 20 for v in answer.values())
    assert (reasoning, content, finish) == (
        "The capital of Spain is Madrid.",
        message.content,
        "stop",
    )


def test_the_responses_and_messages_apis_give_the_reasoning_apart(r1_server):
    # The few-shot conversation's free reasoning, as chat splits it (the test above), comes as
    # a reasoning item through /v1/responses and a thinking block through /v1/messages.
    thought, answer = "The capital of Spain is Madrid.", '{"city": "Madrid"}'
    response = client(r1_server).responses.create(
        model=SMOLLM2, input=FEW_SHOT, max_output_tokens=40, temperature=0
    )
    reasoning, message = response.output
    assert (reasoning.type, [part.text for part in reasoning.content]) == ("reasoning", [thought])
    assert (message.type, response.output_text) == ("message", answer)
    claude = anthropic.Anthropic(base_url=r1_server.base_url, api_key="unused")
    reply = claude.messages.create(
        model=SMOLLM2,
        system=FEW_SHOT[0]["content"],
        messages=FEW_SHOT[1:],
        max_tokens=40,
        extra_body={"temperature": 0},
    )
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in reply.content] == [
        ("thinking", thought),
        ("text", answer),
    ]
    assert reply.stop_reason == "end_turn"


# ---- a tiny Qwen3, qwen3 ---------------------------------------------------------------------

# Qwen3's template, cut down: earlier answers lose their thought; enable_thinking=False
# writes an empty think block after the generation prompt.
QWEN3_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and '</think>' in m.content %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n')"
    " + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)  # fmt: skip


def _tiny_qwen3(path) -> str:
    """A tiny random Qwen3 with a byte-level tokenizer of 256 bytes and Qwen3's added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.families import build_family

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    backend.add_tokens(
        [AddedToken("<think>", special=False), AddedToken("</think>", special=False)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    build_family("qwen3", path, vocab_size=288, bos_token_id=None, eos_token_id=eos)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory) -> Iterator[tuple[RunningServer, str]]:
    folder = _tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-thinking"))
    log_path = tmp_path_factory.mktemp("qwen3-server") / "server.log"
    with run_server(
        log_path, "--model", folder, "--device", "cpu", "--dtype", "float32",
        "--kv-cache-memory", "0.01", "--reasoning-parser", "qwen3",
    ) as s:  # fmt: skip
        yield s, folder


HELLO = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    "pattern",
    [
        r"<think>[a-z ]{4,16}</think>[a-z ]{2,10}",
        r"[a-z ]{4,16}</think>[a-z ]{2,10}",  # the prompt's <think>, as Qwen3.5's template has it
    ],
)
def test_qwen3_answers_split_whole_and_streamed(qwen3_server, pattern):
    server, model = qwen3_server
    _assert_split_as_by_hand(server, model, HELLO, 40, pattern)


def test_qwen3_text_without_a_think_tag_is_content(qwen3_server):
    server, model = qwen3_server
    raw = _raw(server, model, HELLO, 12)  # the random model's own text
    assert "think>" not in raw
    message, streamed = _chat(server, model, HELLO, 12)
    assert (_extra(message, "reasoning_content"), message.content) == (None, raw)
    assert streamed == (None, raw, [], "length")


def test_enable_thinking_false_makes_the_whole_answer_content(qwen3_server):
    server, model = qwen3_server
    kwargs = {"enable_thinking": False}
    r = httpx.post(
        f"{server.base_url}/tokenize",
        json={"messages": HELLO, "chat_template_kwargs": kwargs},
        timeout=30,
    )
    prompt = httpx.post(
        f"{server.base_url}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30
    ).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # The model's own think block is then plain text: the prompt has closed the reasoning.
    pattern = r"<think>[a-z ]{4,16}</think>[a-z ]{2,10}"
    extra = {"structured_outputs": {"regex": pattern}, "chat_template_kwargs": kwargs}
    raw = _raw(server, model, HELLO, 40, **extra)
    assert re.fullmatch(pattern, raw)
    message, streamed = _chat(server, model, HELLO, 40, extra_body=extra)
    assert (_extra(message, "reasoning_content"), message.content) == (None, raw)
    assert streamed == (None, raw, [], "stop")
