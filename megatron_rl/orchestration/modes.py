"""Where a step's batch comes from, per ``rollout.mode``, behind one interface the driver calls:

    batch = rollouts.next_batch(step)      the step's training groups (+ their staleness metrics)
    rollouts.before_publish(step)          before the weight sync
    rollouts.after_publish(step, synced)   the engines now hold version ``step`` (the weights after it)
    rollouts.state_dict()                  what a checkpoint must keep to resume the same way

* :class:`SyncRollouts` (``sync``): the batch is generated when the step starts, on the last step's weights.
* :class:`OneStepRollouts` (``one_step``): step ``s + 1``'s rollout starts when step ``s`` has its batch and
  is waited for before step ``s``'s weight sync, so it runs on the previous weights while the trainer works
  (exactly one step stale). Also past a ``stop_after_steps`` stop: the checkpoint carries it, and the resumed
  run trains on exactly the samples the uninterrupted run would have.
* :class:`~megatron_rl.orchestration.async_rollout.AsyncRollouts` (``async``): a continuous prompt stream
  under the staleness bound.
"""

from __future__ import annotations

import concurrent.futures
import pickle
from typing import Callable, Optional

from megatron_rl.metrics import PhaseTimer
from megatron_rl.orchestration.rollout_phase import RolloutBatch
from megatron_rl.orchestration.staleness import staleness_metrics


class Rollouts:
    """The sync mode, and the interface of the others."""

    max_staleness = 0  # the staleness buckets this mode reports (rollout/staleness_frac_<j>)

    def __init__(self, collect: Callable[[int], RolloutBatch], timer: PhaseTimer):
        self.collect, self.timer = collect, timer

    def next_batch(self, step: int) -> RolloutBatch:
        batch = self._next(step)
        batch.metrics.update(staleness_metrics(batch.samples, step, self.max_staleness))
        return batch

    def _next(self, step: int) -> RolloutBatch:
        return self.collect(step)

    def before_publish(self, step: int) -> None:
        pass

    def after_publish(self, step: int, synced: bool) -> None:
        pass

    def state_dict(self) -> Optional[dict]:
        return None

    def close(self) -> None:
        pass


SyncRollouts = Rollouts


class OneStepRollouts(Rollouts):
    max_staleness = 1

    def __init__(self, collect: Callable[[int], RolloutBatch], timer: PhaseTimer, steps: int,
                 state: Optional[dict] = None):
        super().__init__(collect, timer)
        self.steps = steps
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="next-rollout")
        self._next_future: Optional[concurrent.futures.Future] = None
        self.pending: Optional[RolloutBatch] = load_pending(state)

    def _next(self, step: int) -> RolloutBatch:
        batch, self.pending = self.pending or self.collect(step), None
        if step + 1 <= self.steps:
            self._next_future = self._executor.submit(self.collect, step + 1)
        return batch

    def before_publish(self, step: int) -> None:
        if self._next_future is not None:
            with self.timer.phase("rollout_wait"):
                self.pending = self._next_future.result()
            self._next_future = None

    def state_dict(self) -> Optional[dict]:
        # Megatron loads the common state with torch.load(weights_only=True): plain types only, so the pending
        # rollout (our dataclasses) travels pickled, as bytes
        return None if self.pending is None else {"pending": pickle.dumps(self.pending)}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)  # an interrupted rollout is abandoned


def load_pending(state: Optional[dict]) -> Optional[RolloutBatch]:
    pending = (state or {}).get("pending")
    return None if pending is None else pickle.loads(pending)
