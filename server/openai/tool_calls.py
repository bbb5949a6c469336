"""OpenAI tool calling on /v1/chat/completions.

A request's `tools`, `tool_choice` and `parallel_tool_calls` are checked (`plan_tools`; a bad
one is a 400 naming the field) into a `ToolPlan`, which then

- shows the tools to the model: through its chat template when the template takes `tools`,
  else in a system message that lists them and the Hermes-style call format, the way models
  without tool templates are prompted in their documentation (`render_messages`); earlier
  assistant calls and tool results of the conversation are rendered the same way;
- constrains the output for tool_choice "required" (a JSON array of calls of the given
  functions) or a named function (that function's arguments) (`constraint`);
- reads the calls back out of the text (`parse`, or `ToolCallStream` while streaming): the
  constrained forms, or, for "auto", the model's own format, Hermes-style
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (Qwen2.5, Qwen3, SmolLM2;
  a block may hold a list of calls) or Llama 3's bare JSON `{"name": ..., "parameters": ...}`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.structured_output import check
from pagedserve.scheduler import StructuredOutputs
from pagedserve.server.errors import APIError

# --tool-call-parser: how "auto" reads calls out of the text ("auto": from the chat template).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
TOOL_CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_PYTHON_TAG = "<|python_tag|>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # as the request gave them (what a template renders)
    parameters: dict[str, dict[str, Any]]  # function name -> its arguments' JSON schema
    choice: str  # "none", "auto", "required" or the name of the one function to call
    parallel: bool  # more than one call per answer
    parser: str  # "hermes" or "llama3_json"
    template_has_tools: bool

    @property
    def forced(self) -> bool:
        """tool_choice "required" or a named function: the output is constrained to calls."""
        return self.choice not in ("none", "auto")

    def constraint(self) -> StructuredOutputs | None:
        if self.choice == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": schema},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, schema in self.parameters.items()
            ]
            array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputs(json=array)
        if self.forced:
            return StructuredOutputs(json=self.parameters[self.choice])
        return None

    # ---- prompt ----------------------------------------------------------------------------

    def render_messages(
        self, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(messages, extra chat-template arguments) that show the model its tools and the
        conversation's earlier calls."""
        messages = [_with_parsed_arguments(i, m) for i, m in enumerate(messages)]
        show = self.choice != "none"
        if self.template_has_tools:
            return messages, ({"tools": self.tools} if show else {})
        messages = [_calls_as_text(m) for m in messages]
        if show:
            listing = _tools_system_text(self.tools)
            if messages and messages[0].get("role") == "system":
                first = dict(messages[0])
                first["content"] = f"{listing}\n\n{_text_of(first.get('content'))}"
                messages[0] = first
            else:
                messages.insert(0, {"role": "system", "content": listing})
        return messages, {}

    # ---- reading the calls back ------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a whole answer; no calls when the text holds none."""
        if self.choice == "none":
            return text, []
        if self.choice == "required":
            calls = _calls_from_json(text)
            return (None, calls) if calls else (text, [])
        if self.forced:
            try:
                arguments = json.loads(text)
            except ValueError:
                return text, []
            return None, [_call(self.choice, arguments)]
        if self.parser == "llama3_json":
            content, calls = text, _llama3_calls(text)
            if calls:
                content = None
        else:
            content, calls = _hermes_calls(text)
        calls = [c for c in calls if c["function"]["name"] in self.parameters]
        if not self.parallel:
            calls = calls[:1]
        if not calls:
            return text, []
        return content, calls


@dataclass
class ToolCallStream:
    """Reads one choice's calls while it streams: `feed` takes each new piece of text and
    returns the deltas to send now (content, or tool_calls fragments as OpenAI sends them);
    `finish` returns the last ones, once the choice is done, and whether calls were made."""

    plan: ToolPlan
    _text: str = ""
    _sent: int = 0  # characters of _text already sent as content
    _holding: bool = False  # inside (or maybe at the start of) a tool call: wait for the end
    _call_id: str = field(default_factory=new_call_id)

    def feed(self, piece: str) -> list[dict[str, Any]]:
        if not piece:
            return []
        self._text += piece
        plan = self.plan
        if plan.forced and plan.choice != "required":
            # A named function: the text is its arguments, streamed as they come.
            if self._sent == 0 and self._text == piece:
                self._sent = len(self._text)
                return [_fragment(0, self._call_id, plan.choice, piece)]
            self._sent = len(self._text)
            return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}]
        if plan.choice == "required":
            return []  # an array of calls: sent whole at the end
        if plan.choice == "none":
            return [{"content": piece}]
        return self._content_until_a_call()

    def _content_until_a_call(self) -> list[dict[str, Any]]:
        if self._holding:
            return []
        text = self._text
        if self.plan.parser == "llama3_json":
            stripped = text.lstrip()
            if not stripped:
                return []
            if stripped[0] == "{" or _PYTHON_TAG.startswith(stripped[: len(_PYTHON_TAG)]):
                self._holding = True  # maybe a bare JSON call: decided at the end
                return []
            end = len(text)
        else:
            start = text.find(_HERMES_OPEN, self._sent)
            if start >= 0:
                self._holding = True
                end = start
            else:  # hold back what may be the start of a tag
                end = len(text) - _partial_suffix(text, _HERMES_OPEN)
        piece, self._sent = text[self._sent : end], max(self._sent, end)
        return [{"content": piece}] if piece else []

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        plan = self.plan
        if plan.choice == "none":
            return [], False
        if plan.forced and plan.choice != "required":
            return [], True
        content, calls = plan.parse(self._text)
        deltas: list[dict[str, Any]] = []
        if not calls:
            rest = self._text[self._sent :]
            return ([{"content": rest}] if rest else []), False
        if plan.choice == "auto" and plan.parser == "hermes":
            # Text after the calls (rare) is content too.
            after = self._text[self._text.rfind(_HERMES_CLOSE) + len(_HERMES_CLOSE) :]
            if _HERMES_CLOSE in self._text and after.strip():
                deltas.append({"content": after})
        for i, call in enumerate(calls):
            function = call["function"]
            deltas.append(_fragment(i, call["id"], function["name"], function["arguments"]))
        return deltas, True


