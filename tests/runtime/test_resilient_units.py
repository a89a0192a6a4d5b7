"""Unit tests of the resilient trainer's pieces that need no processes: abortable waits, kill hooks."""

from __future__ import annotations

import threading

import pytest

from schedcomp.runtime.fault.inject import kill_at
from schedcomp.runtime.fault.membership import GenerationAborted, wait_abortable
from schedcomp.topology import Worker

pytestmark = pytest.mark.timeout(30)


class FakeWork:
    """A work item that completes when `release` is set (or fails with `error`), never reporting early."""

    def __init__(self, error: Exception | None = None) -> None:
        self.release, self.error, self.waited = threading.Event(), error, 0

    def is_completed(self) -> bool:
        return False  # like gloo's p2p work before wait()

    def wait(self) -> bool:
        self.waited += 1
        self.release.wait()
        if self.error is not None:
            raise self.error
        return True


def test_wait_returns_once_the_work_completes() -> None:
    work, signal = FakeWork(), threading.Event()
    threading.Timer(0.05, work.release.set).start()
    wait_abortable(work, signal)
    assert work.waited == 1


def test_wait_raises_generation_aborted_when_the_signal_trips() -> None:
    work, signal = FakeWork(), threading.Event()
    threading.Timer(0.05, signal.set).start()
    with pytest.raises(GenerationAborted):
        wait_abortable(work, signal)
    work.release.set()  # let the abandoned waiter thread end


def test_wait_raises_the_transfer_error() -> None:
    work, signal = FakeWork(RuntimeError("Connection closed by peer")), threading.Event()
    work.release.set()
    with pytest.raises(RuntimeError, match="closed by peer"):
        wait_abortable(work, signal)


def test_kill_hook_only_for_the_first_incarnation_of_a_victim() -> None:
    victims = {Worker(1, 2): (3, 4)}
    assert kill_at(victims, Worker(0, 2)) is None
    assert kill_at(victims, Worker(1, 2), incarnation=1) is None
    hook = kill_at(victims, Worker(1, 2))
    assert hook is not None
    hook(3, 3, None)  # before the point: nothing happens (the test process lives on)
    hook(2, 99, None)


def test_lossy_scale_is_the_mean_over_the_microbatches_a_stage_holds() -> None:
    import torch

    from schedcomp.runtime.lossy import lossy_scale

    assert lossy_scale(None) == 1.0
    assert lossy_scale(torch.ones(8, dtype=torch.float64)) == 1.0
    assert lossy_scale(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)) == 4 / 3
    assert lossy_scale(torch.zeros(4, dtype=torch.float64)) == 1.0  # nothing held: the step is skipped instead


def test_dropping_a_lost_microbatch_whose_b_ran_completes_its_w_and_counts_it() -> None:
    # Under split backward only nn.Linear defers its weight gradient to W; B already gave the
    # LayerNorm its gradient. A lost micro-batch caught between B and W must then count fully.
    import torch
    from torch import nn

    from schedcomp.compiler import compile
    from schedcomp.runtime.executor import Iteration
    from schedcomp.runtime.stage import Stage
    from schedcomp.topology import Worker

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    stage = Stage(0, 2, module, None, lambda params: None)
    it = Iteration(plan=compile(2, 1, 2, schedule="zb-h1"), worker=Worker(0, 0), stage=stage, comm=None,
                   inputs=None, targets=None, boundaries=((),),
                   ledger=torch.zeros(2, dtype=torch.float64))
    (out,) = stage.forward((0, 1), (torch.randn(3, 4),))
    stage.backward((0, 1), (torch.ones_like(out),), split=True)
    assert module[0].weight.grad is None and module[1].weight.grad is not None
    it.drop({(0, 1)})
    assert module[0].weight.grad is not None  # W ran
    assert it.ledger.tolist() == [0.0, 1.0]
    assert not stage.store.pending() and stage.in_flight() == 0
