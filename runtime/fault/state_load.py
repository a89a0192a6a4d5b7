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
    fields = {name: _fields(s) for name, s in attached_to(optimizer).items()}
    try:
        load()
        missing = _missing_state(optimizer) or _odd_attached(optimizer, fields)
    except _LOAD_ERRORS as e:
        _put_back(module, optimizer, kept)
        raise RecoveryError(f"checkpoint manifest {path}: its state does not load into this stage "
                            f"({first_line(e)})") from None
    if missing:
        _put_back(module, optimizer, kept)
        raise RecoveryError(f"checkpoint manifest {path}: the optimizer's state {missing}: the checkpoint was "
                            "damaged or written by another optimizer or schedule")


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    # parameters and every buffer, non-persistent ones too (the layer loads copy them)
    return dict(itertools.chain(module.named_parameters(), module.named_buffers()))


def _copy_of(module: nn.Module, optimizer: Any) -> tuple[dict[str, torch.Tensor], Any, dict[str, Any]]:
    # On the CPU: a restore runs when a device may be full; the copy is the stage's size, once.
    tensors = {name: t.detach().to("cpu", copy=True) for name, t in _tensors(module).items()}
    state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    # each tied object's attributes as bound now (a crafted load may rebind any, even its `optimizer`) and
    # its state's values (a load may also write into them in place)
    attached = {name: (dict(vars(s)) if hasattr(s, "__dict__") else None, copy.deepcopy(s.state_dict()))
                for name, s in attached_to(optimizer).items()}
    return tensors, state, attached


def _put_back(module: nn.Module, optimizer: Any, kept: tuple[dict[str, torch.Tensor], Any, dict[str, Any]]) -> None:
    tensors, state, attached = kept
    with torch.no_grad():
        for name, t in _tensors(module).items():
            t.copy_(tensors[name])
    if optimizer is not None:
        optimizer.load_state_dict(state)
    for name, stateful in attached_to(optimizer).items():
        bound, values = attached[name]
        if bound is not None:
            stateful.__dict__.clear()
            stateful.__dict__.update(bound)
        stateful.load_state_dict(values)


def _odd_attached(optimizer: Any, before: dict[str, dict[str, str]]) -> str:
    """What tied to the optimizer (LR schedule, loss scaler) came back with fields of other kinds than it had:
    a schedule's `load_state_dict` takes whatever it is given into its `__dict__` (even its `optimizer`)."""
    for name, stateful in attached_to(optimizer).items():
        now = _fields(stateful)
        odd = sorted(k for k in set(now) | set(before.get(name, {})) if now.get(k) != before.get(name, {}).get(k))
        if odd:
            return f"tied {name} holds {odd} unlike this stage's"
    return ""


def _fields(obj: Any) -> dict[str, str]:
    """Each attribute's kind (numbers alike: a float stored as a whole number is still a number)."""
    def kind(v: Any) -> str:
        if isinstance(v, bool) or v is None:
            return repr(v) if v is None else "bool"
        if isinstance(v, (int, float)):
            return "number"
        return "sequence" if isinstance(v, (list, tuple)) else type(v).__name__

    return {k: kind(v) for k, v in vars(obj).items()} if hasattr(obj, "__dict__") else {}


def _missing_state(optimizer: Any) -> str:
    """Keys some parameter's (non-empty) state lacks that a probe of its group's settings holds after a step."""
    groups, states = getattr(optimizer, "param_groups", None), getattr(optimizer, "state", None)
    if not isinstance(groups, list) or not isinstance(getattr(optimizer, "defaults", None), dict) \
            or not hasattr(states, "get"):
        return ""  # not torch.optim's shape: its own load is the only check
    for group in groups:
        needed = _probe_keys(optimizer, group)
        for p in group["params"]:
            state = states.get(p)
            if needed and state and not needed <= set(state):
                return f"of a parameter lacks {sorted(needed - set(state))}, which this optimizer keeps for every " \
                       "parameter it stepped"
    return ""


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
    except Exception:  # any failure of the probe only means it cannot tell
        return set()
