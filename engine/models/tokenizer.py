"""Tokenizer loading (transformers), the synthetic tokenizer for models without one, and the
prompt helpers the engine and server share."""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.model_source import (
    EMBEDDED_MODELS,
    TOKENIZER_FILES,
    ModelSource,
    embedded_model_path,
    gguf_files_for_everyone,
    resolve_model,
)
from pagedserve.kernels.paths import cache_dir

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# The synthetic tokenizer's chat template: one "<|role|>content" line per message.
SYNTHETIC_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Every ordinary synthetic token string, "<123>" or "<0x3F>", is one match of this pattern.
_SYNTHETIC_PIECE = r"<(?:[0-9]+|0x[0-9A-F]{2})>"
_NUM_BYTES = 256


def load_tokenizer(
    source: ModelSource | str | Path, tokenizer: str | Path | None = None
) -> PreTrainedTokenizerBase:
    """A transformers tokenizer for a model source (or a folder, a .gguf file, a model name).

    `tokenizer` overrides where it comes from (like `--tokenizer`). Without an override, a
    model source with no tokenizer of its own (a built-in shape, a config.json file or a Hugging
    Face folder without tokenizer files, a GGUF file without a vocabulary) gets
    `synthetic_tokenizer(source.config)`, with a warning. An explicit path or name must hold a
    real tokenizer.

    Reads local files only. A GGUF file's tokenizer is converted once and then loaded from
    pagedserve's cache (`_gguf_tokenizer`).
    """
    if tokenizer is not None:
        source = tokenizer
    elif isinstance(source, ModelSource) and not _has_tokenizer(source):
        logger.warning(
            "model %r has no tokenizer: using a synthetic one over its %d token ids; text in and "
            "out is not the real model's; pass --tokenizer DIR for real text",
            source.name,
            source.config.vocab_size,
        )
        return synthetic_tokenizer(source.config, name=f"synthetic:{source.name}")
    path = _tokenizer_path(source)
    # Never run a folder's own Python (auto_map): transformers asks on a terminal when
    # trust_remote_code is left unset, so it is refused here outright.
    options = dict(local_files_only=True, trust_remote_code=False)
    try:
        if path.is_file():
            return _gguf_tokenizer(path, options)
        return AutoTokenizer.from_pretrained(path, **options)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise ValueError(
                f"the tokenizer in {str(path)!r} needs Python code of its own (auto_map), which "
                "pagedserve never runs; use a folder with a standard tokenizer (tokenizer.json), "
                "or pass --tokenizer DIR"
            ) from None
        raise ValueError(f"could not load a tokenizer from {str(path)!r}: {e}") from e


