"""The state of every model chunk one worker holds, keyed by virtual stage: snapshot, transfer, load.

With virtual stages (`Topology.chunks` = v > 1) a worker at place p holds the chunks
`topology.chunks_of(p)`, each its own module and optimizer (`PipelineTrainer.stages`). Recovery
moves them together: the step snapshot holds all of them, a replacement receives all of them from
a live worker at the same place (which holds the same chunks), and checkpoints are written per
chunk (`checkpoint.checkpoint_dir(directory, iteration, s)` for virtual stage s).

`Held` maps each virtual stage a worker holds to its (module, optimizer). The state of several
chunks is a dict keyed by virtual stage, and loading one checks that its keys are exactly the
chunks held, so chunk A's tensors can never land in chunk B (even where the two have the same
layout). With one chunk the state is the plain stage state (`transfer.stage_state`): the snapshot,
the wire format and the checkpoints of one-chunk jobs are what they were.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.transfer import (
    Received,
    StepSnapshot,
    Wait,
    load_stage_state,
    recv_stage_state,
    recv_tree,
    send_stage_state,
    send_tree,
    stage_state,
)

Chunk = tuple[nn.Module, torch.optim.Optimizer | None]
Held = Mapping[int, Chunk]  # virtual stage -> its module and optimizer, for every chunk one worker holds


def held_of(stages: Mapping[int, Any]) -> dict[int, Chunk]:
    """The chunks of a `PipelineTrainer.stages` mapping (each a `Stage` with `module` and `optimizer`)."""
    return {s: (stage.module, stage.optimizer) for s, stage in stages.items()}


def _only(held: Held) -> Chunk | None:
    """The one chunk held (None when there are several)."""
    if not held:
        raise RecoveryError("this worker holds no model chunk: build its stages before moving their state")
    return next(iter(held.values())) if len(held) == 1 else None


def held_state(held: Held) -> Any:
    """Everything training changes in the chunks held: the stage state, or with several chunks a
    dict of them keyed by virtual stage."""
    only = _only(held)
    if only is not None:
        return stage_state(*only)
    return {s: stage_state(module, optimizer) for s, (module, optimizer) in held.items()}


def load_held_state(held: Held, state: Any) -> None:
    """Copy `state` (from `held_state` of a worker holding the same chunks) into the chunks held."""
    only = _only(held)
    if only is not None:
        load_stage_state(*only, state)
        return
    if not isinstance(state, dict) or set(state) != set(held):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise RecoveryError(f"the state holds chunks {got}, this worker {sorted(held)}: state moves only between "
                            "workers at the same place of their pipelines")
    for s, (module, optimizer) in held.items():
        load_stage_state(module, optimizer, state[s])


def held_snapshot(held: Held) -> StepSnapshot:
    """A `StepSnapshot` of every chunk held (one `take` and one `restore` undo the step of them all)."""
    only = _only(held)
    if only is not None:
        return StepSnapshot(*only)
    return StepSnapshot.of_state(lambda: held_state(held), lambda state: load_held_state(held, state))


def send_held_state(held: Held, group: dist.ProcessGroup, dst: Iterable[int], device: torch.device | None = None,
                    info: dict[str, Any] | None = None, wait: Wait | None = None) -> int:
    """`transfer.send_stage_state` for every chunk held, in one message; returns the bytes sent to each."""
    only = _only(held)
    if only is not None:
        return send_stage_state(*only, group, dst, device, info, wait)
    return send_tree(held_state(held), group, dst, device, info, wait)


def recv_held_state(held: Held, group: dist.ProcessGroup, src: int, device: torch.device | None = None,
                    wait: Wait | None = None) -> Received:
    """Receive what `send_held_state` sent from rank `src` into the chunks held (the same ones)."""
    only = _only(held)
    if only is not None:
        return recv_stage_state(*only, group, src, device, wait)
    state, got = recv_tree(group, src, device, wait)
    load_held_state(held, state)
    return got
