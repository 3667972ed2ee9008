"""`StepThreads`: a step runs with one intra-op thread fewer while a compile worker holds a
core, on the thread that runs the steps, and with all of them again once it is done."""

from __future__ import annotations

import threading

import torch

from executor.graphs.step_threads import StepThreads


def test_the_step_thread_gives_the_workers_core_back_and_takes_it_again() -> None:
    threads = StepThreads()
    threads.full = 4  # as if the process had four
    seen: list[int] = []

    def steps() -> None:  # a thread of its own: the test's thread keeps its count
        threads.apply()
        seen.append(torch.get_num_threads())
        threads.reserved = 1  # the capture thread: a worker started
        threads.apply()
        seen.append(torch.get_num_threads())
        threads.reserved = 0  # it finished
        threads.apply()
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    t = threading.Thread(target=steps)
    t.start()
    t.join()
    assert seen == [4, 3, 4]
    assert torch.get_num_threads() == before  # per thread: the caller's count is its own


def test_never_fewer_than_one_thread() -> None:
    threads = StepThreads()
    threads.full, threads.reserved = 1, 1
    assert threads.wanted == 1
