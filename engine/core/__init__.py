"""The engine core: the step loop that schedules, runs the worker and applies its output; beam
search; what crosses between the core and its clients.

A step (`EngineCore.step_samples`): `Scheduler.schedule` -> `Worker.launch` (the model runner
starts the step and returns a `StepHandle`) -> `StepHandle.result` (the sampled ids on the host)
-> `Scheduler.update_from_output`. The core knows samples and token ids; text, stop strings and
requests of n samples are the front end's (engine/frontend/).

Asynchronous scheduling (`--async-scheduling`, on by default with CUDA, off with n-gram drafts
and for embeddings: engine/worker/worker.py): a call schedules and launches step N+1 before it
reads step N's ids, so the device runs N+1 while the host applies N. Step N+1's inputs include
the tokens N is sampling: placeholders (`Request.num_output_placeholders`), filled in on the
device from N's sampled ids (engine/worker/input_batch.py). A request that N ends by EOS or a
stop token still has a row in N+1, whose token is dropped; a request preempted with a token in
flight is readmitted once it is back; a step whose penalties read a row's history waits for the
previous step's ids. Outputs are the synchronous loop's (tests/engine/test_async_scheduling.py).

Structured outputs: `add_samples` starts compiling a request's grammar (engine/structured_output.py,
on a worker thread) and queues its samples as `WAITING_FOR_GRAMMAR`, which the scheduler passes
by; `_start_grammars` gives each a matcher once it compiled (a failed compile fails them), and
waits for a compilation when nothing else can run. Each step the runner asks the matchers for
their rows' allowed tokens, which the sampler masks after penalties, and `_follow_grammars`
advances them by the accepted tokens: a complete grammar ends its sample ("stop"). A mask needs
the sample's previous token, so while a constrained sample is live the core steps synchronously.

Faults stay with the request that caused one, where the core can tell which it is:
- logits with a NaN or an infinity: the sampler marks the row, and the core fails that request
  (finish "error"), takes the blocks it held alone out of the prefix cache and zeroes them
  (`Scheduler.fail_request`, `Worker.clear_blocks`): attention masks a block's stale tail, but
  0 x NaN is still NaN;
- a step that runs out of memory: the request with the most tokens in it fails and the others
  are preempted to recompute (`_fail_step`, `Scheduler.undo_step`, which also empties the prefix
  cache); with tensor parallelism it is fatal (`Worker.recoverable`);
- an exception while turning a sample's output into text: the front end fails that request
  (engine/frontend/output_processor.py).
Anything else that escapes the loop, or a core process that exits, fails every open request; the
server then answers 503 on /health and exits with status 1 (server/api_server.py).
"""
