"""The LoRA adapters served by name, and vLLM's routes that load and unload them."""
