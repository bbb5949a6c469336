"""The models: configurations (Hugging Face, GGUF, built-in shapes), where a model's files are,
the layers and decoders, rotary embeddings, weight loading and quantized linear layers.

One decoder (`model.py` `CausalLM`) serves every decoder family of `model_config.py`
`ARCHITECTURE_CLASSES` (Llama, Qwen2, Mistral, Qwen3, Gemma 2 and 3, Phi-3, Mixtral, Qwen3-MoE);
what sets a family's computation apart is a `ModelConfig` field or property (layer kinds and
windows, norms of 1 + weight, soft-capping, q/k norms, experts), never a check of the family's
name in the model; only checkpoint naming goes by the name. Whisper (`whisper.py`) and BERT
(`bert.py`) are models of their own, with their configurations beside them. The layer math calls
the kernels through the backend module it is given (`ops`). Configs, model sources and
tokenizers are read in the API server's process too, which loads none of the model code
(tests/test_architecture.py).

Adding a decoder family:
1. its config: `ARCHITECTURE_CLASSES`, what sets it apart as `ModelConfig` fields, its checkpoint
   tensors in `ModelConfig.weight_shapes`, its readers in `hf_config.py` and `gguf_config.py`
   (llama.cpp's name in `GGUF_ARCHITECTURES`; `weights.py` `gguf_to_hf_name` where GGUF's tensor
   names differ);
2. its modules in `model.py`, and the checkpoint names they load in `CausalLM._weight_targets`;
3. a parity test against transformers' own class built from a tiny config (tests/families.py,
   tests/engine/test_model_families.py), and from its GGUF file as llama.cpp's converter writes
   it (tests/gguf_writer.py, tests/engine/test_gguf_families.py; `python -m tests.llama_cpp_gguf`
   compares the writer with the converter itself).
"""
