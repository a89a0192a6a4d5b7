"""Checking a stage checkpoint before any of it is loaded: a crafted one is refused in one line.

A checkpoint directory may have been edited, truncated, copied from another job or crafted. Before
a single tensor is allocated or a data file opened, `restore` checks, in this order:

1. the manifest (`read_manifest`): bounded size and nesting, the right format, iteration and
   stage, tensor specs of known dtypes and non-negative shapes, a skeleton `flatten` could have
   written;
2. its layout against the stage's own state (`check_against_stage`): the module's tensors have
   exactly the stage's own names, dtypes and shapes; the optimizer has the stage's parameter
   groups, and each state tensor is no bigger than the parameter it belongs to (or, when the
   optimizer already holds state, exactly its shape). So no manifest, whatever shapes it claims,
   makes us allocate more than the stage itself holds;
3. DCP's `.metadata` (`checkpoint_storage.check_storage`, run by `dcp_io.SafeReader` on every
   read of it): every data file it names lies inside the checkpoint's own directory (no `..`, no
   absolute path, no symlink out), exists, and holds the byte range named; every tensor is one whole
   chunk we could have written; no stream transforms (we never write any);
4. the metadata against the manifest (`checkpoint_storage.check_metadata_matches`): the same
   tensors, sizes and dtypes, each stored in at least as many bytes as it holds;
5. the stored bytes against the manifest (`checkpoint_storage.check_digests`): each tensor's bytes
   have the SHA-256 the manifest recorded once DCP had written them (`stored_digests`), so changed
   data, or metadata sending a tensor to another one's bytes, is refused before torch reads any of it.

Per-layer checkpoints (`checkpoint_layers`) go through the same steps, per layer read
(`checkpoint_layers_check`).

Every failure is a `RecoveryError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from reprlib import repr as brief  # a value in an error message, cut short
from typing import Any

import torch
from torch import nn

from schedcomp.errors import RecoveryError
from schedcomp.fileio import load_json, read_text
from schedcomp.runtime.fault.checkpoint_storage import FIX, Stored, describe, is_int
from schedcomp.runtime.fault.transfer import TensorSpec, stage_state, unflatten

MANIFEST = "manifest.json"
CHECKPOINT_FORMAT = 2  # 2: each tensor's stored bytes carry a SHA-256 digest
LAYERED_FORMAT = 3  # 3: state per model layer (`checkpoint_layers`), written from an nn.Sequential model
_OPTIMIZER_COPIES = 4  # bound on an unknown optimizer's state, in copies of the module
_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Manifest:
    """A checked manifest: what `AsyncCheckpointer` wrote for one stage and iteration."""

    path: Path
    iteration: int
    stage: int
    skeleton: Any
    specs: tuple[TensorSpec, ...]
    digests: tuple[str, ...]  # SHA-256 of each tensor's stored bytes, as DCP wrote them

    @property
    def stored(self) -> tuple[Stored, ...]:
        return tuple(Stored(f"t{i}", s, d) for i, (s, d) in enumerate(zip(self.specs, self.digests, strict=True)))


def read_manifest(directory: Path, iteration: int, stage: int) -> Manifest:
    """The manifest in `directory` (a `checkpoint_dir`), checked; RecoveryError naming it otherwise."""
    data, what = manifest_json(directory, iteration, stage, CHECKPOINT_FORMAT)
    specs = parse_specs(data, what)
    if "skeleton" not in data:
        raise RecoveryError(f"{what} has no skeleton: {FIX}")
    return Manifest(directory / MANIFEST, iteration, stage, data["skeleton"], specs,
                    tuple(s["sha256"] for s in data["tensors"]))


def manifest_json(directory: Path, iteration: int, stage: int, want: int) -> tuple[dict[str, Any], str]:
    """The manifest in `directory` as a JSON object of format `want` for (`iteration`, `stage`), and how to
    name it in an error."""
    path = directory / MANIFEST
    what = f"checkpoint manifest {path}"
    data = load_json(read_text(path, "checkpoint manifest", RecoveryError), what, RecoveryError)
    if not isinstance(data, dict):
        raise RecoveryError(f"{what} is a JSON {type(data).__name__}, not an object: {FIX}")
    if _same_int(data.get("format"), 1):
        raise RecoveryError(f"{what} was written by an older schedcomp, without digests of its tensors: "
                            "restart from scratch or with the schedcomp that wrote it")
    if want == LAYERED_FORMAT and _same_int(data.get("format"), CHECKPOINT_FORMAT):
        raise RecoveryError(f"{what} holds one stage's state, not each layer's: it was written by an older "
                            "schedcomp or for a stage builder, and an nn.Sequential model restores layers; restart "
                            "from scratch or with the schedcomp that wrote it")
    if want == CHECKPOINT_FORMAT and _same_int(data.get("format"), LAYERED_FORMAT):
        raise RecoveryError(f"{what} holds each layer's state (written from an nn.Sequential model): restore it "
                            "by layers, giving the model as an nn.Sequential")
    for key, value in (("format", want), ("iteration", iteration), ("stage", stage)):
        if not _same_int(data.get(key), value):
            raise RecoveryError(f"{what} has {key} {brief(data.get(key))}, expected {value}: {FIX}")
    return data, what


def parse_specs(data: dict[str, Any], what: str) -> tuple[TensorSpec, ...]:
    """The checked specs of `data["tensors"]` (each with its digest)."""
    tensors = data.get("tensors")
    if not isinstance(tensors, list):
        raise RecoveryError(f"{what} has no list of tensors: {FIX}")
    return tuple(_spec(s, i, what) for i, s in enumerate(tensors))


def _spec(raw: Any, i: int, what: str) -> TensorSpec:
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "device", "sha256"}:
        raise RecoveryError(f"{what}: tensor {i} is not {{dtype, shape, device, sha256}}: {FIX}")
    if not isinstance(raw["sha256"], str) or len(raw["sha256"]) != 64:
        raise RecoveryError(f"{what}: tensor {i} has digest {brief(raw['sha256'])}, not a SHA-256 in hex: {FIX}")
    dtype, shape, device = raw["dtype"], raw["shape"], raw["device"]
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise RecoveryError(f"{what}: tensor {i} has unknown dtype {brief(dtype)}: {FIX}")
    if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
        raise RecoveryError(f"{what}: tensor {i} has shape {brief(shape)}, not a list of sizes >= 0: {FIX}")
    if device not in _DEVICES:
        raise RecoveryError(f"{what}: tensor {i} has device {brief(device)}, not one of {_DEVICES}: {FIX}")
    return TensorSpec(dtype, tuple(shape), device)


# ---- the manifest against the stage's own state ---------------------------------------------------


def check_against_stage(manifest: Manifest, module: nn.Module, optimizer: Any) -> None:
    """Refuse a manifest whose layout is not this stage's own (module and optimizer)."""
    what = f"checkpoint manifest {manifest.path}"
    saved = unflatten_checked(manifest)
    if not isinstance(saved, dict) or not {"module", "optimizer"} <= set(saved):
        raise RecoveryError(f"{what} does not hold a stage state (module and optimizer): {FIX}")
    own = stage_state(module, optimizer)
    if set(saved) != set(own):  # state tied to the optimizer (`training.attach`): an LR schedule, a loss scaler
        missing, extra = key_diff(saved, own)
        raise RecoveryError(f"{what} holds other training state than this stage (missing {missing}, unexpected "
                            f"{extra}): pass the same lr_scheduler and autocast options as the run that wrote it")
    for name in set(saved) - {"module", "optimizer"}:
        if any(True for _ in _specs_in(saved[name])):  # schedules and scalers are numbers: a tensor is crafted
            raise RecoveryError(f"{what}: the {name} state holds a tensor: {FIX}")
    check_module(saved["module"], own["module"], what)
    if (own["optimizer"] is None) != (saved["optimizer"] is None):
        raise RecoveryError(f"{what} {'has' if own['optimizer'] is None else 'lacks'} optimizer state, this "
                            f"stage {'has none' if own['optimizer'] is None else 'has'}: {FIX}")
    if isinstance(optimizer, torch.optim.Optimizer):
        # `optimizer.state_dict()` numbers the parameters in group order: their sizes, by that number.
        numels = [p.numel() for g in optimizer.param_groups for p in g["params"]]
        _check_optimizer(saved["optimizer"], own["optimizer"], numels, what)
    elif saved["optimizer"] is not None:
        _check_any_optimizer(saved["optimizer"], [t.numel() for t in own["module"].values()], what)


