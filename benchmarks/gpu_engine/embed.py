"""embed (optional): issue 38's device paths. Embeddings of a BERT encoder (attention per
sequence with SDPA, CLS pooling, normalised) against transformers' BertModel, and their speed;
the sampler's token rules (logit_bias, allowed_token_ids, min_tokens) against the CPU engine."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_engine import harness
from benchmarks.gpu_engine.correctness import write_graphs_and_eager_checks

# A BERT shape of a few layers (the check), and BERT-base's (the speed part; random weights).
TINY_BERT: dict[str, Any] = {
    "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 256, "max_position_embeddings": 512,
}  # fmt: skip
BERT_BASE: dict[str, Any] = {
    "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "max_position_embeddings": 512,
}  # fmt: skip
# fp32 on the device against the CPU reference: TF32 is off in the engine's fp32, so the
# difference is summation order alone.
MAX_ABS_DIFF = 1e-4


def write_bert(folder: Path, shape: dict[str, Any]) -> str:
    """A BertModel folder with seeded random weights (safetensors) and a WordPiece tokenizer
    over made-up words, as transformers writes them."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**shape)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words += [f"w{i}" for i in range(shape["vocab_size"] - len(words))]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    transformers.BertTokenizerFast(str(folder / "vocab.txt")).save_pretrained(folder)
    return str(folder)


def _prompts(num: int, max_len: int, vocab_size: int) -> list[list[int]]:
    """[CLS] ... [SEP] prompts of lengths spread over [max_len / 4, max_len]."""
    lens = [max(3, max_len // 4 + (3 * max_len // 4) * i // max(1, num - 1)) for i in range(num)]
    return [
        [2, *harness.random_ids(1, n - 2, vocab_size, seed)[0], 3] for seed, n in enumerate(lens)
    ]


def _reference(folder: str, prompts: list[list[int]], device: str, dtype: Any):
    """transformers' BertModel: each prompt's CLS state, normalised (one prompt at a time: no
    padding in the reference)."""
    import torch
    import transformers

    model = transformers.BertModel.from_pretrained(folder, torch_dtype=dtype).to(device).eval()
    with torch.inference_mode():
        rows = [model(torch.tensor([p], device=device)).last_hidden_state[0, 0] for p in prompts]
    return torch.nn.functional.normalize(torch.stack(rows).float(), dim=-1).cpu()


def step_embed(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    import numpy as np
    import torch

    from pagedserve.engine import LLM, SamplingParams

    with rec.part(model="tiny_bert", check="fp32_embeddings"):
        folder = write_bert(args.scratch / "tiny-bert", TINY_BERT)
        prompts = _prompts(8 if args.smoke else 32, 48 if args.smoke else 400, 1024)
        llm = LLM(folder, device=sizes.device, dtype="float32")
        got = np.stack([o.embedding for o in llm.embed(prompts)])
        expected = _reference(folder, prompts, "cpu", torch.float32).numpy()
        diff = float(np.abs(got - expected).max())
        rec.write(
            {
                "model": "tiny_bert",
                "check": "fp32_embeddings",
                "prompts": len(prompts),
                "max_abs_diff": diff,
                "ok": diff <= MAX_ABS_DIFF,
                **harness.engine_info(llm),
            }
        )
        del llm
        harness.free_memory()

    with rec.part(model="tiny", check="token_rules_greedy"):
        # Rules that change the tokens: a ban, a strong bias, a narrowed vocabulary, EOS held back.
        tiny, llama_prompts = harness.tiny_llama_prompts(args.scratch, sizes)
        params = SamplingParams(
            temperature=0, max_tokens=sizes.correctness_tokens, min_tokens=4,
            logit_bias={11: 5.0, 12: -100.0}, allowed_token_ids=list(range(2, 3000)),
        )  # fmt: skip

        def tokens(device: str, eager: bool) -> list[list[int]]:
            llm = LLM(
                tiny, device=device, dtype="float32", load_format="dummy", enforce_eager=eager,
                max_num_seqs=len(llama_prompts),
            )  # fmt: skip
            out = [list(o.outputs[0].token_ids) for o in llm.generate(llama_prompts, params)]
            del llm
            harness.free_memory()
            return out

        write_graphs_and_eager_checks(rec, "token_rules_greedy", sizes.device, tokens)

    with rec.part(model="bert_base", part="throughput"):
        # Prompts of 32..512 tokens, embedded whole: pagedserve (its scheduler packs them)
        # against transformers' BertModel in padded batches of 64, both on the device.
        shape = TINY_BERT if args.smoke else BERT_BASE
        folder = write_bert(args.scratch / "bert", shape)
        prompts = _prompts(16 if args.smoke else 1024, 64 if args.smoke else 510, 1024)
        num_tokens = sum(map(len, prompts))
        llm = LLM(folder, device=sizes.device, dtype=sizes.dtype)
        llm.embed(prompts[:8])  # warm-up
        harness.sync(sizes.device)
        start = time.perf_counter()
        llm.embed(prompts)
        harness.sync(sizes.device)
        ours = time.perf_counter() - start
        info = harness.engine_info(llm)
        del llm
        harness.free_memory()
        theirs = _transformers_seconds(folder, prompts, sizes, batch=64)
        rec.write(
            {
                "model": "bert_base" if not args.smoke else "tiny_bert",
                "part": "throughput",
                "prompts": len(prompts),
                "prompt_tokens": num_tokens,
                "pagedserve_tok_s": num_tokens / ours,
                "transformers_tok_s": num_tokens / theirs,
                "ratio": theirs / ours,
                **info,
            }
        )


def _transformers_seconds(
    folder: str, prompts: list[list[int]], sizes: harness.Sizes, batch: int
) -> float:
    """Seconds transformers' BertModel takes over `prompts` in padded batches (longest first,
    so that a batch pads little), after one warm-up batch."""
    import torch
    import transformers

    dtype = getattr(torch, sizes.dtype)
    model = transformers.BertModel.from_pretrained(folder, torch_dtype=dtype)
    model = model.to(sizes.device).eval()
    ordered = sorted(prompts, key=len, reverse=True)
    batches = [ordered[i : i + batch] for i in range(0, len(ordered), batch)]

    def run(group: list[list[int]]) -> None:
        width = len(group[0])
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, p in enumerate(group):
            ids[row, : len(p)] = torch.tensor(p)
            mask[row, : len(p)] = 1
        with torch.inference_mode():
            model(ids.to(sizes.device), attention_mask=mask.to(sizes.device))

    run(batches[-1])
    harness.sync(sizes.device)
    start = time.perf_counter()
    for group in batches:
        run(group)
    harness.sync(sizes.device)
    seconds = time.perf_counter() - start
    model.to("cpu")  # the device's memory back before the next part
    harness.free_memory()
    return seconds
