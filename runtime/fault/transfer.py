"""A stage's state (parameters, buffers, optimizer state) as plain data: moved, snapshotted, restored.

`flatten` splits any nest of dicts, lists, tuples, tensors and plain scalars (what
`module.state_dict()` and `optimizer.state_dict()` hold) into a JSON skeleton and a list of
tensors; `unflatten` puts it back. Nothing is pickled, so nothing received or read back can run
code. The state moves as one byte buffer, so it arrives bit-exact whatever the dtypes.

- `send_stage_state` / `recv_stage_state`: replica recovery (SWIFT-style). A live replica of the
  stage sends its state over the new generation's groups to a replacement.
- `StepSnapshot`: the stage's state just before STEP, kept to undo a half-applied step exactly
  (see `rollback`).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from reprlib import repr as brief  # a value in an error message, cut short
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from schedcomp.errors import RecoveryError
from schedcomp.runtime.training import attached_to

STATE_FORMAT = 1


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to rebuild one tensor from bytes."""

    dtype: str  # e.g. "float32", a `torch` attribute
    shape: tuple[int, ...]
    device: str  # "cpu" or "cuda": where the owner keeps it (e.g. Adam's `step` stays on the CPU)

    @classmethod
    def of(cls, t: Tensor) -> TensorSpec:
        return cls(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.device.type)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise RecoveryError(f"unknown dtype {self.dtype!r} in a stage state: "
                                "sender and receiver must run the same torch")
        return dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.torch_dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- flatten / unflatten ---------------------------------------------------------------------------


def flatten(obj: Any) -> tuple[Any, list[Tensor]]:
    """A JSON-able skeleton of `obj` and its tensors, in order (tensors are not copied)."""
    tensors: list[Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, Tensor):
            tensors.append(x.detach())
            return {"t": len(tensors) - 1}
        if isinstance(x, dict):
            for k in x:
                if not _is_key(k):
                    raise RecoveryError(f"state key {k!r} is neither a string nor an integer: cannot move it")
            return {"d": [[k, walk(v)] for k, v in x.items()]}
        if isinstance(x, list):
            return {"l": [walk(v) for v in x]}
        if isinstance(x, tuple):
            return {"u": [walk(v) for v in x]}
        if isinstance(x, float) and not math.isfinite(x):
            return {"f": repr(x)}  # JSON has no NaN or infinity: "nan", "inf", "-inf"
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        raise RecoveryError(f"a {type(x).__name__} in the stage state cannot be moved without pickling: "
                            "keep only tensors, numbers, strings, lists and dicts in state dicts")

    return walk(obj), tensors


def unflatten(skeleton: Any, tensors: list[Any]) -> Any:
    """Inverse of `flatten` (`tensors` may also be `TensorSpec`s, to check a layout before allocating).

    The skeleton may come from a file or the network: anything `flatten` cannot have written is a
    RecoveryError, never an IndexError or TypeError. Its nesting is bounded by the JSON reader.
    `flatten` numbers tensors in walk order and keys are unique, so a skeleton whose tensors are
    out of that order, skipped, or whose dict repeats a key (which would silently move one tensor
    into another's place) is refused too.
    """
    seen = 0  # tensors met so far in walk order: the next one must be tensors[seen]

    def walk(x: Any) -> Any:
        nonlocal seen
        if not isinstance(x, dict) or len(x) != 1:
            raise RecoveryError(f"malformed stage state skeleton: {brief(x)} is not a one-key object")
        (tag, v), = x.items()
        if tag == "t":
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < len(tensors):
                raise RecoveryError(f"stage state skeleton names tensor {brief(v)}, but there are {len(tensors)}")
            if v != seen:
                raise RecoveryError(f"stage state skeleton names tensor {v} where tensor {seen} belongs")
            seen += 1
            return tensors[v]
        if tag == "d" and isinstance(v, list):
            if not all(isinstance(kv, list) and len(kv) == 2 and _is_key(kv[0]) for kv in v):
                raise RecoveryError("malformed stage state skeleton: a dict entry is not a [string or integer "
                                    "key, value] pair")
            if len({k for k, _ in v}) != len(v):
                raise RecoveryError("malformed stage state skeleton: a dict repeats a key")
            return {k: walk(item) for k, item in v}
        if tag in ("l", "u") and isinstance(v, list):
            items = [walk(item) for item in v]
            return items if tag == "l" else tuple(items)
        if tag == "v" and (v is None or isinstance(v, (bool, int, float, str))):
            return v
        if tag == "f" and v in _NON_FINITE:
            return float(v)
        raise RecoveryError(f"malformed stage state skeleton: {brief(x)}: "
                            "the state must have been written by the same schedcomp")

    state = walk(skeleton)
    if seen != len(tensors):
        raise RecoveryError(f"stage state skeleton places {seen} of its {len(tensors)} tensors")
    return state


