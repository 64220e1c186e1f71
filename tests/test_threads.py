"""The engine's CPU thread count (`choose_threads`): --num-threads when given, else torch's default less the cores
other processes keep busy at start, read from /proc/stat (here: fed jiffy counts)."""

from __future__ import annotations

import pytest

from engine.runtime import setup


def _feed(monkeypatch, cores: int, busy: set[int]) -> None:
    """/proc/stat as read twice: `cores` CPUs, those in `busy` 90% busy between the reads, the others 10%."""
    reads = iter([{f"cpu{i}": (1000, 5000) for i in range(cores)},
                  {f"cpu{i}": (1000 + (10 if i in busy else 90), 5100) for i in range(cores)}])
    monkeypatch.setattr(setup, "_cpu_times", lambda: next(reads))
    monkeypatch.setattr(setup.torch, "get_num_threads", lambda: cores)
    monkeypatch.setattr(setup.os, "sched_getaffinity", lambda pid: set(range(cores)))


@pytest.mark.parametrize(("cores", "busy", "want"), [(2, set(), 2), (2, {1}, 1), (2, {0, 1}, 1), (8, {0, 3, 5}, 5)])
def test_threads_leave_out_the_cores_busy_at_start(monkeypatch, cores, busy, want):
    _feed(monkeypatch, cores, busy)
    assert setup.choose_threads(0, sample_s=0) == want


def test_only_the_cpus_this_process_may_use_count(monkeypatch):
    """16 CPUs on the host, this process pinned to 0-1, a neighbour busy on cpu1 (and others elsewhere)."""
    _feed(monkeypatch, 16, {1, 5, 6, 7})
    monkeypatch.setattr(setup.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(setup.os, "sched_getaffinity", lambda pid: {0, 1})
    assert setup.choose_threads(0, sample_s=0) == 1


def test_requested_threads_win_and_one_thread_needs_no_look(monkeypatch):
    monkeypatch.setattr(setup, "_cpu_times", lambda: pytest.fail("/proc/stat read"))
    assert setup.choose_threads(3, sample_s=0) == 3
    monkeypatch.setattr(setup.torch, "get_num_threads", lambda: 1)
    assert setup.choose_threads(0, sample_s=0) == 1


def test_this_machine_s_cpu_times_parse():
    times = setup._cpu_times()
    assert times and all(name.startswith("cpu") and 0 <= idle <= total for name, (idle, total) in times.items())
