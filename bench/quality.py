"""`pagedserve bench quality`: how close a server's answers are to the model's own float32 values.

    pagedserve bench quality                                  # starts `pagedserve serve` itself
    pagedserve bench quality --server-args "--max-num-batched-tokens 16"   # 16-token steps
    PAGEDSERVE_BATCH_VARIANT=1 pagedserve bench quality       # the faster batch-variant routes
    pagedserve bench quality --base-url http://127.0.0.1:8000 # a server already running

English prose the model did not write (the Python reference's topics, which every Python install
ships as `pydoc_data.topics`) is cut into windows of `--window` tokens, `--positions` predicted
tokens in all; each window goes to the server's completions API as token ids with echo and
logprobs=1 (its prompt logprobs: at each position the server's top token and the logprob of the
text's own next token), all windows at once (`--concurrency`), so they share steps as a loaded
server's requests do. The reference is transformers on the same GGUF file, dequantized, in float32.

Reported: teacher-forced top-1 agreement (the share of positions where the server's top token is
the reference's, ties going to the lowest id as greedy decoding takes them), the mean |difference|
of the text's tokens' logprobs, and the ratio of the server's perplexity to the reference's.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import torch

TEXT_TOPICS = 40  # the first this many topics, sorted by name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="the GGUF model (a file, or an embedded model's name)")  # fmt: skip
    parser.add_argument("--base-url", default=None, help="a running server (else one is started)")
    parser.add_argument("--server-args", default="", help="flags of the server this starts")
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=8)


def prose_windows(tokenizer, positions: int, window: int) -> list[list[int]]:
    """Windows of `window` token ids (each predicting window - 1 positions) from the Python
    reference's topics, enough for `positions` predictions."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics)[:TEXT_TOPICS])
    ids = tokenizer.encode(text, add_special_tokens=False)
    count = -(-positions // (window - 1))
    if count * window > len(ids):
        raise ValueError(
            f"the text holds {len(ids)} tokens, fewer than {count} windows of {window}"
        )
    return [ids[i * window : (i + 1) * window] for i in range(count)]


def reference_logprobs(model, windows: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 log-softmax at each position of each window, [window - 1, vocab]."""
    with torch.no_grad():
        return [
            torch.log_softmax(model(torch.tensor([w])).logits[0, :-1].double(), -1) for w in windows
        ]


def server_logprobs(base_url: str, model: str, windows: list[list[int]], concurrency: int):
    """Per window: the server's (top token's text, text token's logprob) at positions 1..n-1."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=3600)

    def one(window: list[int]):
        reply = client.completions.create(
            model=model, prompt=window, max_tokens=1, temperature=0, echo=True, logprobs=1
        )
        lp = reply.choices[0].logprobs
        n = len(window)
        return [(next(iter(lp.top_logprobs[i])), lp.token_logprobs[i]) for i in range(1, n)]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, windows))


def compare(tokenizer, windows, reference, served) -> dict:
    same = total = 0
    deltas, ours, theirs = [], [], []
    for window, ref, got in zip(windows, reference, served, strict=True):
        # The reference's greedy pick: the lowest id of the largest logprob.
        top = ref.argmax(-1).tolist()
        for i, (top_text, logprob) in enumerate(got):
            expected = ref[i, window[i + 1]].item()
            same += top_text == tokenizer.decode([top[i]])
            total += 1
            deltas.append(abs(logprob - expected))
            ours.append(-logprob)
            theirs.append(-expected)
    return {
        "positions": total,
        "teacher_forced_top1_agreement": round(same / total, 5),
        "mean_abs_delta_logprob": round(statistics.mean(deltas), 5),
        "perplexity_ratio": round(math.exp(statistics.mean(ours) - statistics.mean(theirs)), 5),
    }


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.engine.models.model_source import gguf_files_for_everyone, resolve_model
    from pagedserve.server.launch import server_process

    source = resolve_model(args.model)
    if source.kind != "gguf":
        raise ValueError(f"bench quality compares against a GGUF file; {args.model!r} is not one")
    with gguf_files_for_everyone():
        tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            source.path, gguf_file=source.gguf_file.name, dtype=torch.float32
        ).eval()
    windows = prose_windows(tokenizer, args.positions, args.window)
    reference = reference_logprobs(model, windows)
    del model
    if args.base_url:
        started = nullcontext(args.base_url)
    else:
        log = Path(tempfile.mkdtemp(prefix="pagedserve-quality-")) / "server.log"
        serve_args = ["--model", args.model, *shlex.split(args.server_args)]
        started = server_process(serve_args, log)
    with started as base_url:
        from openai import OpenAI

        served_name = OpenAI(base_url=f"{base_url}/v1", api_key="unused").models.list().data[0].id
        served = server_logprobs(base_url, served_name, windows, args.concurrency)
    result = {"model": args.model, "server_args": args.server_args,
              **compare(tokenizer, windows, reference, served)}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result
