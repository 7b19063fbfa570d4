"""What `onecard status` says of a model service's batching: the policy, the calls it chose,
the time it waited, the learned cost curve and the memory held, from the service's /stats;
anything malformed there is dropped, never shown or trusted."""

from __future__ import annotations

from supervisor.cli.status import _batching_line
from supervisor.driver.service_watch import batching_summary


def test_the_summary_keeps_figures_only_and_the_line_reads_them():
    stats = {"policy": "auto", "batches": 40, "mean_batch_size": 3.5, "waited_s": 0.42, "last_decision": "x" * 999,
             "cost": {"time": {"fixed_ms": 643.1, "per_extra_item_ms": 64.4, "ms_by_batch_size": {"1": 643.1}},
                      "held_bytes": 12 * 2**20, "refused_for_memory": 2,
                      "budgets": {"held_bytes": 512 * 2**20, "batch_bytes": 2**30}}}
    summary = batching_summary(stats)
    assert summary == {"policy": "auto", "batches": 40, "mean_batch_size": 3.5, "waited_s": 0.42,
                       "fixed_ms": 643.1, "per_extra_item_ms": 64.4, "held_bytes": 12 * 2**20,
                       "held_budget_bytes": 512 * 2**20, "call_budget_bytes": 2**30, "refused_for_memory": 2}
    assert _batching_line(summary) == ("auto, 40 calls of 3.50 items, waited 0.42 s, curve 643.1 ms + 64.4 ms an "
                                       "item, held 12M of 512M, 2 refused for memory")


def test_malformed_batching_figures_are_dropped():
    assert batching_summary(None) is None and batching_summary([1, 2]) is None
    summary = batching_summary({"policy": "x" * 100, "batches": True, "waited_s": "1", "cost": {"time": [1]}})
    assert summary["policy"] is None and summary["batches"] is None and summary["waited_s"] is None
    assert summary["fixed_ms"] is None and _batching_line(summary) == "-, waited - s"
