"""The cost model: how long each op takes and how much activation memory it holds.

Times are in arbitrary units (the unit model has F = B = W = 1); memory is in activation units
(the unit model holds one per micro-batch in flight) or, when `memory_unit` is "bytes" (a measured
model, `schedcomp profile`), in bytes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from schedcomp import fileio
from schedcomp.errors import CostModelError, SchedcompTypeError
from schedcomp.limits import MAX_COST, MIN_SPEED
from schedcomp.topology import Worker

FORMAT_VERSION = 1
_Model = TypeVar("_Model")
MEMORY_UNITS = ("units", "bytes")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _per_stage(name: str, value: float | Sequence[float], pp: int) -> tuple[float, ...]:
    if _is_number(value):
        return (_cost(name, value),) * pp  # checked once, not once per stage (pp may be 200k)
    if not isinstance(value, (list, tuple)):
        raise CostModelError(f"{name} must be a number or a list of one number per stage, got {type(value).__name__}")
    if len(value) != pp:
        raise CostModelError(f"{name} has {len(value)} entries but the model has {pp} stages: give one per stage")
    try:  # per-stage lists repeat a few values (pp may be 200k): check each (type, value) once, in order
        distinct = list(dict.fromkeys((type(v), v) for v in value))
    except TypeError:  # an unhashable entry: check them all, in order
        return tuple(_cost(name, v) for v in value)
    for _, v in distinct:
        _cost(name, v)
    return tuple(map(float, value))


def _cost(name: str, v: Any) -> float:
    # Compared before any float(): a 401-digit int would overflow; NaN fails both comparisons.
    if not _is_number(v) or not 0 <= v <= MAX_COST:
        shown = repr(v) if len(repr(v)) < 40 else repr(v)[:37] + "..."
        raise CostModelError(f"{name} must hold numbers from 0 to {MAX_COST:g}, got {shown}")
    return float(v)


def _limit(value: object, pp: int) -> float | tuple[float, ...] | None:
    """None, one positive finite number, or one per stage (a tuple; equal entries collapse to one)."""
    if value is None:
        return None
    if _is_number(value):
        if not (math.isfinite(value) and value > 0):
            raise CostModelError(f"memory_limit must be a positive finite number, got {value!r}")
        return float(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise SchedcompTypeError(f"memory_limit must be a number, one number per stage or None, got {value!r}")
    per_stage = _per_stage("memory_limit", value, pp)
    if any(v <= 0 for v in per_stage):
        raise CostModelError(f"memory_limit must be positive at every stage, got {list(per_stage)}")
    return per_stage


@dataclass(frozen=True)
class CostModel:
    """Per-stage costs of one micro-batch, communication, optimizer and memory.

    - `forward`, `backward_input` (B), `backward_weight` (W): compute time per stage.
      A fused backward (BW) costs B + W.
    - `p2p`: latency of one activation or gradient transfer between neighbouring stages.
    - `allreduce`, `optimizer`: per-stage gradient all-reduce and optimizer-step time.
    - `activation`: memory one micro-batch's forward allocates at each stage;
      B frees the fraction `b_frees` of it (one fraction, or one per stage), W the rest (BW frees all).
    - `memory_limit`: the most activation memory a worker may hold: one number for every stage,
      one per stage (e.g. the fault-free plan's per-stage peaks), or None (unlimited).
    - `memory_unit`: "units" (activation units) or "bytes" (measured activations and limit).
    - `speed`: per-worker speed factors (1.0 = nominal, 0.5 = a straggler at half speed);
      a worker's compute time is the stage time divided by its factor.
    """

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    p2p: float = 0.0
    allreduce: tuple[float, ...] = ()
    optimizer: tuple[float, ...] = ()
    activation: tuple[float, ...] = ()
    b_frees: float | tuple[float, ...] = 0.5
    memory_limit: float | tuple[float, ...] | None = None
    speed: Mapping[Worker, float] = field(default_factory=dict)
    memory_unit: str = "units"

    def __post_init__(self) -> None:
        if not isinstance(self.forward, (list, tuple)):
            raise CostModelError(f"forward must be a list of one time per stage, got {type(self.forward).__name__}")
        pp = len(self.forward)
        if pp < 1:
            raise CostModelError("a cost model needs at least one stage")
        set_ = object.__setattr__
        set_(self, "forward", _per_stage("forward", self.forward, pp))
        set_(self, "backward_input", _per_stage("backward_input", self.backward_input, pp))
        set_(self, "backward_weight", _per_stage("backward_weight", self.backward_weight, pp))
        set_(self, "allreduce", _per_stage("allreduce", self.allreduce or 0.0, pp))
        set_(self, "optimizer", _per_stage("optimizer", self.optimizer or 0.0, pp))
        set_(self, "activation", _per_stage("activation", self.activation or 1.0, pp))
        set_(self, "p2p", _per_stage("p2p", [self.p2p], 1)[0])
        frees = self.b_frees if isinstance(self.b_frees, Sequence) else [self.b_frees]
        if isinstance(self.b_frees, str) or not all(
            _is_number(f) and 0.0 <= f <= 1.0 for f in frees
        ):
            raise CostModelError(f"b_frees must be a fraction in [0, 1] (or one per stage), got {self.b_frees!r}")
        if isinstance(self.b_frees, Sequence):
            set_(self, "b_frees", _per_stage("b_frees", self.b_frees, pp))
        set_(self, "memory_limit", _limit(self.memory_limit, pp))
        if self.memory_unit not in MEMORY_UNITS:
            raise CostModelError(f"memory_unit must be one of {', '.join(MEMORY_UNITS)}, got {self.memory_unit!r}")
        if not isinstance(self.speed, Mapping):
            raise SchedcompTypeError(f"speed must map workers to factors, got {type(self.speed).__name__}")
        speed = dict(self.speed)
        for w, v in speed.items():
            if not isinstance(w, Worker):
                raise CostModelError(f"speed is keyed by Worker, got {w!r}")
            # Bounded both ways: a factor of 1e-320 made every time infinite and the solvers fail.
            if not _is_number(v) or not MIN_SPEED <= v <= 1 / MIN_SPEED:
                raise CostModelError(f"speed factor for {w} must be a number from {MIN_SPEED:g} to "
                                     f"{1 / MIN_SPEED:g}, got {v!r}")
        set_(self, "speed", speed)

    def check_workers(self, topology: Any) -> None:
        """Refuse speed factors for workers outside `topology` (a typo that would silently do nothing)."""
        for w in self.speed:
            if not (0 <= w.pipeline < topology.dp and 0 <= w.stage < topology.pp):
                raise CostModelError(f"the cost model has a speed factor for worker {w}, outside the job "
                                     f"(pipelines 0..{topology.dp - 1}, stages 0..{topology.pp - 1}): drop it")

    @classmethod
    def uniform(
        cls,
        pp: int,
        forward: float = 1.0,
        backward_input: float = 1.0,
        backward_weight: float = 1.0,
        p2p: float = 0.0,
        allreduce: float = 0.0,
        optimizer: float = 0.0,
        activation: float = 1.0,
        b_frees: float = 0.5,
        memory_limit: float | None = None,
    ) -> CostModel:
        """The same costs at every stage; `CostModel.uniform(pp)` is the unit model."""
        return cls(
            forward=(forward,) * pp,
            backward_input=(backward_input,) * pp,
            backward_weight=(backward_weight,) * pp,
            p2p=p2p,
            allreduce=(allreduce,) * pp,
            optimizer=(optimizer,) * pp,
            activation=(activation,) * pp,
            b_frees=b_frees,
            memory_limit=memory_limit,
        )

    @property
    def pp(self) -> int:
        return len(self.forward)

    def compute_time(self, kind: str, worker: Worker, stage: int | None = None) -> float:
        """Time `worker` needs for one op of `kind` ("F", "B", "W" or "BW") at `stage` (default: its own;
        with virtual stages the op's chunk, whose costs are the model's entries for that stage)."""
        s = worker.stage if stage is None else stage
        base = {
            "F": self.forward[s],
            "B": self.backward_input[s],
            "W": self.backward_weight[s],
            "BW": self.backward_input[s] + self.backward_weight[s],
        }[kind]
        return base / self.speed.get(worker, 1.0)

    def allreduce_of(self, stages: Sequence[int]) -> float:
        """The all-reduce time of a worker holding `stages` (its chunks): one collective over all of them."""
        return sum(self.allreduce[s] for s in stages)

    def optimizer_of(self, stages: Sequence[int]) -> float:
        """The optimizer-step time of a worker holding `stages` (its chunks), before its speed factor."""
        return sum(self.optimizer[s] for s in stages)

    def memory_delta(self, kind: str, stage: int) -> float:
        """Change in held activation memory when an op of `kind` completes at `stage`."""
        a, f = self.activation[stage], self.frees_at(stage)
        return {"F": a, "B": -a * f, "W": -a * (1.0 - f), "BW": -a}[kind]

    def frees_at(self, stage: int) -> float:
        """The fraction of a micro-batch's activation that B frees at `stage`."""
        return self.b_frees[stage] if isinstance(self.b_frees, tuple) else self.b_frees

    def limit_at(self, stage: int) -> float:
        """The memory limit of a worker of `stage` (inf when unlimited)."""
        limit = self.memory_limit
        if limit is None:
            return math.inf
        return limit[stage] if isinstance(limit, tuple) else limit

    @property
    def stage_limits(self) -> tuple[float, ...]:
        return tuple(self.limit_at(s) for s in range(self.pp))

    def with_memory_limit(self, limit: float | Sequence[float] | None) -> CostModel:
        return CostModel(**{**self.__dict__, "memory_limit": limit})

    # ---- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "forward": list(self.forward),
            "backward_input": list(self.backward_input),
            "backward_weight": list(self.backward_weight),
            "p2p": self.p2p,
            "allreduce": list(self.allreduce),
            "optimizer": list(self.optimizer),
            "activation": list(self.activation),
            "b_frees": list(self.b_frees) if isinstance(self.b_frees, tuple) else self.b_frees,
            "memory_limit": list(self.memory_limit) if isinstance(self.memory_limit, tuple) else self.memory_limit,
            "speed": {str(w): v for w, v in sorted(self.speed.items())},
            **({"memory_unit": self.memory_unit} if self.memory_unit != "units" else {}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> CostModel:
        if not isinstance(data, dict):
            raise CostModelError("a cost model must be a JSON object with per-stage lists such as 'forward'")
        version = data.get("version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise CostModelError(
                f"cost model version {version!r} is not supported: this schedcomp reads version {FORMAT_VERSION}"
            )
        known = {"version", "forward", "backward_input", "backward_weight", "p2p", "allreduce", "optimizer",
                 "activation", "b_frees", "memory_limit", "speed", "memory_unit"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CostModelError(
                f"unknown cost model key(s) {', '.join(map(repr, unknown))}: "
                f"allowed keys are {', '.join(sorted(known))}"
            )
        missing = [k for k in ("forward", "backward_input", "backward_weight") if k not in data]
        if missing:
            raise CostModelError(f"cost model is missing {', '.join(missing)}: give one time per stage for each")
        try:
            speed_data = data.get("speed") or {}
            if not isinstance(speed_data, dict):
                raise CostModelError("speed must be an object mapping workers ('1:3') to factors")
            speed = {Worker.parse(k): v for k, v in speed_data.items()}
            if len(speed) != len(speed_data):  # "1:0" and "01:0": one would silently override the other
                raise CostModelError("speed names a worker twice (e.g. '1:0' and '01:0'): give each worker once")
            if not isinstance(data["forward"], list):
                raise CostModelError("forward must be a list of one time per stage")
            pp = len(data["forward"])
            return cls(
                forward=data["forward"],
                backward_input=data["backward_input"],
                backward_weight=data["backward_weight"],
                p2p=data.get("p2p", 0.0),
                allreduce=data.get("allreduce") or (0.0,) * pp,
                optimizer=data.get("optimizer") or (0.0,) * pp,
                activation=data.get("activation") or (1.0,) * pp,
                b_frees=data.get("b_frees", 0.5),
                memory_limit=data.get("memory_limit"),
                speed=speed,
                memory_unit=data.get("memory_unit", "units"),
            )
        except CostModelError:
            raise
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise CostModelError(f"malformed cost model: {exc}") from None

    def to_json(self) -> str:
        return fileio.dumps_json(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the model as JSON atomically: on failure the old file stays whole."""
        fileio.write_atomic(model_path(path), self.to_json(), CostModelError)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return load_model(path, "cost model", cls.from_dict)


def load_model(path: str | Path, what: str, from_dict: Callable[[Any], _Model]) -> _Model:
    """`from_dict` of the JSON file at `path`, every problem one `CostModelError` naming the file (`what`)."""
    path = model_path(path, what)
    text = fileio.read_text(path, what, CostModelError)
    data = fileio.load_json(text, f"{what} {path}", CostModelError)
    try:
        return from_dict(data)
    except CostModelError as exc:
        raise CostModelError(f"{what} {path}: {exc}") from None


def model_path(path: object, what: str = "cost model") -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise SchedcompTypeError(f"a {what} path must be a string or Path, got {type(path).__name__}")
    return Path(path)
