"""The models: configurations (Hugging Face, GGUF, built-in shapes), where a model's files are,
the layers and decoders, rotary embeddings, weight loading and quantized linear layers."""
