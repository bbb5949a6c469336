"""Prefix affinity across Ray Serve replicas (server/ray_serve/__init__.py): the routing key the
ingress computes from each request's body, and the state and rule with which the request router
(server/ray_serve/router.py) sends a request to the engine replica that probably holds its
prompt's beginning in its prefix cache. Pure Python: no Ray here.

The rule is the data-parallel router's (engine/frontend/data_parallel.py `pick_by_rule`, the
same constants): the candidates are the replicas whose load is within max(BALANCE_MIN_TOKENS,
BALANCE_FRACTION x least) of the least loaded one; among them the longest cached prefix wins,
then the least load, then the lowest index (replicas in the order of their ids). A replica's
load is the work routed to it and not finished, in (estimated) tokens; its cached prefixes are
an LRU set of the digests of the prompts routed to it.

What the prefix is computed from. The ingress has the request's JSON, not tokens: token block
digests (what PrefixRouter.prefix_hashes chains) would need the tokenizer and the chat template
on the ingress, loaded there and run a second time for every request, only to guess where a
replica's cache starts. So the ingress chains digests of fixed-size chunks of the request's
text instead: the prompt, or the canonical JSON of the tools, the system prompt and then each
message in order. Two requests that share their first k chunks render, through the same template,
to prompts that share about as many tokens (CHUNK_CHARS characters are about one 16-token
block), and only full chunks count, as only full blocks are cached. The chain starts from a
digest of the path and the model (an adapter's KV differs from the base model's). A guess can
only misroute a request (its prefill then runs in full), never change its answer.

The load estimate is CHARS_PER_TOKEN characters a token for the prompt, plus max_tokens (or
DEFAULT_OUTPUT_TOKENS when the request sets none) for each sample.

Where the router runs. Ray Serve runs a router beside each caller of a deployment handle: here in
every ingress replica, each keeping its own loads and prefix sets (with one ingress replica, the
default, that is the whole picture; with several, each sees its share of the traffic). The HTTP
proxy's own router cannot be used: the proxy hands a replica the request's headers and the
replica then pulls the body from the proxy, so a router there never sees the prompt.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.frontend.data_parallel import (
    DEFAULT_PREFIX_BLOCKS,
    leading_known,
    pick_by_rule,
)

CHUNK_CHARS = 64  # characters a prefix digest covers: about one KV block of 16 tokens
CHARS_PER_TOKEN = 4  # English text's average, for the load estimate without a tokenizer
DEFAULT_OUTPUT_TOKENS = 256  # the output a request without max_tokens is counted for
# A request header that sends a request to one replica (its id, as the response header of the
# same name gives it): for a replica's own /metrics, /v1/kv or /dashboard behind the ingress.
REPLICA_HEADER = "x-pagedserve-replica"


@dataclass(frozen=True)
class RoutingKey:
    """What the router needs of a request: its prefix digests, its cost in estimated tokens,
    and the replica it is pinned to (REPLICA_HEADER; None: the rule decides)."""

    hashes: tuple[bytes, ...] = ()
    cost: int = 0
    replica: str | None = None


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress hands it to an engine replica: the ASGI scope's picklable
    part, the whole body, and the routing key the router reads."""

    scope: dict[str, Any]
    body: bytes
    key: RoutingKey


def chunk_digests(text: str, root: bytes) -> tuple[bytes, ...]:
    """Chained digests of the full CHUNK_CHARS-character chunks of `text`: digest i covers
    chunks 0..i, so equal digests mean equal prefixes."""
    digests = []
    parent = root
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = hashlib.blake2b(
            parent + text[start : start + CHUNK_CHARS].encode(), digest_size=16
        ).digest()
        digests.append(parent)
    return tuple(digests)