def _gguf_tokenizer(path: Path, options: dict[str, Any]) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file, kept in the cache as a Hugging Face tokenizer folder.

    transformers rebuilds a GGUF file's tokenizer from its metadata in Python, which is slow for
    large vocabularies and was paid by the API server and by the engine core at every start; the
    folder it saves loads many times faster (docs/benchmarks-history.md, "Start-up"). The cache key
    is the file (path, size, modification time) and the versions of the code that converted it.
    """
    root = cache_dir()
    if root is None:
        return _convert_gguf_tokenizer(path, options)
    stat = path.stat()
    key = "\0".join(
        (str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns),
         transformers.__version__, tokenizers.__version__)
    )  # fmt: skip
    folder = root / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]
    if (folder / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(folder, **options)
        except (OSError, ValueError) as e:
            logger.warning(
                "converting again: the cached tokenizer in %s is unreadable: %s", folder, e
            )
            shutil.rmtree(folder, ignore_errors=True)
    tokenizer = _convert_gguf_tokenizer(path, options)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed into place: a reader never sees half a folder, and of two
        # processes converting at once the second's rename fails harmlessly.
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
        try:
            tokenizer.save_pretrained(staging)
            staging.rename(folder)
        except OSError:
            if not (folder / "tokenizer.json").is_file():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        logger.warning("could not cache the tokenizer of %s in %s: %s", path, folder, e)
    return tokenizer


def _convert_gguf_tokenizer(path: Path, options: dict[str, Any]) -> PreTrainedTokenizerBase:
    with gguf_files_for_everyone():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, **options)


def _has_tokenizer(source: ModelSource) -> bool:
    path = source.tokenizer_source
    if path is None:
        return False
    if source.gguf_reader is not None and path == source.gguf_file:
        # A GGUF file may be written without a vocabulary (llama.cpp: no tokenizer.ggml.tokens,
        # or tokenizer model "none").
        fields = source.gguf_reader.fields
        model = fields.get("tokenizer.ggml.model")
        return "tokenizer.ggml.tokens" in fields and (model is None or model.contents() != "none")
    return path.is_file() or any((path / name).is_file() for name in TOKENIZER_FILES)


def _tokenizer_path(source: ModelSource | str | Path) -> Path:
    if isinstance(source, ModelSource):
        if source.tokenizer_source is None:
            raise ValueError(
                f"model {source.name!r} has no tokenizer of its own; give a tokenizer "
                f"(a Hugging Face folder, a .gguf file or {', '.join(EMBEDDED_MODELS)})"
            )
        return source.tokenizer_source
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"tokenizer file {str(path)!r} is not a .gguf file")
        return path
    if path.is_dir():
        if any((path / name).is_file() for name in TOKENIZER_FILES):
            return path
        gguf_files = sorted(path.glob("*.gguf"))
        if len(gguf_files) == 1:
            return gguf_files[0]
        raise ValueError(
            f"directory {str(path)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) "
            "and not exactly one .gguf file"
        )
    if str(source).lower() in EMBEDDED_MODELS:
        return embedded_model_path(str(source))
    # Not a path or an embedded name: let resolve_model explain what was tried.
    return _tokenizer_path(resolve_model(str(source)))


# ---------------------------------------------------------------------- synthetic tokenizer


def synthetic_tokenizer(config: ModelConfig, name: str = "synthetic") -> PreTrainedTokenizerFast:
    """A tokenizer over all `config.vocab_size` ids for a model that has none (dummy weights).

    Each id has one string, and decoding concatenates them:

        id                                      string
        config.bos_token_id (special)           "<|bos|>"
        config.eos_token_ids[0] (special)       "<|eos|>"  ("<|endoftext|>" when bos == eos)
        config.eos_token_ids[k] (special)       "<|eos1|>", "<|eos2|>", ...
        the first 256 other ids, in order       "<0x00>" ... "<0xFF>": byte tokens
        every other id i                        "<i>" (decimal, e.g. "<4821>")

    Every string starts with "<", ends with ">" and holds no other "<" or ">", and only the
    special ones hold "|", so a decoded id list splits back into exactly its tokens:
    `encode(decode(ids)) == ids` for any ids (no BOS is added). Text that is not made of token
    strings falls back to the byte tokens of its UTF-8 bytes (SentencePiece-style byte
    fallback), so any text encodes, one token per byte. A vocabulary too small to hold the 256
    byte tokens besides the special ones has none: such text encodes to one unknown token per
    character, the lowest non-special id.

    Marked with `is_synthetic = True` (see `is_synthetic_tokenizer`).
    """
    special: dict[int, str] = {}
    if config.bos_token_id is not None:
        special[config.bos_token_id] = "<|bos|>"
    eos_id = config.eos_token_ids[0] if config.eos_token_ids else None
    if eos_id is not None:
        special[eos_id] = "<|endoftext|>" if eos_id == config.bos_token_id else "<|eos|>"
    for k, token_id in enumerate(config.eos_token_ids[1:], start=1):
        special.setdefault(token_id, f"<|eos{k}|>")
    ordinary_ids = [i for i in range(config.vocab_size) if i not in special]
    num_bytes = _NUM_BYTES if len(ordinary_ids) >= _NUM_BYTES else 0
    vocab = {token: i for i, token in special.items()}
    vocab.update((f"<0x{b:02X}>", i) for b, i in enumerate(ordinary_ids[:num_bytes]))
    vocab.update((f"<{i}>", i) for i in ordinary_ids[num_bytes:])
    # No merges: with ignore_merges a piece that is a token string is looked up whole, and any
    # other piece falls back to bytes (or to unk) character by character.
    unk = None
    if not num_bytes:
        unk = f"<{ordinary_ids[0]}>" if ordinary_ids else next(iter(special.values()))
    backend = Tokenizer(
        models.BPE(
            vocab=vocab, merges=[], byte_fallback=bool(num_bytes), ignore_merges=True, unk_token=unk
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(_SYNTHETIC_PIECE), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in special.values()]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        name_or_path=name,
        bos_token=special.get(config.bos_token_id),
        eos_token=special.get(eos_id),
        chat_template=SYNTHETIC_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=config.max_position_embeddings,
    )
    tokenizer.is_synthetic = True
    return tokenizer


def is_synthetic_tokenizer(tokenizer: Any) -> bool:
    """True for a tokenizer made by `synthetic_tokenizer` (text is not the real model's)."""
    return getattr(tokenizer, "is_synthetic", False) is True


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a completion prompt, exactly as `tokenizer.encode(text)` gives them.

    Special tokens (e.g. BOS) are added only where the tokenizer's own default adds them:
    SmolLM2 adds none, Llama 3 adds <|begin_of_text|>.
    """
    return list(tokenizer.encode(text))


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and flatten OpenAI content parts into strings.

    `content` may be a string, None (an assistant turn with tool calls) or a list of
    `{"type": "text", "text": ...}` parts, which are joined with newlines (as vLLM does).
    Other keys (name, tool_calls, tool_call_id) pass through to the template.
    """
    if not messages:
        raise ValueError("messages must contain at least one message")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role {role!r} is not one of {', '.join(CHAT_ROLES)}")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, Sequence):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ValueError(
                        f"messages[{i}].content[{j}] has type {kind!r}; only 'text' parts are "
                        "supported"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}].text must be a string")
                texts.append(part["text"])
            text = "\n".join(texts)
        else:
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        normalized.append({**message, "content": text})
    return normalized


