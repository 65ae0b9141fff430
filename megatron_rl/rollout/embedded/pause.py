"""SGLang 0.5.23's ``/pause_generation`` modes in the embedded engine (``managers/scheduler.py:5817-5920``).

* ``in_place``: the running batch is held between two decode steps with its KV cache; after
  ``/continue_generation`` it decodes on over the KV the old weights computed.
* ``retract`` (used by partial rollouts): SGLang drains the step in flight, frees the held requests' KV and moves
  them to the waiting queue, keeping their output tokens and log-probs; after ``/continue_generation`` they are
  prefilled again -- prompt and output so far -- under the weights loaded meanwhile (``schedule_batch.py:
  2049-2100``). The engine does the same: at its pause point every row's last sampled token is not yet fed, so
  :func:`reprefill` rebuilds the cache of ``prompt + tokens[:-1]`` with the current weights and the next decode
  step feeds the last token through them too. A row's spans then say exactly which weights computed each token:
  no KV of the old weights is left under a token labelled with the new version.

A retracted request does not count as running for SGLang's idleness check (it waits, and a paused scheduler
ignores its waiting queue), so ``/flush_cache`` and ``/release_memory_occupation`` succeed under ``retract`` and
are refused under ``in_place`` while requests are held (``scheduler_rules.fully_idle``).
"""

from __future__ import annotations

import torch

PAUSE_MODES = ("abort", "retract", "in_place")


def reprefill(engine, batch) -> None:
    """Rebuild ``batch``'s KV cache under ``engine``'s current weights from each row's prompt and the output tokens
    already fed (all but the last sampled one, which the next decode step feeds). One forward for the batch."""
    seqs = [list(r.req.prompt_ids) + r.tokens[:-1] for r in batch.rows]
    width = max(len(s) for s in seqs)
    device = engine.device
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs], device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    engine.routing.enabled = False  # the held tokens' routes were recorded when they were generated
    _, cache = engine._forward(ids, mask, pos, None)
    batch.mask, batch.pos, batch.cache = mask, pos[:, -1:], cache
