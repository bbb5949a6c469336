"""What a prompt becomes once the engine has accepted it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedserve.engine.structured_output import check as check_structured_outputs
from pagedserve.scheduler import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.models.model_config import ModelConfig


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


class InputProcessor:
    """Where a prompt is checked, once, before it is queued: in the caller's process, whether the
    engine core runs there or in its own. Safe from any thread: it reads only the tokenizer and
    two numbers."""

    def __init__(
        self, tokenizer, max_model_len: int, vocab_size: int, max_audio_samples: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_audio_samples = max_audio_samples  # 0: the model takes no audio

    @classmethod
    def for_model(cls, tokenizer, max_model_len: int, config: ModelConfig) -> InputProcessor:
        audio = config.whisper.window_samples if config.is_encoder_decoder else 0
        return cls(tokenizer, max_model_len, config.vocab_size, audio)

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

    def _checked_ids(self, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:
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
        self, prompt: str | Sequence[int] | Prompt | AudioPrompt, params: SamplingParams
    ) -> Prompt:
        """`process_prompt`, the params' type (their values were checked when they were built)
        and their structured outputs' grammar (`structured_output.check`)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
        if isinstance(prompt, AudioPrompt) and (
            params.num_samples > 1 or params.use_beam_search or params.structured_outputs
        ):
            raise ValueError(
                "an audio request samples one sequence: n, best_of, beam search and structured "
                "outputs do not apply"
            )
        return self.process_prompt(prompt)
