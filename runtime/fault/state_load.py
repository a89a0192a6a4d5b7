"""Loading a checkpoint's state into a stage all or nothing: `load_all_or_nothing(module, optimizer, load, path)`.

The checks before a load (`checkpoint_check`, `checkpoint_layers_check`) see names, shapes, dtypes and
digests, but not what an optimizer's state must hold: a crafted manifest that renames Adam's `step` or
`exp_avg` passes them. torch then either fails half-way through the load or, worse, loads a state the
optimizer cannot step with (a KeyError at the next step, mid-training). So the load runs against a copy
of the stage's state, and afterwards each parameter's optimizer state must hold every key the optimizer
makes for a parameter of its group (found by stepping a probe parameter once); otherwise, or if the load
itself fails, the stage gets its copy back and the caller one RecoveryError naming the file.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from schedcomp.errors import RecoveryError
from schedcomp.runtime.training import attached_to

_LOAD_ERRORS = (RuntimeError, ValueError, KeyError, TypeError, IndexError)  # what the checks could not foresee


def load_all_or_nothing(module: nn.Module, optimizer: Any, load: Callable[[], None], path: Path | str) -> None:
    """Run `load` (filling `module`, `optimizer` and what is tied to it); if it fails or leaves an optimizer
    state that cannot step, put everything back as it was and raise one RecoveryError naming `path`."""
    from schedcomp.runtime.fault.dcp_io import first_line

    kept = _copy_of(module, optimizer)
    try:
        load()
        missing = _missing_state(optimizer)
    except _LOAD_ERRORS as e:
        _put_back(module, optimizer, kept)
        raise RecoveryError(f"checkpoint manifest {path}: its state does not load into this stage "
                            f"({first_line(e)})") from None
    if missing:
        _put_back(module, optimizer, kept)
        raise RecoveryError(f"checkpoint manifest {path}: the optimizer state of a parameter lacks {missing}, "
                            "which this optimizer keeps for every parameter it stepped: the checkpoint was "
                            "damaged or written by another optimizer")


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    # parameters and every buffer, non-persistent ones too (the layer loads copy them)
    return dict(itertools.chain(module.named_parameters(), module.named_buffers()))


def _copy_of(module: nn.Module, optimizer: Any) -> tuple[dict[str, torch.Tensor], Any, dict[str, Any]]:
    # On the CPU: a restore runs when a device may be full; the copy is the stage's size, once.
    tensors = {name: t.detach().to("cpu", copy=True) for name, t in _tensors(module).items()}
    state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    attached = {name: copy.deepcopy(s.state_dict()) for name, s in attached_to(optimizer).items()}
    return tensors, state, attached


def _put_back(module: nn.Module, optimizer: Any, kept: tuple[dict[str, torch.Tensor], Any, dict[str, Any]]) -> None:
    tensors, state, attached = kept
    with torch.no_grad():
        for name, t in _tensors(module).items():
            t.copy_(tensors[name])
    if optimizer is not None:
        optimizer.load_state_dict(state)
    for name, stateful in attached_to(optimizer).items():
        stateful.load_state_dict(attached[name])


def _missing_state(optimizer: Any) -> list[str]:
    """Keys some parameter's (non-empty) state lacks that a probe of its group's settings holds after a step."""
    if optimizer is None:
        return []
    for group in optimizer.param_groups:
        needed = _probe_keys(optimizer, group)
        for p in group["params"]:
            state = optimizer.state.get(p)
            if needed and state and not needed <= set(state):
                return sorted(needed - set(state))
    return []


def _probe_keys(optimizer: Any, group: dict[str, Any]) -> set[str]:
    """What `type(optimizer)` keeps for a parameter of `group` after one step (empty where a probe cannot
    be built: an optimizer whose constructor takes other arguments is then checked by its own load only)."""
    settings = {k: v for k, v in group.items() if k in optimizer.defaults}  # not a schedule's `initial_lr`
    device = group["params"][0].device if group["params"] else torch.device("cpu")
    probe = nn.Parameter(torch.zeros(1, device=device))
    try:
        stepper = type(optimizer)([probe], **settings)
        probe.grad = torch.zeros(1, device=device)
        stepper.step()
        return set(stepper.state.get(probe, {}))
    except Exception:
        return set()
