"""Our own engine: a transformers model sampled in-process, and an SGLang-compatible HTTP server over it.

  engine.py           EmbeddedEngine: generation with exact log-probs, weight updates, probes
  decode_loop.py      the engine's continuous-batching loop: the engine lock, prefill, decode steps, pause
  decode_batch.py     one decode step over a continuous batch of rows (KV cache per row)
  generation_queue.py the server's queue: requests join the running batch as they arrive
  sampling.py         SGLang-semantics top-k/top-p/min-p sampling, raw/processed log-probs, per-sample RNG
  routing.py          forward hooks recording each MoE router's top-k expert ids
  hf_weights.py       copy HF-named tensors (incl. per-expert names into fused experts) into a live model
  server.py           EmbeddedServer: SGLang's native endpoints over an EmbeddedEngine (``python -m``)
  weight_endpoints.py the server's weight endpoints (update session, tensor / distributed updates, group)
  http_handler.py     the server's HTTP layer: SGLang's error answers, body validation, the request handler
"""