_NON_FINITE = ("nan", "inf", "-inf")


def _is_key(k: Any) -> bool:
    return isinstance(k, (str, int)) and not isinstance(k, bool)


def stage_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Everything a replica of the stage holds that training changes.

    With state tied to the optimizer (`training.attach`: an LR schedule, fp16's loss scaler), that
    too, each under its name: snapshots, transfers and checkpoints then keep it exact.
    """
    state = {"module": module.state_dict(), "optimizer": optimizer.state_dict() if optimizer is not None else None}
    for name, stateful in attached_to(optimizer).items():
        state[name] = stateful.state_dict()
    return state


def load_stage_state(module: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Copy `state` into the module's own tensors and the optimizer (values are copied, never aliased)."""
    attached = attached_to(optimizer)
    extra = set(state) - {"module", "optimizer"}
    if extra != set(attached):
        raise RecoveryError(f"the stage state holds {sorted(extra) or 'nothing'} besides module and optimizer, this "
                            f"stage {sorted(attached) or 'nothing'}: give every worker the same lr_scheduler and "
                            "autocast options")
    with torch.no_grad():
        module.load_state_dict(state["module"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    for name, stateful in attached.items():
        stateful.load_state_dict(state[name])


def to_bytes(tensors: list[Tensor], device: torch.device) -> Tensor:
    """All tensors' bytes, back to back, as one uint8 tensor on `device`."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors])


def from_bytes(buffer: Tensor, specs: list[TensorSpec]) -> list[Tensor]:
    """Inverse of `to_bytes` (each tensor is a fresh copy on its recorded device type)."""
    out, pos = [], 0
    for spec in specs:
        n = spec.nbytes
        chunk = buffer[pos: pos + n]
        pos += n
        device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
        out.append(chunk.to(device).clone().view(spec.torch_dtype).reshape(spec.shape))
    if pos != buffer.numel():
        raise RecoveryError(f"stage state holds {buffer.numel()} bytes but its header describes {pos}: "
                            "sender and receiver must build the same stage")
    return out


def encode_header(skeleton: Any, tensors: list[Tensor], info: dict[str, Any] | None = None) -> bytes:
    specs = [TensorSpec.of(t).__dict__ for t in tensors]
    return json.dumps({"format": STATE_FORMAT, "skeleton": skeleton, "tensors": specs, "info": info or {}}).encode()


def decode_header(data: bytes) -> tuple[Any, list[TensorSpec], dict[str, Any]]:
    try:
        d = json.loads(data)
        if d.get("format") != STATE_FORMAT:
            raise ValueError(f"format {d.get('format')!r}")
        specs = [TensorSpec(s["dtype"], tuple(int(n) for n in s["shape"]), s["device"]) for s in d["tensors"]]
        return d["skeleton"], specs, dict(d.get("info", {}))
    except (ValueError, KeyError, TypeError) as e:
        raise RecoveryError(f"unreadable stage state header ({e}): "
                            "sender and receiver must run the same schedcomp") from None


# ---- replica recovery ----------------------------------------------------------------------------


Wait = Callable[[dist.Work], None]


def _block(work: dist.Work) -> None:
    work.wait()


@dataclass(frozen=True)
class Received:
    """What `recv_stage_state` got besides the state: its size and the sender's `info`."""

    nbytes: int
    info: dict[str, Any]


def send_stage_state(module: nn.Module, optimizer: torch.optim.Optimizer | None, group: dist.ProcessGroup,
                     dst: Iterable[int], device: torch.device | None = None,
                     info: dict[str, Any] | None = None, wait: Wait | None = None) -> int:
    """Send this replica's stage state to the ranks `dst` of `group`; returns the bytes sent to each.

    Three messages per receiver: sizes, a JSON header (skeleton, tensor specs and `info`, plain
    data such as the iteration to resume at), the bytes. `device`: where the transfer buffers
    live (a CUDA device under NCCL; default: the CPU). `wait(work)` waits for each message
    (default: `work.wait()`); pass one that gives up when the generation breaks (`membership.
    wait_abortable`), so that a recipient dying mid-transfer does not hold the sender for the
    group timeout.
    """
    return send_tree(stage_state(module, optimizer), group, dst, device, info, wait)


def recv_stage_state(module: nn.Module, optimizer: torch.optim.Optimizer | None, group: dist.ProcessGroup,
                     src: int, device: torch.device | None = None, wait: Wait | None = None) -> Received:
    """Receive a stage state from rank `src` of `group` into `module`, `optimizer` (`wait`: see `send_stage_state`)."""
    state, got = recv_tree(group, src, device, wait)
    load_stage_state(module, optimizer, state)
    return got


def send_tree(obj: Any, group: dist.ProcessGroup, dst: Iterable[int], device: torch.device | None = None,
              info: dict[str, Any] | None = None, wait: Wait | None = None) -> int:
    """Send any nest `flatten` accepts to the ranks `dst` of `group` (see `send_stage_state`); returns its bytes."""
    device = device or torch.device("cpu")
    skeleton, tensors = flatten(obj)
    text = encode_header(skeleton, tensors, info or {})
    header = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device)
    payload = to_bytes(tensors, device)
    sizes = torch.tensor([header.numel(), payload.numel()], dtype=torch.int64, device=device)
    for rank in dst:
        for t in (sizes, header, payload) if payload.numel() else (sizes, header):  # an empty nest: no bytes
            (wait or _block)(dist.isend(t, dst=rank, group=group))
    return payload.numel()


def recv_tree(group: dist.ProcessGroup, src: int, device: torch.device | None = None,
              wait: Wait | None = None) -> tuple[Any, Received]:
    """Receive what `send_tree` sent from rank `src` of `group`: the nest, its size and the sender's `info`."""
    device = device or torch.device("cpu")
    wait = wait or _block
    sizes = torch.zeros(2, dtype=torch.int64, device=device)
    wait(dist.irecv(sizes, src=src, group=group))
    header = torch.empty(int(sizes[0]), dtype=torch.uint8, device=device)
    wait(dist.irecv(header, src=src, group=group))
    payload = torch.empty(int(sizes[1]), dtype=torch.uint8, device=device)
    if payload.numel():
        wait(dist.irecv(payload, src=src, group=group))
    skeleton, specs, info = decode_header(header.cpu().numpy().tobytes())
    return unflatten(skeleton, from_bytes(payload, specs)), Received(payload.numel(), info)


# ---- undoing a step --------------------------------------------------------------------------------


class StepSnapshot:
    """The stage's state just before an optimizer step, to undo that step bit-exactly.

    `take(i)` right before STEP of iteration i (buffers are reused from one iteration to the next
    when the state's layout has not changed); `restore()` puts the state back.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._read: Callable[[], Any] = functools.partial(stage_state, module, optimizer)
        self._load: Callable[[Any], None] = functools.partial(load_stage_state, module, optimizer)
        self.iteration: int | None = None
        self._skeleton: Any = None
        self._saved: list[Tensor] = []

    @classmethod
    def of_state(cls, read: Callable[[], Any], load: Callable[[Any], None]) -> StepSnapshot:
        """A snapshot of any state `read()` returns and `load(state)` puts back (every chunk a worker
        holds: `fault.chunks.held_snapshot`)."""
        snapshot = cls.__new__(cls)
        snapshot._read, snapshot._load = read, load
        snapshot.iteration, snapshot._skeleton, snapshot._saved = None, None, []
        return snapshot

    def take(self, iteration: int) -> None:
        skeleton, tensors = flatten(self._read())
        same = skeleton == self._skeleton and all(
            s.shape == t.shape and s.dtype == t.dtype and s.device == t.device
            for s, t in zip(self._saved, tensors, strict=True))
        with torch.no_grad():
            if same:
                for s, t in zip(self._saved, tensors, strict=True):
                    s.copy_(t)
            else:
                self._skeleton, self._saved = skeleton, [t.clone() for t in tensors]
        self.iteration = iteration

    def restore(self) -> int:
        """Undo the step taken after the snapshot; returns the iteration whose step was undone."""
        if self.iteration is None:
            raise RecoveryError("no snapshot was taken before the step to undo: take one before every STEP")
        # Clones: the optimizer keeps the tensors it loads, and the snapshot's buffers are reused.
        self._load(unflatten(self._skeleton, [s.clone() for s in self._saved]))
        undone, self.iteration = self.iteration, None
        return undone
