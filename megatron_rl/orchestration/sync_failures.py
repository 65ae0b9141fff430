"""What the driver does with a weight-sync transaction's failed engines (``SyncStats.transaction``): hand them to
the engine monitor, which takes each out of rotation at once, restarts it and re-admits it only after its own
verified sync (``engine_health.py``); without a monitor (no ``rollout.recovery``, or engines the run did not launch)
nobody could bring one back, and its weights may be partial, so the step fails with the transaction's causes."""

from __future__ import annotations

import logging
from typing import Dict, Optional

from megatron_rl.weights.transaction import TransactionError, failures_text

log = logging.getLogger("megatron_rl.orchestration.phases.publish")


def handle_failed_engines(stats, monitor: Optional[object]) -> Dict[str, float]:
    """The transaction's metrics; failed engines to ``monitor.fail_engine`` (or one error without a monitor)."""
    report = getattr(stats, "transaction", None)
    if report is None:
        return {}
    if report.failures:
        text = failures_text(report.failures)
        if monitor is None:
            raise TransactionError(f"weight sync v{report.version}: {text}; engines {report.committed} committed, but "
                                   "without engine recovery (rollout.recovery) a failed engine cannot be taken out and "
                                   "restarted, so the run stops rather than sampling from partial weights")
        for f in report.failures:
            log.warning("weight sync v%s: engine %d (%s) failed at %s (%s); out of rotation, restarting it; the run goes "
                        "on with engines %s", report.version, f.index, f.url, f.phase, f.cause, report.committed)
            monitor.fail_engine(f.index, f"its weight sync v{report.version} failed at {f.phase}: {f.cause}")
    return report.metrics()
