"""The rollback policy's decision, a pure function: which half-applied steps to undo, which iteration to re-run.

`recovery.RollbackPolicy` (the default recovery policy, and the fallback of every other) acts on it.

With the staggered optimizer each stage steps as soon as its own gradients are reduced, so when
a worker dies during iteration i some stages may have stepped i and others not. Every survivor
records the last iteration it stepped (`CommitLog` in `agreement`, written right after STEP and
before the worker touches the network again, so it is final once the survivors are agreeing).
`rollback_decision` then picks the iteration every stage can re-run: the lowest committed one
plus one. Survivors that stepped beyond it undo that step by restoring the snapshot they took
just before it (`transfer.StepSnapshot`), and every stage re-runs the iteration on the new plan.

Why undo rather than keep the half-applied steps (roll forward): the stages that have not
stepped still need iteration i's gradients, and those depend on the *pre-step* parameters of the
stages that have; recomputing them needs those parameters back whatever we do. Restoring a
snapshot is bit-exact and works for any optimizer (SWIFT's algebraic inverse of the update is
neither: it rounds, and needs an invertible update rule), so the model trained is exactly the
fault-free one. Why not a commit vote before every step (TorchFT): it is a barrier across all
stages on every iteration, which is the very stall the staggered optimizer removes; a snapshot
costs one device-local copy of the stage's parameters and optimizer state per iteration and no
waiting. Only one snapshot is ever needed: no stage can step twice while another has not
stepped once (its next backward needs that stage's next forward, which comes after its step).

Edge cases (tested): failure before any stage stepped i -> nothing to undo, re-run i; after some
stepped -> they undo, re-run i; after every stage stepped i -> nothing to undo, go on with i+1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from schedcomp.errors import RecoveryError
from schedcomp.topology import Worker


@dataclass(frozen=True)
class Rollback:
    """Re-run iteration `rerun` on every stage; the workers in `undo` first restore their pre-step snapshot."""

    rerun: int
    undo: frozenset[Worker]

    @property
    def stages_undone(self) -> frozenset[int]:
        return frozenset(w.stage for w in self.undo)


def rollback_decision(commits: Mapping[Worker, int]) -> Rollback:
    """Decide from the survivors' commit records (last iteration each stepped; -1 for none)."""
    if not commits:
        raise RecoveryError("no survivor reported a commit record: restart from the latest checkpoint")
    low, high = min(commits.values()), max(commits.values())
    if high - low > 1:
        ahead = sorted(str(w) for w, c in commits.items() if c == high)
        raise RecoveryError(f"workers {', '.join(ahead)} stepped iteration {high} while others are at {low}: "
                            "only one step can be undone; restart from the latest checkpoint")
    return Rollback(low + 1, frozenset(w for w, c in commits.items() if c > low))
