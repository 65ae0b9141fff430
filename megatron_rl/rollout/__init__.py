"""Rollout engines: generate samples with exact log-probs (and MoE routing) for the trainer.

Two sub-packages, one per side of SGLang's HTTP API:
  client/     what talks to an engine: the typed records and the RolloutEngine ABC, SGLang's wire format,
              the HTTP client, the balancer over servers, the server launcher, weight versions, the colocated
              IPC transport. Imports nothing from ``embedded/``.
  embedded/   our in-process engine and its SGLang-compatible stand-in server (CPU tests, small runs).

Trainer -> engine weight transport (the group, per-rank links, tensor payloads, the sync and its probe) is
``megatron_rl.weights``.
"""

from megatron_rl.rollout.client.protocol import (  # noqa: F401
    LOGPROB_MODES,
    EngineHealth,
    GenerateRequest,
    RolloutEngine,
    Sample,
    SamplingParams,
)
