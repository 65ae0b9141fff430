"""The client side of an engine: everything that speaks SGLang's native HTTP API (real SGLang or our stand-in).

  protocol.py        typed records (SamplingParams, GenerateRequest, Sample) and the RolloutEngine ABC;
                     which distribution the log-probs are under; a request's per-sample seeds
  wire.py            SGLang's /generate JSON <-> typed records; tensor bucket serialisation; the shared
                     weight-file folder
  weight_versions.py the weight version(s) each generated token was sampled under
  errors.py          ServerError, RequestRejected (4xx), ServerUnavailableError
  http_client.py     SGLangClient: retries, backoff, restart policy
  client_weights.py  SGLangClient's weight endpoints: the update session, tensor / distributed updates
  balancer.py        RemoteEngine: a RolloutEngine over one or more servers (round-robin / least-outstanding)
  weight_group_host.py the distributed transport's weight group, hosted by RemoteEngine as rank 0
  ipc_transport.py   IpcTransport: colocated engines get each trainer rank's own copy, gathered per engine
  process.py         a managed server subprocess: launch, wait for /health, log tail, restart
  sglang.py          launch SGLang (GPU) from a typed config (pinned version)

Nothing here imports ``megatron_rl.rollout.embedded``; ``sglang`` itself is imported lazily in ``sglang.py`` only.
"""
