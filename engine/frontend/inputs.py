"""What a prompt becomes once the engine has accepted it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedserve.engine.lora.adapter import load_adapter
from pagedserve.engine.structured_output import check as check_structured_outputs
from pagedserve.scheduler import LoRARequest, SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.models.bert_config import PoolingConfig
    from pagedserve.engine.models.model_config import ModelConfig


# An embedding request's params: the step that pools its prompt ends it (max_tokens 1).
EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, output_kind="final")


@dataclass(frozen=True)
class AudioPrompt:
    """A request to an encoder-decoder model (Whisper): the decoder's prompt token ids and the
    audio its encoder takes (16 kHz mono float32 samples, one window of at most
    `WhisperConfig.window_samples`)."""

    token_ids: Sequence[int]
    audio: np.ndarray


@dataclass(frozen=True)
class Prompt:
    """A prompt that passed `InputProcessor.process_prompt`: its token ids (non-empty, inside the
    vocabulary, shorter than max_model_len) and its text when it came as text.

    Holding a Prompt is the proof that the checks ran: `add_request` and the layers under it do not
    repeat them. Build one through `process_prompt`, not by hand."""

    token_ids: list[int]
    text: str | None = None
    encoder_input: bytes | None = None  # an AudioPrompt's audio, as the core takes it


@dataclass(frozen=True)
class NewRequest:
    """A checked request on its way to a core, whichever client carries it: its id, prompt,
    sampling parameters and arrival time (seconds since the epoch)."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    arrival_time: float
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class InputProcessor:
    """Where a prompt is checked, once, before it is queued: in the caller's process, whether the
    engine core runs there or in its own. Safe from any thread: it reads only the tokenizer and
    two numbers."""

    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        max_audio_samples: int = 0,
        pooling: PoolingConfig | None = None,
        hidden_size: int = 0,
        model_config: ModelConfig | None = None,
        max_lora_rank: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_audio_samples = max_audio_samples  # 0: the model takes no audio
        # An embedding engine's pooling (every request is pooled), and its vectors' size.
        self.pooling = pooling
        self.hidden_size = hidden_size
        # LoRA (None: the engine serves no adapters): adapters are checked against the model
        # here, once per adapter id, before any request of theirs is queued.
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self._checked_loras: dict[int, str] = {}  # adapter id -> its path, checked

    @classmethod
    def for_model(
        cls,
        tokenizer,
        max_model_len: int,
        config: ModelConfig,
        pooling: PoolingConfig | None = None,
        max_lora_rank: int | None = None,
    ) -> InputProcessor:
        """`max_lora_rank`: the engine's, when it serves LoRA adapters (None: it serves none)."""
        audio = config.whisper.window_samples if config.is_encoder_decoder else 0
        return cls(
            tokenizer, max_model_len, config.vocab_size, audio, pooling, config.hidden_size,
            config, max_lora_rank,
        )  # fmt: skip

    def check_lora(self, lora: LoRARequest | None) -> None:
        """Refuse (ValueError) an adapter this engine cannot run: LoRA is off, its files are
        missing or unreadable, or they do not fit the model (engine/lora/adapter.py says what is
        checked). Reads the adapter once per id."""
        if lora is None or self._checked_loras.get(lora.lora_int_id) == lora.lora_path:
            return
        if self.max_lora_rank is None or self.model_config is None:
            raise ValueError(
                f"adapter {lora.lora_name!r}: this engine serves no LoRA adapters; start it with "
                "--enable-lora (or the server's --lora-modules)"
            )
        load_adapter(lora.lora_path, self.model_config, self.max_lora_rank, lora.lora_name)
        self._checked_loras[lora.lora_int_id] = lora.lora_path

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def process_prompt(self, prompt: str | Sequence[int] | Prompt | AudioPrompt) -> Prompt:
        """Tokenize text, then refuse (ValueError) an empty prompt, ids outside the vocabulary,
        and a prompt that leaves no room for one output token; an encoder-decoder model takes
        AudioPrompts only, with audio of one window. A Prompt is returned as it is."""
        if isinstance(prompt, Prompt):
            return prompt
        if isinstance(prompt, AudioPrompt):
            audio = self._audio(prompt.audio)
            return Prompt(self._checked_ids(list(prompt.token_ids)), None, audio)
        if self.max_audio_samples:
            raise ValueError(
                "this is a Whisper model: it transcribes audio (POST /v1/audio/transcriptions, "
                "or an AudioPrompt), it does not continue text"
            )
        if isinstance(prompt, str):
            # "" is an empty prompt, not the bos token the tokenizer would add to it.
            text, token_ids = prompt, self.tokenize(prompt) if prompt else []
        else:
            text, token_ids = None, list(prompt)
        return Prompt(self._checked_ids(token_ids), text)

    def process_embedding_prompt(self, prompt: str | Sequence[int] | Prompt) -> Prompt:
        """An embedding engine's prompt: tokenized, not empty, inside the vocabulary, and at most
        max_model_len tokens (it runs whole in one step, and nothing is generated after it).
        ValueError for a model that generates instead."""
        if self.pooling is None:
            raise ValueError(
                "this model generates text; it serves no embeddings (serve an embedding model, "
                "or this one with --task embed)"
            )
        if isinstance(prompt, Prompt):
            return prompt
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt) if prompt else []
        else:
            text, token_ids = None, list(prompt)
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"input has {len(token_ids)} tokens but this embedding model takes at most "
                f"{self.max_model_len}; shorten it"
            )
        return Prompt(self._checked_ids(token_ids, output_room=False), text)

    def _checked_ids(self, token_ids: list[int], output_room: bool = True) -> list[int]:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if output_room and len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}: it must be shorter to leave room for one output token"
            )
        vocab = self.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        return token_ids

    def _audio(self, audio: np.ndarray) -> bytes:
        if not self.max_audio_samples:
            raise ValueError("this model takes no audio: give a text or token prompt")
        samples = np.asarray(audio)
        if samples.ndim != 1 or not 0 < len(samples) <= self.max_audio_samples:
            raise ValueError(
                f"the audio must be one window of 1 to {self.max_audio_samples} samples (16 kHz "
                f"mono), got shape {samples.shape}"
            )
        return samples.astype(np.float32).tobytes()

    def process_inputs(
        self,
        prompt: str | Sequence[int] | Prompt | AudioPrompt,
        params: SamplingParams,
        lora: LoRARequest | None = None,
    ) -> Prompt:
        """`process_prompt`, the params' type (their values were checked when they were built),
        their structured outputs' grammar (`structured_output.check`) and the adapter
        (`check_lora`)."""
        self.check_lora(lora)
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        if self.pooling is not None and params is not EMBEDDING_PARAMS:
            raise ValueError(
                "this is an embedding model: it serves embeddings (POST /v1/embeddings, "
                "LLM.embed), it does not generate text"
            )
        if params is EMBEDDING_PARAMS:
            return self.process_embedding_prompt(prompt)
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
        params.check_token_ids(self.vocab_size)
        if isinstance(prompt, AudioPrompt) and (
            params.num_samples > 1 or params.use_beam_search or params.structured_outputs
        ):
            raise ValueError(
                "an audio request samples one sequence: n, best_of, beam search and structured "
                "outputs do not apply"
            )
        return self.process_prompt(prompt)


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token ids of each bad word as vLLM finds them: the word (leading spaces stripped)
    alone, and after a space when that spelling starts with another token of the same length
    (a word in the middle of a text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if bare:
            out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return tuple(out)
