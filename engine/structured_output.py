"""Structured outputs: grammars that constrain what a request may generate, on xgrammar.

A request's `SamplingParams.structured_outputs` (a JSON schema, any JSON object, a regex, a
choice or an EBNF grammar) is checked where the request enters the engine (`check`: a bad one
is a ValueError, a 400 over HTTP), compiled against the model's vocabulary once per distinct
constraint (`StructuredOutputManager.compile`, on a worker thread; xgrammar caches compiled
grammars), and followed by one matcher per sample: each step the matcher of every constrained
sampling row writes the row's allowed tokens into a bitmask (32 tokens per int32 word, bit
i % 32 of word i // 32; `Sampler` masks the logits with it), and the sampled tokens advance it.

A spec with a `reasoning_end` (`</think>`) leaves its samples free until their output's text
has written it: the matcher starts on the tokens after the one that completes it (text a
tokenizer without a `</think>` token writes after it within that token, past whitespace, is
given to the matcher as a string).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Container, Sequence
from concurrent import futures
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from pagedserve.scheduler import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

# `json_object`: any JSON object.
ANY_OBJECT = '{"type": "object"}'
# Every token allowed: an all-ones word.
ALL_ALLOWED = -1
# xgrammar's errors start with "[time] /path/file.cc:line: "; the rest is the message.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def _clean(error: Exception) -> str:
    return _CPP_PREFIX.sub("", str(error)).strip()


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string literals are valid
    EBNF string literals in xgrammar's dialect)."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@lru_cache(maxsize=256)
def check(spec: StructuredOutputs) -> None:
    """Build `spec`'s grammar without a vocabulary (cheap): raises ValueError saying what is
    wrong with a schema, regex or grammar xgrammar cannot take. Cached per spec."""
    import xgrammar as xgr

    what = spec.kinds[0]
    try:
        if spec.json is not None:
            xgr.Grammar.from_json_schema(spec.json)
        elif spec.regex is not None:
            xgr.Grammar.from_regex(spec.regex)
        elif spec.choice is not None:
            xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
        elif spec.grammar is not None:
            xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        names = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
        raise ValueError(f"invalid {names[what]} for structured outputs: {_clean(e)}") from None


class StructuredOutputManager:
    """The engine core's grammars: compiles them (a worker thread; xgrammar's compiler caches
    each distinct one) and keeps one matcher per constrained sample.

    The tokenizer's vocabulary is read on first use, so engines that never see a constrained
    request pay nothing."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        any_whitespace: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.any_whitespace = any_whitespace  # in JSON (EngineConfig.json_any_whitespace)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        # Grammars compiling, each with the samples that wait for it.
        self.compiling: list[tuple[Future, list[str]]] = []
        self.matchers: dict[str, xgrammar.GrammarMatcher] = {}
        self._grammars: dict[str, xgrammar.CompiledGrammar] = {}  # by sample, for restarts
        # Reasoning (spec.reasoning_end): each token's bytes, the end each sample waits for
        # (from `compile` on), and the samples still reasoning with their output's last bytes.
        self._token_bytes: list[bytes] = []
        self._reasoning_ends: dict[str, bytes] = {}
        self._reasoning: dict[str, bytes] = {}

    # ---- compiling -------------------------------------------------------------------------

    def compile(self, spec: StructuredOutputs, request_ids: list[str]) -> None:
        """Start compiling `spec` for these samples; `compiled` gives it back."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-grammar")
        if spec.reasoning_end is not None:
            self._reasoning_ends.update(dict.fromkeys(request_ids, spec.reasoning_end.encode()))
        self.compiling.append((self._executor.submit(self.compile_now, spec), request_ids))

    def compiled(self, wait: bool) -> list[tuple[list[str], xgrammar.CompiledGrammar | Exception]]:
        """The grammars done compiling since the last call, with their samples: each the
        compiled grammar, or what failed (a ValueError saying why, for a bad spec). `wait`:
        block until one is done."""
        if wait and self.compiling:
            futures.wait([future for future, _ in self.compiling], return_when=FIRST_COMPLETED)
        done, still = [], []
        for entry in self.compiling:  # (each future looked at once: one may finish meanwhile)
            (done if entry[0].done() else still).append(entry)
        self.compiling = still
        return [(ids, future.exception() or future.result()) for future, ids in done]

    def compile_now(self, spec: StructuredOutputs) -> xgrammar.CompiledGrammar:
        compiler = self._get_compiler()
        try:
            if spec.json is not None or spec.json_object:
                # JSON mode is any object (xgrammar's builtin grammar takes arrays too).
                schema = ANY_OBJECT if spec.json_object else spec.json
                return compiler.compile_json_schema(schema, any_whitespace=self.any_whitespace)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            text = choice_grammar(spec.choice) if spec.choice is not None else spec.grammar
            return compiler.compile_grammar(text)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"structured outputs: {_clean(e)}") from None

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info)
                self._token_bytes = list(info.decoded_vocab)
            return self._compiler

    # ---- matchers --------------------------------------------------------------------------

    def start(self, request_id: str, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.matchers[request_id] = xgr.GrammarMatcher(compiled)
        self._grammars[request_id] = compiled
        if request_id in self._reasoning_ends:
            self._reasoning[request_id] = b""

    def retain(self, live: Container[str]) -> None:
        """Forget the matchers of samples that are no longer live (finished, aborted, failed)."""
        for request_id in [r for r in self.matchers if r not in live]:
            del self.matchers[request_id], self._grammars[request_id]
            self._reasoning.pop(request_id, None)
        for request_id in [r for r in self._reasoning_ends if r not in live]:
            del self._reasoning_ends[request_id]

    def is_reasoning(self, request_id: str) -> bool:
        """Whether the sample has yet to write its reasoning's end (its grammar waits)."""
        return request_id in self._reasoning

    def _after_reasoning(self, tail: bytes, end: bytes) -> tuple[bytes, bytes | None]:
        """(the bytes to keep watching, the text after `end`: None while it has not come)."""
        at = tail.find(end)
        if at < 0:
            return tail[max(0, len(tail) - len(end) + 1) :], None
        return b"", tail[at + len(end) :]

    def _token_text(self, token_id: int) -> bytes:
        tokens = self._token_bytes
        return tokens[token_id] if 0 <= token_id < len(tokens) else b""

    def is_terminated(self, request_id: str) -> bool:
        """Whether the sample's grammar is complete and has taken its stop token."""
        matcher = self.matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()

    def accept(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advance the sample's matcher by its new tokens; False when the grammar refuses one
        (a token sampled outside the mask: only a bug or a NaN row can do that)."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return True
        for token_id in token_ids:
            if request_id in self._reasoning:
                tail = self._reasoning[request_id] + self._token_text(token_id)
                tail, rest = self._after_reasoning(tail, self._reasoning_ends[request_id])
                if rest is None:
                    self._reasoning[request_id] = tail
                    continue
                del self._reasoning[request_id]
                if rest.strip() and not matcher.accept_string(rest):
                    return False
                continue
            if matcher.is_terminated():
                return True  # the grammar ended at a stop token; nothing more to follow
            if not matcher.accept_token(token_id):
                return False
        return True

    def restart(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """The sample's matcher again from the start, having accepted `token_ids` (its output
        after a rewind)."""
        if request_id not in self.matchers:
            return True
        self.start(request_id, self._grammars[request_id])
        return self.accept(request_id, token_ids)

    def fill(self, request_id: str, drafts: Sequence[int], out: np.ndarray) -> None:
        """Write the sample's allowed tokens into `out` [1 + len(drafts), words]: row 0 for its
        next token, row j for the token after its first j drafts. A draft the grammar refuses
        leaves the rows after it all-allowed: the token before it was sampled under a mask that
        excludes it, so verification rejects it and nothing after it is kept."""
        matcher = self.matchers[request_id]
        if request_id in self._reasoning:
            out[:] = ALL_ALLOWED  # still reasoning: anything goes
            tail, end = self._reasoning[request_id], self._reasoning_ends[request_id]
            for j, draft in enumerate(drafts, start=1):
                tail, rest = self._after_reasoning(tail + self._token_text(draft), end)
                if rest is not None:  # draft j ends the reasoning: the grammar from there on
                    if not rest.strip():  # (text after the end within the token: left free)
                        self._fill(matcher, drafts[j:], out[j:])
                    return
            return
        self._fill(matcher, drafts, out)

    @staticmethod
    def _fill(matcher: xgrammar.GrammarMatcher, drafts: Sequence[int], out: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(out, 0)
        accepted = 0
        for j, draft in enumerate(drafts, start=1):
            if matcher.is_terminated() or not matcher.accept_token(draft):
                out[j:] = ALL_ALLOWED
                break
            accepted += 1
            matcher.fill_next_token_bitmask(out, j)
        if accepted:
            matcher.rollback(accepted)
