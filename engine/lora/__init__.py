"""Multi-LoRA serving: adapters read from PEFT folders or GGUF files (`adapter.py`), kept in
host memory and in a fixed number of device slots (`slots.py`), and added to the base model's
projections for every token of a batch at once (`layers.py`, kernels/lora.py).

The road of an adapter, from the server to the layers:
- A `LoRARequest` (scheduler/lora_request.py: name, an id never reused, path) names it; the
  server keeps those it serves by name (server/lora/serving_lora.py: `--lora-modules`,
  `/v1/load_lora_adapter`), and a request whose `model` is an adapter's name carries its
  LoRARequest through the front end to the core. The front end reads the adapter once per id
  against the model (`InputProcessor.check_lora` -> `adapter.load_adapter`), so a bad one is a
  400 before anything is queued.
- The scheduler admits a waiting request only while its adapter is among the running requests'
  or fewer than `max_loras` adapters run (the requests behind it go on), and the prefix cache
  chains each adapter's blocks from a root of its own (scheduler/block_hash.py `root_digest`):
  adapters never share KV.
- `EngineCore.add_samples` has the worker's `LoRAManager` load the adapter into host memory (a
  failure fails that request alone); each step `ModelRunner.launch` gives `LoRAManager.set_step`
  the step's adapters, which fills the device slots, least recently used first, and tells every
  layer each token's slot (`LoRAStep`).
- Each targeted projection (qkv, o, gate_up, down) adds its delta after the base matmul
  (`LoRAProjection.add`). On CUDA the kernels read the slots on the device, so decode steps with
  adapters stay CUDA graphs. On CPU every step multiplies every token by every slot with the
  other slots masked out, so a token's delta is its own whatever shares the step; with
  `PAGEDSERVE_BATCH_VARIANT=1` only steps whose token count `layers.DENSE_TOKENS` names do, and
  the others group their tokens by slot.
- An adapter stays in its slot and in host memory after its requests end, until another needs
  the room; unloading a name only forgets the name.
- Tensor parallelism: every rank reads the whole adapter and keeps its slice
  (engine/models/parallel.py `TPShard.slice_lora`); every rank runs the same `set_step`, so slot
  choices need no message.

Refused: LoRA for a model that does not generate with a decoder (Whisper, embeddings), and
adapters the projections cannot express or the model does not fit (peft_adapter.py and
adapter.py say which).
"""
