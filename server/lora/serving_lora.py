"""The LoRA adapters a server serves by name: those of --lora-modules, loaded at start-up, and
those loaded and unloaded at run time through vLLM's `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` (behind the API key, as every /v1 route).

A request names an adapter in its `model` field (`resolve_model`); the adapter's LoRARequest then
travels with the request to the engine core, whose worker reads the weights from its path when it
first needs them (engine/lora/slots.py). Unloading removes the name at once, so new requests get a
404, while the requests already running with it finish with it.
"""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagedserve.engine.frontend.client import EngineClient
from pagedserve.scheduler import LoRARequest
from pagedserve.server.errors import APIError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str | None = None
    lora_int_id: int | None = None


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules value, `name=path` or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`: (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(
                f'--lora-modules {text!r}: the JSON form needs "name" and "path" keys'
            ) from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: give each adapter as name=path")
    return name, path


class LoRAAdapters:
    """The adapters by name; ids count up from 1 and are never reused (engine/lora's blocks and
    slots are keyed by id)."""

    def __init__(self, engine: EngineClient, base_names: tuple[str, ...]) -> None:
        self.engine = engine
        self.base_names = base_names
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.engine.inputs.max_lora_rank is not None

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def cards(self) -> list[tuple[str, str]]:
        """(name, path) of each adapter, in load order."""
        return [(r.lora_name, r.lora_path) for r in self._by_name.values()]

    def load(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the model (ValueError: why it does not fit) and serve it
        under `name`."""
        if not self.enabled:
            raise APIError(
                400,
                "this server serves no LoRA adapters: start it with --enable-lora (or "
                "--lora-modules)",
                param="lora_name",
            )
        if name in self.base_names:
            raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
        with self._lock:
            if name in self._by_name:
                raise APIError(
                    400, f"The lora adapter '{name}' has already been loaded.", param="lora_name"
                )
            lora = LoRARequest(name, next(self._ids), path)
        self.engine.inputs.check_lora(lora)  # reads the files: outside the lock
        with self._lock:
            if name in self._by_name:  # loaded meanwhile by another request
                raise APIError(
                    400, f"The lora adapter '{name}' has already been loaded.", param="lora_name"
                )
            self._by_name[name] = lora
        return lora

    def unload(self, name: str | None, lora_int_id: int | None) -> str:
        with self._lock:
            lora = self._by_name.get(name) if name is not None else None
            if lora is None and lora_int_id is not None:
                lora = next(
                    (r for r in self._by_name.values() if r.lora_int_id == lora_int_id), None
                )
            if lora is None:
                raise APIError(
                    404,
                    f"The lora adapter '{name if name is not None else lora_int_id}' cannot be "
                    "found.",
                    param="lora_name",
                    code="model_not_found",
                )
            del self._by_name[lora.lora_name]
        return lora.lora_name


def add_lora_routes(v1: APIRouter, adapters: LoRAAdapters) -> None:
    @v1.post("/load_lora_adapter")
    def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        # (a plain def: FastAPI runs it on a worker thread, and reading the files blocks)
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        try:
            adapters.load(body.lora_name, body.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' added successfully.", status_code=200
        )

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if body.lora_name is None and body.lora_int_id is None:
            raise APIError(400, "Either 'lora_name' or 'lora_int_id' must be provided.")
        name = adapters.unload(body.lora_name, body.lora_int_id)
        return PlainTextResponse(
            f"Success: LoRA adapter '{name}' removed successfully.", status_code=200
        )


def adapter_card(base: dict[str, Any], name: str, path: str, parent: str) -> dict[str, Any]:
    """An adapter's /v1/models entry: the base model's card with its own id, root and parent."""
    return {**base, "id": name, "root": path, "parent": parent}
