"""Watch every tensor handed to torch.distributed and check its group has a backend for its device.

An NCCL-only group cannot carry a CPU tensor ("No backend type associated with device type cpu"),
a gloo-for-CPU group cannot carry a GPU tensor. `Audit` wraps the collective and point-to-point
functions of `torch.distributed` (the runtime calls them as `dist.<name>` at call time, so the
wrappers see every call), records (function, device types, device types the group serves) and
lets the test assert there was no mismatch. Used by the CPU suite (gloo) and by tests/gpu (NCCL).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from schedcomp.runtime.comm import served_devices

WATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter_tensor",
           "gather", "scatter", "isend", "irecv", "send", "recv", "batch_isend_irecv")


@dataclass(frozen=True)
class Call:
    """One call: which function, the device types of its tensors, the device types its group serves."""

    name: str
    devices: frozenset[str]
    served: frozenset[str]

    @property
    def ok(self) -> bool:
        return self.devices <= self.served


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class Audit:
    """`with Audit() as audit: ...` records every watched call made meanwhile (in this process)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> Audit:
        for name in WATCHED:
            original = getattr(dist, name)
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if name == "batch_isend_irecv":
                for op in args[0] if args else kwargs["p2p_op_list"]:
                    self._note(name, [op.tensor], op.group)
            else:
                bound = signature.bind(*args, **kwargs)
                tensors = [t for v in bound.arguments.values() for t in _tensors(v)]
                self._note(name, tensors, bound.arguments.get("group"))
            return original(*args, **kwargs)

        return wrapper

    def _note(self, name: str, tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        group = group if group is not None else dist.group.WORLD
        self.calls.append(Call(name, frozenset(t.device.type for t in tensors), served_devices(group)))

    def mismatches(self) -> list[Call]:
        """Calls that handed a tensor to a group with no backend for its device."""
        return [c for c in self.calls if not c.ok]

    def names(self) -> set[str]:
        return {c.name for c in self.calls}
