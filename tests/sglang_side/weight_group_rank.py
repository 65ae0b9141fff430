"""One SGLang 0.5.23 engine rank of a weight-update group, run by SGLang's own code.

Run with the SGLang venv's python (imports sglang, never megatron_rl):

    .venv-sglang/bin/python tests/sglang_side/weight_group_rank.py \
        --master-address 127.0.0.1 --master-port P --rank-offset 1 --world-size 2 \
        --group-name G [--tp-rank 0] [--backend gloo] [--deadline-s 300]

What it runs, as an SGLang scheduler process does: a 1-process gloo default group (SGLang's
scheduler always has one; `init_weights_update_group` asserts it), then a real
`WeightUpdater` (model_executor/model_runner_components/weight_updater.py) with
`device="cpu"`: `init_weights_update_group(master_address, master_port, rank_offset, world_size,
group_name, backend)` joins through `sglang.srt.utils.common.init_custom_process_group` as
rank `rank_offset + tp_rank`; each stdin line is then the JSON body of one
`/update_weights_from_distributed` request (`{"names", "dtypes", "shapes", "load_format": null |
"flattened_bucket", "group_name": ...}`; `group_name` defaults to SGLang's "weight_update_group",
as on the server), parsed into `UpdateWeightsFromDistributedReqInput` by SGLang's FastAPI route and
received with the real `receive_weights_from_distributed` (gloo broadcast from rank 0). At EOF the
group is destroyed with the real `destroy_weights_update_group(group_name)`.

Output (stdout, JSON lines, flushed one by one):
    {"event": "joined", "rank": r, "success": bool, "message": str, "torch": version}
    per bucket: {"event": "bucket", "index": i, "success": bool, "message": str,
                 "tensors": {name: {"shape", "dtype", "sum", "sumsq"}}}   (float64 checksums)
    {"event": "destroyed", "success": bool, "message": str}
A stdin line may instead be `{"endpoint": path, "body": {...}}`: `/begin_weight_update`,
`/end_weight_update`, `/update_weights_from_distributed` (then inside SGLang's own
`SchedulerWeightUpdaterManager` session), `/flush_cache`, `/pause_generation`, `/continue_generation`
(SGLang's `Scheduler` code over a stub scheduler, `scheduler_stub.py`) and `/_hold` (a request starts
running), each answered by {"event": "answer", "endpoint", "status", "success", "message"} (a bucket by
its "bucket" event).
A failed join or bucket is reported (as SGLang's handler would answer it) and the script goes on,
as the server does; the trainer's broadcast toward a refused bucket then blocks until its timeout.
The whole run is bounded by --deadline-s: past it, {"event": "deadline"} and exit code 3.
"""

import argparse
import datetime
import json
import os
import sys
import threading

import _common


def _on_deadline():
    _common.dump({"event": "deadline"})
    os._exit(3)


def _bucket(updater, index, body):
    event = {"event": "bucket", "index": index, "tensors": {}}
    route = _common.route_call("/update_weights_from_distributed", body)
    if route.status != 200:
        return dict(event, success=False, message=json.dumps(route.response))
    req = route.obj
    try:  # the scheduler's update_weights_from_distributed: receive, then load
        weights = updater.receive_weights_from_distributed(
            names=req.names, dtypes=req.dtypes, shapes=req.shapes,
            group_name=req.group_name, load_format=req.load_format,
        )
    except Exception as e:  # noqa: BLE001 - SGLang answers "Failed to receive weights: {e}"
        return dict(event, success=False, message=f"Failed to receive weights: {e}")
    return dict(event, success=True, message="Succeeded to update parameter online.",
                tensors={name: _common.tensor_summary(t) for name, t in weights})


def _session_bucket(manager, runner, index, body):
    """SGLang's SchedulerWeightUpdaterManager.update_weights_from_distributed: the session check, the receive by
    the real WeightUpdater, the load (recorded), the post-update flush rule."""
    event = {"event": "bucket", "index": index, "tensors": {}}
    route = _common.route_call("/update_weights_from_distributed", body)
    if route.status != 200:
        return dict(event, success=False, message=json.dumps(route.response))
    loaded = len(runner.loaded)
    out = manager.update_weights_from_distributed(route.obj)
    event.update(success=out.success, message=out.message)
    if len(runner.loaded) > loaded:
        event["tensors"] = {name: _common.tensor_summary(t) for name, t in runner.loaded[-1]}
    return event


def _control(scheduler, manager, endpoint, body):
    """One control call answered by SGLang's own code (scheduler_stub.py), as its HTTP route answers it."""
    event = {"event": "answer", "endpoint": endpoint}
    if endpoint == "/_hold":  # the test's: a request in the running batch
        scheduler.hold()
        return dict(event, status=200, success=True, message="held")
    route = _common.route_call(endpoint, body)
    if route.status != 200:
        return dict(event, status=route.status, success=False, message=json.dumps(route.response))
    if endpoint in ("/begin_weight_update", "/end_weight_update"):
        out = getattr(manager, endpoint[1:])(route.obj)
        return dict(event, status=200 if out.success else 400, success=out.success, message=out.message)
    if endpoint == "/flush_cache":
        ok = scheduler.flush_cache()
        return dict(event, status=200 if ok else 400, success=ok,
                    message="Cache flushed." if ok else "Flush cache failed.\n")
    if endpoint == "/pause_generation":
        if route.obj.mode != "abort":  # "abort" is the tokenizer manager's: it aborts, the scheduler is not paused
            scheduler.pause_generation(route.obj)
        return dict(event, status=200, success=True, message="Generation paused successfully.")
    if endpoint == "/continue_generation":
        scheduler.continue_generation(route.obj)
        return dict(event, status=200, success=True, message="Generation continued successfully.")
    return dict(event, status=404, success=False, message=f"{endpoint}: not answered by this rank")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master-address", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--rank-offset", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--group-name", required=True)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--deadline-s", type=float, default=300.0)
    args = parser.parse_args(argv[1:])
    # a thread, not SIGALRM: a Python signal handler waits for a blocked gloo call to return
    deadline = threading.Timer(args.deadline_s, _on_deadline)
    deadline.daemon = True
    deadline.start()
    _common.quiet()

    import torch
    import torch.distributed as dist
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from scheduler_stub import scheduler_parts

    _common.sglang_app()  # import the HTTP layer now, not while rank 0 waits in a broadcast

    # The scheduler process's own default group (SGLang's tp group world), here of one process.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_common.free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    updater = WeightUpdater(
        tp_rank=args.tp_rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
        get_model=None, update_model_fields=None, recapture_cuda_graph=None, get_model_runner=None,
    )
    ok, message = updater.init_weights_update_group(
        args.master_address, args.master_port, args.rank_offset, args.world_size,
        args.group_name, backend=args.backend,
    )
    _common.dump({"event": "joined", "rank": args.rank_offset + args.tp_rank, "success": ok,
                  "message": message, "torch": torch.__version__})

    scheduler, manager, runner = scheduler_parts(updater)
    index = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        call = json.loads(line)
        if "endpoint" not in call:  # a bare /update_weights_from_distributed body: received outside any session
            _common.dump(_bucket(updater, index, call))
        elif call["endpoint"] == "/update_weights_from_distributed":
            _common.dump(_session_bucket(manager, runner, index, call["body"]))
        else:
            _common.dump(_control(scheduler, manager, call["endpoint"], call.get("body") or {}))
            continue
        index += 1

    ok, message = updater.destroy_weights_update_group(args.group_name)
    _common.dump({"event": "destroyed", "success": ok, "message": message})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
