"""`suffix` on /v1/completions: fill-in-the-middle prompts for models trained with FIM tokens.

The prompt is laid out prefix-suffix-middle (PSM), the order StarCoder, SmolLM, Qwen2.5-Coder and
DeepSeek-Coder were trained on:

    <prefix token> prompt <suffix token> suffix <middle token>

and the model writes the middle. A tokenizer without all three tokens cannot do it: the request
is refused, naming `suffix` and the model.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.server.errors import APIError

# (prefix, suffix, middle) token strings, by model family.
FIM_TOKENS: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SmolLM, Granite code
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def fim_token_ids(tokenizer) -> tuple[int, int, int] | None:
    """The tokenizer's (prefix, suffix, middle) token ids, or None when it has no FIM tokens.
    (A token missing from the vocabulary converts to the unknown token's id, so each id is
    converted back to be sure it is the token itself.)"""
    for names in FIM_TOKENS:
        ids = [tokenizer.convert_tokens_to_ids(name) for name in names]
        if all(
            isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == name
            for i, name in zip(ids, names, strict=True)
        ):
            return ids[0], ids[1], ids[2]
    return None


def fim_prompts(
    tokenizer, model_name: str, prompts: Sequence[str | Sequence[int]], suffix: str
) -> list[list[int]]:
    """Each prompt (text, or token ids as they are) as the token ids of a PSM prompt."""
    ids = fim_token_ids(tokenizer)
    if ids is None:
        raise APIError(
            400,
            f"suffix needs a model trained for fill-in-the-middle, and the tokenizer of "
            f"`{model_name}` has no FIM tokens ({', '.join(names[0] for names in FIM_TOKENS)} "
            "...); drop suffix",
            param="suffix",
        )
    prefix_id, suffix_id, middle_id = ids
    suffix_ids = tokenizer.encode(suffix, add_special_tokens=False) if suffix else []
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        else:
            prompt_ids = list(prompt)
        out.append([prefix_id, *prompt_ids, suffix_id, *suffix_ids, middle_id])
    return out
