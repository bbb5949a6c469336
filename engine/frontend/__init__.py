"""What runs in the caller's process (the API server, or a Python program using `LLM`): the
clients of the engine core (in-process, in its own process, data-parallel), the inputs (prompts,
tokenizer, chat templates), and the outputs (detokenizing, stop strings, `RequestOutput`)."""
