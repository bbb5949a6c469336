"""The base of every API's request body (pydantic): fields the server does not know are kept,
then logged and ignored by the handler (`warn_unknown_fields`), as vLLM does, so that a client
sending another server's extras still gets an answer."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())
