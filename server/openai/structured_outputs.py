"""The request fields that constrain an output: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields, turned into the engine's
`StructuredOutputs`. A malformed one, two at once, or a schema, regex or grammar the grammar
library cannot build is a 400 naming the field."""

from __future__ import annotations

from typing import Any

from pagedserve.engine.structured_output import check
from pagedserve.scheduler import StructuredOutputs
from pagedserve.server.errors import APIError

# vLLM's older fields -> the StructuredOutputs field each sets.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
# guided_decoding_backend values this server honours: it has one grammar library.
BACKENDS = ("auto", "xgrammar")


def structured_outputs_of(req: Any) -> StructuredOutputs | None:
    """The constraint a completions or chat request asks for, or None."""
    sources: list[tuple[str, StructuredOutputs]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            sources.append(("response_format", spec))
    if req.structured_outputs is not None:
        sources.append(("structured_outputs", _structured(req.structured_outputs)))
    for field, key in GUIDED_FIELDS.items():
        value = getattr(req, field)
        if value is not None:
            sources.append((field, _build(field, {key: value})))
    backend = req.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise APIError(
            400,
            f"guided_decoding_backend {backend!r} is not available; this server uses xgrammar "
            f"(accepted: {', '.join(BACKENDS)})",
            param="guided_decoding_backend",
        )
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(field for field, _ in sources)
        raise APIError(
            400, f"only one field may constrain the output, got {names}", param=sources[1][0]
        )
    field, spec = sources[0]
    try:
        check(spec)
    except ValueError as e:
        raise APIError(400, str(e), param=field) from None
    return spec


def _response_format(value: Any) -> StructuredOutputs | None:
    field = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError(
            400,
            'response_format must be an object with a "type": "text", "json_object" or '
            f'"json_schema", got {value!r}',
            param=field,
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise APIError(
            400,
            f'response_format type {kind!r} is not supported; use "text", "json_object" or '
            '"json_schema"',
            param=field,
        )
    json_schema = value.get("json_schema")
    if not isinstance(json_schema, dict) or "schema" not in json_schema:
        raise APIError(
            400,
            'response_format "json_schema" needs "json_schema": {"name": ..., "schema": {...}}',
            param=field,
        )
    return _build(field, {"json": json_schema["schema"]})


def _structured(value: Any) -> StructuredOutputs:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise APIError(
            400,
            f"structured_outputs must be an object with one of {', '.join(STRUCTURED_KEYS)}, "
            f"got {value!r}",
            param=field,
        )
    unknown = sorted(set(value) - set(STRUCTURED_KEYS))
    if unknown:
        raise APIError(
            400,
            f"structured_outputs.{unknown[0]} is not supported; use one of "
            f"{', '.join(STRUCTURED_KEYS)}",
            param=field,
        )
    return _build(field, {k: v for k, v in value.items() if v is not None and v is not False})


def _build(field: str, fields: dict[str, Any]) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{field}: {e}", param=field) from None