def _check_any_optimizer(saved: Any, module_numels: list[int], what: str) -> None:
    """An optimizer we know only by `state_dict()`: bound its tensors by the module's own.

    Per-parameter state (momentum, moments) is at most parameter-sized, and no optimizer we know
    keeps more than a few copies of the parameters (Adam with amsgrad: three).
    """
    largest, total = max(module_numels, default=0), sum(module_numels)
    specs = list(_specs_in(saved))
    for spec in specs:
        if math.prod(spec.shape) > max(largest, 1):
            raise RecoveryError(f"{what}: an optimizer tensor is {describe(spec)}, bigger than any tensor of the "
                                f"module ({largest} elements): {FIX}")
    if sum(math.prod(s.shape) for s in specs) > _OPTIMIZER_COPIES * total + len(specs):
        raise RecoveryError(f"{what}: the optimizer state holds more than {_OPTIMIZER_COPIES} copies of the "
                            f"module's {total} elements: {FIX}")


def _specs_in(x: Any) -> Iterator[TensorSpec]:
    if isinstance(x, TensorSpec):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _specs_in(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _specs_in(v)


def unflatten_checked(manifest: Manifest) -> Any:
    """The manifest's state with `TensorSpec`s where its tensors go (nothing allocated)."""
    try:
        return unflatten(manifest.skeleton, list(manifest.specs))
    except RecoveryError as e:
        raise RecoveryError(f"checkpoint manifest {manifest.path}: {e}: {FIX}") from None


def check_module(saved: Any, own: Mapping[str, torch.Tensor], what: str) -> None:
    if not isinstance(saved, dict) or set(saved) != set(own):
        missing, extra = key_diff(saved, own)
        raise RecoveryError(f"{what} holds another module's state (missing {missing}, unexpected {extra}): "
                            "it belongs to a different model or stage")
    for name, tensor in own.items():
        spec = saved[name]
        if not isinstance(spec, TensorSpec) or (spec.dtype, spec.shape) != _layout(tensor):
            raise RecoveryError(f"{what}: module tensor {name!r} is {describe(spec)}, but this stage's is "
                                f"{describe(TensorSpec.of(tensor))}: it belongs to a different model or stage")


def _check_optimizer(saved: Any, own: Mapping[str, Any], numels: list[int], what: str) -> None:
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        raise RecoveryError(f"{what}: the optimizer state is not {{state, param_groups}}: {FIX}")
    groups, own_groups = saved["param_groups"], own["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(own_groups):
        raise RecoveryError(f"{what}: the optimizer has {_count(groups)} parameter groups, this stage's "
                            f"has {len(own_groups)}: it belongs to a different optimizer")
    for i, (group, own_group) in enumerate(zip(groups, own_groups, strict=True)):
        if not isinstance(group, dict) or set(group) != set(own_group):
            missing, extra = key_diff(group, own_group)
            raise RecoveryError(f"{what}: optimizer group {i} has other settings (missing {missing}, "
                                f"unexpected {extra}): it belongs to a different optimizer")
        if group["params"] != own_group["params"]:  # `state_dict()` numbers parameters 0, 1, ... in group order
            raise RecoveryError(f"{what}: optimizer group {i} lists parameters {brief(group['params'])}, this "
                                f"stage's optimizer numbers them {brief(own_group['params'])}: {FIX}")
        for key, value in group.items():
            if key != "params" and not same_kind(value, own_group[key]):
                raise RecoveryError(f"{what}: optimizer setting {key!r} of group {i} is {brief(value)}, "
                                    f"not like this optimizer's {brief(own_group[key])}: {FIX}")
    # parameter number -> its number of elements (the numbers are the same on both sides, checked above)
    sizes = dict(zip((p for g in own_groups for p in g["params"]), numels, strict=True))
    state = saved["state"]
    if not isinstance(state, dict):
        raise RecoveryError(f"{what}: the optimizer's per-parameter state is not a dict: {FIX}")
    for param, entries in state.items():
        if param not in sizes or not isinstance(entries, dict):
            raise RecoveryError(f"{what}: optimizer state for {brief(param)}, which is not one of its parameters: "
                                f"{FIX}")
        mine = own["state"].get(param, {})
        for key, spec in entries.items():
            if isinstance(spec, TensorSpec):
                check_state_tensor(spec, mine.get(key), sizes[param], f"{what}: optimizer state {key!r} of "
                                    f"parameter {param}")


def check_state_tensor(spec: TensorSpec, own: Any, numel: int, where: str) -> None:
    if isinstance(own, torch.Tensor):  # the optimizer already holds this state: it must be the same kind
        if (spec.dtype, spec.shape) != _layout(own):
            raise RecoveryError(f"{where} is {describe(spec)}, but this optimizer holds "
                                f"{describe(TensorSpec.of(own))}: {FIX}")
    elif math.prod(spec.shape) > max(numel, 1):  # a fresh optimizer: no state is bigger than its parameter
        raise RecoveryError(f"{where} is {describe(spec)}, bigger than its parameter ({numel} elements): {FIX}")


# ---- small helpers -----------------------------------------------------------------------------------


def _same_int(x: Any, want: int) -> bool:
    return is_int(x) and x == want


def same_kind(saved: Any, own: Any) -> bool:
    """A saved optimizer setting may replace this optimizer's own: numbers for numbers, else the same type."""
    if isinstance(own, (int, float)) and not isinstance(own, bool):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool)
    if isinstance(own, (list, tuple)):
        return (isinstance(saved, type(own)) and len(saved) == len(own)
                and all(same_kind(s, o) for s, o in zip(saved, own, strict=True)))
    return type(saved) is type(own)


def _layout(t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    return str(t.dtype).removeprefix("torch."), tuple(t.shape)


def key_diff(saved: Any, own: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
    keys = set(saved) if isinstance(saved, dict) else set()
    return sorted(map(str, set(own) - keys))[:3], sorted(map(str, keys - set(own)))[:3]


def _count(x: Any) -> str:
    return str(len(x)) if isinstance(x, list) else "no list of"