def render_chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat prompt as text (what `apply_chat_template` tokenizes)."""
    result = _run_template(
        tokenizer, messages, add_generation_prompt, chat_template, False, template_kwargs
    )
    return str(result)


# Arguments of transformers' apply_chat_template that decide what it returns, or that the server
# passes itself: a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "chat_template",
        "add_generation_prompt",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of a chat conversation, equal to transformers' own `apply_chat_template`.

    Raises ValueError when the tokenizer has no chat template (and none is given), for bad
    roles or content parts, and when the template itself rejects the conversation.
    """
    result = _run_template(
        tokenizer, messages, add_generation_prompt, chat_template, True, template_kwargs
    )
    return _as_id_list(result)


def _run_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    chat_template: str | None,
    tokenize: bool,
    template_kwargs: Mapping[str, Any] | None,
) -> Any:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template; use the completions API or supply a "
            "chat template"
        )
    template_kwargs = template_kwargs or {}
    taken = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
    if taken:
        raise ValueError(
            f"chat_template_kwargs may not set {', '.join(taken)}: the server sets "
            "these itself (add_generation_prompt is a field of the request)"
        )
    messages = normalize_messages(messages)
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            return_dict=False,
            **template_kwargs,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template rejected the messages: {e}") from e
    except (TypeError, AttributeError, KeyError) as e:
        # Template variables of the wrong type (e.g. chat_template_kwargs {"tools": true}) fail
        # inside transformers' template helpers or the template itself.
        raise ValueError(
            f"the chat template could not render these messages and chat_template_kwargs: "
            f"{type(e).__name__}: {e}"
        ) from e


def _as_id_list(result: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding unless return_dict=False; be tolerant of both.
    if isinstance(result, Mapping):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if result and isinstance(result[0], list):
        if len(result) != 1:
            raise ValueError(f"expected one conversation, got {len(result)}")
        result = result[0]
    return [int(t) for t in result]


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase | None, config: ModelConfig
) -> tuple[int, ...]:
    """Token ids that end generation: the config's eos ids, then the tokenizer's, no repeats."""
    ids = list(config.eos_token_ids)
    if (
        tokenizer is not None
        and tokenizer.eos_token_id is not None
        and tokenizer.eos_token_id not in ids
    ):
        ids.append(int(tokenizer.eos_token_id))
    return tuple(ids)
