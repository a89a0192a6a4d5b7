"""One strategy through one run: failures and repairs in time order, throughput constant between them.

The job trains at `relative(failed) / iteration_s` iterations per second between events. A policy
says what a failure costs:

- "rollback" (adaptive, drop-pipeline, oobleck, bamboo): the iteration in flight is discarded (the
  job goes back to its last iteration boundary) and training stops for `pause_s` (detection,
  agreement, plan switch), then goes on with the failed set's plan;
- "lossy" (lossy forward): the iteration in flight is finished without the micro-batches of the
  pipelines that lost a worker (their share of the iteration's samples is lost, not its time),
  after the same pause;
- "restart" (checkpoint-restart): back to the last checkpoint, `restart_s` to restart on spares
  (with `spares=False` the job waits until every failed worker is repaired, then restarts);
- "replay" (logging-based recovery, SWIFT): as rollback, but a stage that lost every replica is
  rebuilt on spares: the job stops for the pause, `restart_s` (the replacements start) and
  `replay_s` per iteration trained since the last checkpoint, then runs fault-free; only two
  adjacent lost stages go back to the checkpoint. Logging slows every iteration by `slowdown`.

A rollback or lossy strategy that cannot go on (`relative` is 0: e.g. a stage lost every replica)
goes back to its last checkpoint, waits for repairs until it can run, and restarts (`restart_s`).
A repaired worker rejoins: the plan switches back after `rejoin_s`.

Checkpoints: after every `interval` seconds of training the job is blocked `checkpoint_s` while the
state is saved; the checkpoint counts once that time has passed (a failure meanwhile loses it).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from schedcomp.goodput.failures import Failure
from schedcomp.topology import Worker

RECOVERIES = ("rollback", "lossy", "restart", "replay")
_EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    """How a strategy meets failures (see the module docstring)."""

    recovery: str
    interval: float  # seconds of training between checkpoints; inf: no checkpoints
    checkpoint_s: float
    restart_s: float
    pause_s: float = 0.0
    rejoin_s: float = 0.0
    spares: bool = True
    replay_s: float = 0.0  # "replay": seconds to replay one iteration of a lost stage
    slowdown: float = 1.0  # "replay": iteration time with logging over without


@dataclass(frozen=True)
class Outcome:
    """What one run delivered: useful iterations, how often it restarted, and its progress over time."""

    useful: float
    stops: int
    series: tuple[tuple[float, float], ...]
    replays: int = 0  # "replay": lost stages rebuilt by replay (no stop)


@dataclass(frozen=True)
class _Event:
    time: float
    order: int  # repairs (0) before failures (1) at the same instant, then samples (2)
    workers: tuple[Worker, ...]
    down: float = 0.0


def run(failures: Sequence[Failure], relative: Callable[[frozenset[Worker]], float], policy: Policy, *,
        duration_s: float, iteration_s: float, dp: int, samples: int = 0) -> Outcome:
    """Simulate `duration_s` seconds; `samples` > 0 also records progress at that many even times."""
    events = [_Event(f.time, 1, f.workers, f.down) for f in failures if f.time < duration_s]
    events += [_Event(f.time + f.down, 0, f.workers) for f in failures if f.time + f.down < duration_s]
    events += [_Event(duration_s * (i + 1) / samples, 2, ()) for i in range(samples - 1)]
    events.sort(key=lambda e: (e.time, e.order))
    job = _Job(policy, relative, iteration_s, dp)
    series = [(0.0, 0.0)]
    for e in events:
        job.advance(e.time)
        if e.order == 1:
            job.fail(e.workers)
        elif e.order == 0:
            job.repair(e.workers)
        if samples:
            series.append((e.time, job.useful))
    job.advance(duration_s)
    series.append((duration_s, job.useful))
    return Outcome(job.useful, job.stops, tuple(series) if samples else (), job.replays)


class _Job:
    """The mutable state of one simulated run (private to `run`)."""

    def __init__(self, policy: Policy, relative: Callable[[frozenset[Worker]], float], iteration_s: float,
                 dp: int) -> None:
        self.policy, self.relative, self.iteration_s, self.dp = policy, relative, iteration_s, dp
        self.tracks_failures = not (policy.recovery == "restart" and policy.spares)
        self.t = 0.0
        self.progress = 0.0  # iterations completed (the last one possibly in part)
        self.dropped = 0.0  # iterations' worth of samples lossy recovery gave up
        self.saved = (0.0, 0.0)  # (progress, dropped) in the newest complete checkpoint
        self.pending = (0.0, 0.0)  # ... in the checkpoint being written
        self.since_checkpoint = 0.0  # seconds trained since the last checkpoint began
        self.writing = 0.0  # seconds left of the checkpoint being written
        self.busy_until = 0.0
        self.failed: Counter[Worker] = Counter()
        self.stopped = False
        self.stops = 0
        self.replays = 0
        self.current = self._rate()  # iterations per second now (kept: the failed set changes rarely)

    @property
    def useful(self) -> float:
        return self.progress - self.dropped

    def _rate(self) -> float:
        down = frozenset(self.failed)
        if self.policy.recovery == "restart":
            return 0.0 if down and not self.policy.spares else 1.0 / self.iteration_s
        return self.relative(down) / (self.iteration_s * self.policy.slowdown)

    def advance(self, to: float) -> None:
        p = self.policy
        while self.t < to - _EPS:
            if self.stopped:
                self.t = to
            elif self.t < self.busy_until:
                self.t = min(self.busy_until, to)
            elif self.writing > 0:
                dt = min(self.writing, to - self.t)
                self.t += dt
                self.writing -= dt
                if self.writing <= _EPS:
                    self.writing, self.saved = 0.0, self.pending
            else:
                self._train(to, self.current, p.interval, p.checkpoint_s)
        self.t = max(self.t, to)

    def _train(self, to: float, rate: float, interval: float, cost: float) -> None:
        need = interval - self.since_checkpoint
        if to - self.t < need:
            self.progress += rate * (to - self.t)
            self.since_checkpoint += to - self.t
            self.t = to
            return
        self.progress += rate * need
        self.t += need
        # Whole checkpoint-and-train cycles before `to` in one step (a month at a short interval).
        cycles = math.floor((to - self.t) / (cost + interval)) if cost + interval > 0 else 0
        if cycles > 0:
            self.saved = (self.progress + rate * interval * (cycles - 1), self.dropped)
            self.progress += rate * interval * cycles
            self.t += cycles * (cost + interval)
        self.since_checkpoint, self.pending = 0.0, (self.progress, self.dropped)
        if cost > 0:
            self.writing = cost
        else:
            self.saved = self.pending

    def fail(self, workers: tuple[Worker, ...]) -> None:
        p = self.policy
        running = not self.stopped and self.t >= self.busy_until and self.writing == 0
        if self.tracks_failures:
            self.failed.update(workers)
            self.current = self._rate()
        if self.stopped:
            return  # already back at its checkpoint, waiting for repairs
        if p.recovery == "replay" and self.current == 0 and self._replay():
            return
        if p.recovery == "restart" or self.current == 0:
            self._back_to_checkpoint()
            if p.recovery == "restart" and p.spares:
                self.busy_until = self.t + p.restart_s
            else:
                self.stopped = True
            return
        if p.recovery == "lossy":
            if running:  # the samples of the pipelines hit are lost from the iteration in flight
                self.dropped += len({w.pipeline for w in workers}) / self.dp
        else:
            self.progress = math.floor(self.progress + _EPS)  # the iteration in flight is re-run
        self.writing, self.since_checkpoint = 0.0, 0.0  # a checkpoint being written is abandoned
        self.busy_until = max(self.busy_until, self.t) + p.pause_s

    def _replay(self) -> bool:
        """Rebuild the stages that lost every replica on spares by replay; False when two lost stages are adjacent."""
        per_stage = Counter(w.stage for w in self.failed)
        lost = {s for s, n in per_stage.items() if n >= self.dp}
        if any(s + 1 in lost for s in lost):
            return False
        redo = max(0.0, self.progress - self.saved[0])  # iterations since the checkpoint, replayed by the stage
        self.replays += 1
        for w in [w for w in self.failed if w.stage in lost]:
            del self.failed[w]  # replaced: their repair later changes nothing
        self.current = self._rate()
        self.progress = math.floor(self.progress + _EPS)  # the iteration in flight is re-run
        self.writing, self.since_checkpoint = 0.0, 0.0
        p = self.policy
        self.busy_until = max(self.busy_until, self.t) + p.pause_s + p.restart_s + p.replay_s * redo
        return True  # every stage has a live worker again

    def repair(self, workers: tuple[Worker, ...]) -> None:
        if not self.tracks_failures:
            return
        before = self.current
        self.failed.subtract(workers)
        self.failed = +self.failed  # drop workers no longer down
        after = self.current = self._rate()
        if self.stopped:
            if after > 0:
                self.stopped = False
                self.busy_until = self.t + self.policy.restart_s
        elif after != before:
            self.busy_until = max(self.busy_until, self.t) + self.policy.rejoin_s

    def _back_to_checkpoint(self) -> None:
        self.progress, self.dropped = self.saved
        self.writing, self.since_checkpoint = 0.0, 0.0
        self.stops += 1
