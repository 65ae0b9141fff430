"""SGLang 0.5.23's own scheduler-side session and cache logic, on CPU, for `weight_group_rank.py`.

`scheduler_parts(updater)` builds:
* a stub scheduler whose `is_fully_idle`, `flush_cache`, `pause_generation`, `continue_generation`,
  `_pp_microbatches_drained` and `record_weight_version_change` are `Scheduler`'s own functions
  (managers/scheduler.py), over plain queues and no-op memory pools: `/flush_cache` answers what
  `Scheduler.flush_cache` decides from `is_fully_idle(ignore_waiting=_engine_paused)`, after SGLang's own
  in_place / retract pause moved (or left) the running requests; `hold()` puts one request in the running
  batch (a generation in flight), so an in-place pause's refusal can be seen. Only the KV pool's side of a
  retract (`retract_all`) is a no-op;
* SGLang's `SchedulerWeightUpdaterManager` (managers/scheduler_components/weight_updater.py) over that
  scheduler and a one-runner TP worker whose runner is the real `WeightUpdater` given: the session rules
  of `/begin_weight_update`, `/end_weight_update` and `/update_weights_from_distributed` are SGLang's.
  The parallel state is a one-rank TP group (the scheduler's default gloo group).

Imports sglang (run with the SGLang venv's python).
"""

from types import SimpleNamespace


class _Batch:
    def __init__(self):
        self.reqs, self.batch_is_full = [], False

    def is_empty(self):
        return not self.reqs


class _Noop:
    def __getattr__(self, name):
        return lambda *a, **k: None


def scheduler_parts(updater):
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers import scheduler as scheduler_module
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components import weight_updater as manager_module
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    parallel = SimpleNamespace(pp_size=1, tp_group=SimpleNamespace(cpu_group=None))
    # one TP rank: get_parallel() is process state SGLang's launcher sets; the default gloo group is the TP group
    manager_module.get_parallel = scheduler_module.get_parallel = lambda: parallel
    scheduler_module.retract_all = lambda reqs, **kw: None  # frees KV pool slots: there are none here

    class StubScheduler:
        is_fully_idle = Scheduler.is_fully_idle
        flush_cache = Scheduler.flush_cache
        _pp_microbatches_drained = Scheduler._pp_microbatches_drained
        record_weight_version_change = Scheduler.record_weight_version_change

        def __init__(self):
            self.running_batch, self.waiting_queue, self.chunked_req, self.last_batch = _Batch(), [], None, None
            self.enable_overlap, self.result_queue, self._engine_paused = False, [], False
            self.dllm_manager = SimpleNamespace(any_staging_reqs=lambda: False)
            self.tree_cache = self.req_to_token_pool = self.token_to_kv_pool_allocator = _Noop()
            self.grammar_manager = SimpleNamespace(grammar_queue=[], clear=lambda: None)
            self.disaggregation_mode = DisaggregationMode.NULL
            self.enable_hisparse = self.enable_hierarchical_cache = self.enable_lmcache = False
            self.metrics_reporter = SimpleNamespace(reset_metrics=lambda: None, is_stats_logging_rank=False)
            self.draft_worker, self.cur_batch_for_debug, self.hisparse_coordinator = None, None, None
            self.enable_overlap_mlx, self._pause_started_at, self._pause_intervals = False, None, []
            self.decode_offload_manager, self.kv_events_publisher = None, _Noop()
            self.metrics_reporter.current_scheduler_metrics_enabled = False

        pause_generation = Scheduler.pause_generation
        continue_generation = Scheduler.continue_generation

        def hold(self):
            self.running_batch.reqs.append(SimpleNamespace(finished=lambda: False,
                                                           kv=SimpleNamespace(holds_kv=False)))

        def _add_request_to_queue(self, req, is_retracted=False):
            self.waiting_queue.append(req)

    class Runner:
        def __init__(self):
            self.weight_updater, self.loaded = self, []

        def begin_weight_update(self):
            pass

        def end_weight_update(self, run_post_load=True):
            pass

        def load_weights_from_distributed(self, weights):
            self.loaded.append(weights)
            return True, "Succeeded to update parameter online."

    runner = Runner()
    tp_worker = SimpleNamespace(weight_update_runners=lambda: [("target", runner)],
                                model_runner=SimpleNamespace(weight_updater=updater))
    scheduler = StubScheduler()
    manager = SchedulerWeightUpdaterManager(
        tp_worker=tp_worker, draft_worker=None, memory_saver_adapter=None, flush_cache=scheduler.flush_cache,
        is_fully_idle=scheduler.is_fully_idle, scheduler=scheduler)
    return scheduler, manager, runner
