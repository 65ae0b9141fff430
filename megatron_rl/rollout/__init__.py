"""Rollout engines: generate samples with exact log-probs (and MoE routing) for the trainer.

Tour:
  protocol.py      typed records (SamplingParams, GenerateRequest, Sample) and the RolloutEngine ABC;
                   which distribution the log-probs are under
  sampling.py      SGLang-semantics top-k/top-p/min-p sampling, raw/processed log-probs, per-sample RNG
  embedded.py      EmbeddedEngine: a transformers model sampled in-process (CPU tests, small runs)
  routing.py       forward hooks recording each MoE router's top-k expert ids
  hf_weights.py    copy HF-named tensors (incl. per-expert names into fused experts) into a live model
  wire.py          SGLang's /generate JSON <-> typed records; tensor bucket serialisation
  server.py        HTTP server with SGLang's native endpoints over an EmbeddedEngine
  http_client.py   client for SGLang / the embedded server: retries, backoff, restart policy
  balancer.py      RemoteEngine: a RolloutEngine over one or more servers (round-robin / least-outstanding)
  weight_group.py  the torch.distributed group that broadcasts weights trainer -> engines
  tensor_payload.py SGLang's /update_weights_from_tensor payloads: tensors by handle (CUDA IPC / shm files)
  ipc_transport.py IpcTransport: colocated engines get each trainer rank's own copy, gathered per engine
  weight_sync.py   WeightSync: Megatron shards -> engine in size-bounded HF-named buckets, then a probe
                   log-prob check (engine vs trainer) that catches garbled weights
  process.py       a managed server subprocess: launch, wait for /health, log tail, restart
  sglang.py        launch SGLang (GPU) from a typed config (pinned version)

Heavy optional imports (``sglang``) happen lazily inside ``sglang.py`` only.
"""

from megatron_rl.rollout.protocol import (  # noqa: F401
    LOGPROB_MODES, EngineHealth, GenerateRequest, RolloutEngine, Sample, SamplingParams,
)
