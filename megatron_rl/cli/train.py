"""``megatron-rl train RECIPE [key=value ...] [--dry-run]``.

Reads the recipe, applies the overrides, prepares generated assets, checks the whole config (every
problem reported at once, one line each) and — unless ``--dry-run``, which prints the resolved config
instead — runs it. An output folder holding another run's outputs is refused unless ``resume=true``
continues it or ``--force`` (``overwrite=true``) starts over; one run per folder (a lock file). Exit codes:
0 done, 2 config error, 1 the run failed (a known failure is one message, no traceback), 128 + N stopped by
signal N (SIGTERM: 143, Ctrl-C: 130; resume=true continues).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from tqdm.auto import tqdm

from megatron_rl.config_io import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="the run's YAML recipe, e.g. examples/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides of any field, e.g. rollout.n_samples_per_prompt=8 resume=true")
    p.add_argument("--dry-run", action="store_true", help="check the config and print it resolved; run nothing")
    p.add_argument("--force", action="store_true",
                   help="start over in an output folder holding another run's outputs (overwrite=true: deletes them)")
    p.add_argument("--log-level", default="INFO", help="Python logging level of the driver (default INFO)")



class _TqdmHandler(logging.Handler):
    """Log lines go through tqdm.write, so they print above the progress bars instead of through them."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def _setup_logging(level: str) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO), handlers=[handler], force=True)


def run(args: argparse.Namespace) -> int:
    # the config (torch), the driver (Ray, Megatron) load only when it runs: --help and argument errors stay instant
    from megatron_rl.config import dump_yaml
    from megatron_rl.preflight import load_run_config

    _setup_logging(args.log_level)
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        cfg = load_run_config(args.recipe, [*args.overrides, *(["overwrite=true"] if getattr(args, "force", False) else [])])
    except (ConfigError, ValueError) as e:
        print(f"megatron-rl train: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_yaml(cfg), end="")
        return 0
    from megatron_rl.orchestration.driver import train
    from megatron_rl.orchestration.failures import user_errors
    from megatron_rl.orchestration.signals import Interrupted

    try:
        history = train(cfg)
    except ConfigError as e:  # found only once the run read its inputs
        print(f"megatron-rl train: config error: {e}", file=sys.stderr)
        return 2
    except user_errors() as e:  # a dead rank or server, a full disk, diverged weights: the message says it all
        first, *rest = str(e).splitlines() or [type(e).__name__]
        print("\n".join([f"megatron-rl train: failed: {first}; {_resume_hint(cfg, e)}", *rest]), file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"megatron-rl train: stopped by {signal.Signals(signum).name}; {_resume_hint(cfg, e)}", file=sys.stderr)
        return 128 + int(signum)
    final = [m for m in history if "rollout/reward_mean" in m]
    if final:
        print(f"done: {len(final)} steps, last reward {final[-1]['rollout/reward_mean']:.3f}; outputs in "
              f"{cfg.output_dir}")
    return 0


def _resume_hint(cfg, stop: BaseException) -> str:
    from megatron_rl.training.checkpoint import latest_checkpoint

    step = getattr(stop, "checkpoint_step", None)
    if step is not None:
        return f"checkpointed step {step} first; resume=true continues from it"
    try:
        latest = latest_checkpoint(cfg.checkpoint_root)
    except ValueError:
        latest = None
    if latest is None:
        return f"no checkpoint in {cfg.checkpoint_root} yet: a new run starts over"
    return f"resume=true continues from the latest checkpoint, {latest}"