def prompt_text(body: dict[str, Any]) -> str:
    """The text whose prefix stands for the request's prompt prefix: what the chat template
    renders first comes first (tools, system prompt, instructions), then the messages in order;
    a batch of prompts by its first one. Empty for a body with none of these."""

    def canonical(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts (strings or token lists): the first one's
        return canonical(prompt)
    parts = [canonical(body[name]) for name in ("tools", "system", "instructions") if name in body]
    turns = body.get("messages", body.get("input"))
    if isinstance(turns, list):
        parts += [canonical(turn) for turn in turns]
    elif turns is not None:
        parts.append(canonical(turns))
    return "\n".join(parts)


def request_cost(body: dict[str, Any], prompt_chars: int) -> int:
    """The work a request brings, in estimated tokens (this module's docstring); fields of the
    wrong type count as absent (the replica answers those requests with a 400)."""

    def number(*names: str) -> int | None:
        for name in names:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    output = number("max_tokens", "max_completion_tokens", "max_output_tokens")
    samples = number("best_of", "n") or 1
    return prompt_chars // CHARS_PER_TOKEN + (output or DEFAULT_OUTPUT_TOKENS) * samples


def routing_key(path: str, headers: dict[str, str], body: bytes) -> RoutingKey:
    """The key of an HTTP request: from a JSON body's prompt when it has one (a POST to a
    generation route), else no prefix and no cost; `headers` with lower-case names."""
    pinned = headers.get(REPLICA_HEADER) or None
    try:
        parsed = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if not isinstance(parsed, dict):
        return RoutingKey(replica=pinned)
    text = prompt_text(parsed)
    model = parsed.get("model")
    root = hashlib.blake2b(f"{path}\0{model}".encode(), digest_size=16).digest()
    return RoutingKey(chunk_digests(text, root), request_cost(parsed, len(text)), pinned)


class AffinityTable:
    """The router's state over replicas named by their ids: loads, prefix sets and the requests
    in flight, and the rule's ranking of the replicas for a request. Thread-safe."""

    def __init__(self, max_chunks: int = DEFAULT_PREFIX_BLOCKS) -> None:
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self.max_chunks = max_chunks
        self.loads: dict[str, int] = {}
        self._prefixes: dict[str, OrderedDict[bytes, None]] = {}
        self._in_flight: dict[str, tuple[str, int]] = {}  # request id -> (replica, cost)
        self._lock = threading.Lock()

    def cached_chunks(self, replica: str, hashes: Sequence[bytes]) -> int:
        """How many of the leading digests of `hashes` were routed to `replica` (and are still
        remembered)."""
        return leading_known(hashes, self._prefixes.get(replica, {}))

    def rank(self, replicas: Sequence[str], hashes: Sequence[bytes]) -> list[str]:
        """`replicas` in the order the rule prefers them: its pick, then its pick among the
        rest, and so on (Ray tries the next when a replica is full)."""
        with self._lock:
            remaining = list(replicas)
            order = []
            while remaining:
                loads = [self.loads.get(r, 0) for r in remaining]
                cached = [self.cached_chunks(r, hashes) for r in remaining]
                order.append(remaining.pop(pick_by_rule(loads, cached)))
            return order

    def routed(self, replica: str, request_id: str, hashes: Sequence[bytes], cost: int) -> None:
        """A request went to `replica`: its cost joins the load, its prefix the replica's set,
        until `completed(request_id)`."""
        with self._lock:
            self.loads[replica] = self.loads.get(replica, 0) + cost
            self._in_flight[request_id] = (replica, cost)
            known = self._prefixes.setdefault(replica, OrderedDict())
            for digest in hashes:
                known[digest] = None
                known.move_to_end(digest)
            while len(known) > self.max_chunks:  # least recently routed first, as caches evict
                known.popitem(last=False)

    def completed(self, request_id: str) -> None:
        with self._lock:
            replica, cost = self._in_flight.pop(request_id, (None, 0))
            if replica in self.loads:
                self.loads[replica] -= cost

    def forget(self, replica: str) -> None:
        """The replica is gone (stopped or dead): a replacement starts with an empty cache."""
        with self._lock:
            self.loads.pop(replica, None)
            self._prefixes.pop(replica, None)