def plan_tools(req: Any, template: str | None, parser: str = "auto") -> ToolPlan | None:
    """The request's tool plan, or None when it has no tools (then tool_choice must be unset
    or "none"). `template` is the tokenizer's chat template, `parser` --tool-call-parser."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "tools must be a list of functions", param="tools")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of functions", param="tools")
    parameters: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name, schema = _check_tool(i, tool)
        if name in parameters:
            raise APIError(400, f"tools[{i}]: a second function named {name!r}", param="tools")
        parameters[name] = schema
    parallel = req.parallel_tool_calls
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    has_tools = bool(template) and re.search(r"\btools\b", template) is not None
    if parser == "auto":
        parser = "llama3_json" if has_tools and _PYTHON_TAG in template else "hermes"
    return ToolPlan(
        tools, parameters, _tool_choice(choice, parameters), parallel, parser, has_tools
    )


def _check_tool(i: int, tool: Any) -> tuple[str, dict[str, Any]]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(
            400, f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools"
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(400, f"{where}.function must be an object", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError(
            400,
            f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
            param="tools",
        )
    schema = function.get("parameters", ANY_OBJECT)
    try:
        check(StructuredOutputs(json=schema))
    except ValueError as e:
        raise APIError(400, f"{where}.function.parameters: {e}", param="tools") from None
    return name, schema


def _tool_choice(choice: Any, parameters: Mapping[str, Any]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise APIError(
                400,
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function, got "
                f"{choice!r}",
                param="tool_choice",
            )
        return choice
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(
            400,
            'tool_choice must name a function as {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in parameters:
        raise APIError(
            400,
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(parameters)})",
            param="tool_choice",
        )
    return name


# ---- rendering -------------------------------------------------------------------------------


def _tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    signatures = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        "You can call the tools below, each given as a JSON signature:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "To call a tool, answer with a <tool_call></tool_call> block holding a JSON object "
        'with the tool\'s "name" and its "arguments", one block per call:\n'
        '<tool_call>\n{"name": "<tool name>", "arguments": {"<argument>": <value>}}\n'
        "</tool_call>"
    )


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content or ""


def _with_parsed_arguments(i: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """An earlier assistant turn's calls with their arguments as objects (as chat templates
    render them; OpenAI sends them as JSON text)."""
    message = dict(message) if isinstance(message, Mapping) else message
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not calls:
        return message
    if not isinstance(calls, list):
        raise APIError(400, f"messages[{i}].tool_calls must be a list", param="messages")
    parsed = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise APIError(
                400, f"messages[{i}].tool_calls[{j}] needs a function with a name", param="messages"
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise APIError(
                    400,
                    f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                    param="messages",
                ) from None
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": parsed}


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's calls written into its text, for templates that cannot render them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [
        f"{_HERMES_OPEN}\n"
        + json.dumps(
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
            ensure_ascii=False,
        )
        + f"\n{_HERMES_CLOSE}"
        for c in calls
    ]
    text = "\n".join(filter(None, [_text_of(message.get("content")), *blocks]))
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


# ---- parsing ---------------------------------------------------------------------------------


def _call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _fragment(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """The first delta of a streamed call (OpenAI's shape; later ones carry arguments only)."""
    return {
        "tool_calls": [
            {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        ]
    }


def _as_calls(value: Any) -> list[dict[str, Any]]:
    """Calls from a decoded {"name", "arguments" | "parameters"} object or a list of them."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return []
        if not isinstance(arguments, dict):
            return []
        calls.append(_call(item["name"], arguments))
    return calls


def _calls_from_json(text: str) -> list[dict[str, Any]]:
    try:
        return _as_calls(json.loads(text))
    except ValueError:
        return []


def _hermes_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        found = _calls_from_json(block.strip())
        if not found:
            return text, []  # a malformed block: the answer is text, as it came
        calls += found
    content = text[: text.find(_HERMES_OPEN)] if calls else text
    return (content.strip() or None), calls


def _llama3_calls(text: str) -> list[dict[str, Any]]:
    """Llama 3's bare JSON calls, `; `-separated, maybe after <|python_tag|>."""
    rest = text.strip().removeprefix(_PYTHON_TAG).strip()
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except ValueError:
            return []
        found = _as_calls(value)
        if not found:
            return []
        calls += found
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    return calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (what to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
