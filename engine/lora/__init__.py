"""Multi-LoRA serving: adapters read from PEFT folders or GGUF files (`adapter.py`), kept in
host memory and in a fixed number of device slots (`slots.py`), and added to the base model's
projections for every token of a batch at once (`layers.py`, kernels/lora.py)."""
