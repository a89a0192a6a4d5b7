"""Checking a per-layer checkpoint (`checkpoint_layers`) before any of it is loaded.

Its manifest (format 3) names the model layers its stage held when it was written and, per layer,
that layer's state skeleton (module state, non-persistent buffers, per-parameter optimizer state:
`moves.layer_states`) and tensor specs with digests, stored in DCP as `layer{L}.{k}`; besides them
the settings every stage shares (the param group's lr, betas, ...; an LR schedule's and a loss
scaler's state), plain data without a tensor. The checks are a stage checkpoint's (`checkpoint_check`),
per layer read, in this order:

1. the manifest (`read_layer_manifest`): bounded JSON, format, iteration and stage, the model's layer
   count, distinct layer indices inside it, tensor specs of known dtypes and shapes, skeletons
   `flatten` could have written;
2. each layer to load against the reader's own layer (`check_layers`): exactly its state names,
   dtypes and shapes, one optimizer entry per trainable parameter, each state tensor no bigger than
   its parameter (or the optimizer's own, where it holds one); the settings against the reader's
   optimizer (`check_settings`): the same param-group keys and kinds, the same tied state;
3. to 5. DCP's metadata and the stored bytes of the layers read (`checkpoint_storage`).

Every failure is a `RecoveryError` naming the file; nothing is allocated before all of them passed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from reprlib import repr as brief
from typing import Any

from torch import nn

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.checkpoint_check import (
    LAYERED_FORMAT,
    MANIFEST,
    check_module,
    check_state_tensor,
    key_diff,
    manifest_json,
    parse_specs,
    same_kind,
)
from schedcomp.runtime.fault.checkpoint_storage import FIX, Stored, is_int
from schedcomp.runtime.fault.transfer import TensorSpec, unflatten
from schedcomp.runtime.moves import group_settings, trainable, transient_buffers
from schedcomp.runtime.training import attached_to

LAYER_KEYS = {"module", "buffers", "optimizer"}  # what `moves.layer_states` gives per layer


def tensor_name(layer: int, k: int) -> str:
    """The DCP name of layer `layer`'s k-th tensor (in `flatten` order)."""
    return f"layer{layer}.{k}"


@dataclass(frozen=True)
class LayerEntry:
    """One layer's part of a manifest: its state skeleton and its tensors."""

    skeleton: Any
    stored: tuple[Stored, ...]


@dataclass(frozen=True)
class LayerManifest:
    """A checked per-layer manifest: what one stage held at `iteration`, layer by layer."""

    path: Path
    iteration: int
    stage: int
    model_layers: int  # of the whole model
    layers: Mapping[int, LayerEntry]  # by model layer index
    settings: Any  # the skeleton of {"param_group": ..., "attached": ...}, without tensors

    @property
    def stored(self) -> tuple[Stored, ...]:
        return tuple(s for entry in self.layers.values() for s in entry.stored)


def read_layer_manifest(directory: Path, iteration: int, stage: int) -> LayerManifest:
    """The per-layer manifest in `directory` (a `checkpoint_dir`), checked; RecoveryError naming it otherwise."""
    data, what = manifest_json(directory, iteration, stage, LAYERED_FORMAT)
    total, entries = data.get("model_layers"), data.get("layers")
    if not (is_int(total) and total > 0):
        raise RecoveryError(f"{what} has model_layers {brief(total)}, not a layer count: {FIX}")
    if not isinstance(entries, list):
        raise RecoveryError(f"{what} has no list of layers: {FIX}")
    layers: dict[int, LayerEntry] = {}
    for entry in entries:
        index = entry.get("index") if isinstance(entry, dict) else None
        if not (isinstance(entry, dict) and set(entry) == {"index", "skeleton", "tensors"} and is_int(index)
                and 0 <= index < total and index not in layers):
            raise RecoveryError(f"{what}: layer entry {brief(entry)} is not {{index, skeleton, tensors}} of a new "
                                f"layer index below {total}: {FIX}")
        specs = parse_specs(entry, f"{what}: layer {index}")
        stored = tuple(Stored(tensor_name(index, k), spec, raw["sha256"])
                       for k, (spec, raw) in enumerate(zip(specs, entry["tensors"], strict=True)))
        layers[index] = LayerEntry(entry["skeleton"], stored)
    if "settings" not in data:
        raise RecoveryError(f"{what} has no settings: {FIX}")
    return LayerManifest(directory / MANIFEST, iteration, stage, total, layers, data["settings"])


def check_layers(manifest: LayerManifest, own: Mapping[int, nn.Module], optimizer: Any) -> None:
    """Refuse a manifest whose layers `own` (model index -> this stage's module of it) are not laid out as
    this stage's own, or whose optimizer state could not belong to `optimizer`."""
    what = f"checkpoint manifest {manifest.path}"
    for index, layer in own.items():
        where = f"{what}: layer {index}"
        saved = _unflatten(manifest.layers[index].skeleton, [s.spec for s in manifest.layers[index].stored], where)
        if not isinstance(saved, dict) or set(saved) != LAYER_KEYS:
            raise RecoveryError(f"{where} is not a layer's state {sorted(LAYER_KEYS)}: {FIX}")
        check_module(saved["module"], layer.state_dict(), where)
        check_module(saved["buffers"], transient_buffers(layer), where)
        params, states = trainable(layer), saved["optimizer"]
        if not isinstance(states, list) or len(states) != len(params):
            raise RecoveryError(f"{where} has optimizer state for {len(states) if isinstance(states, list) else 'no'} "
                                f"parameters, this layer trains {len(params)}: it belongs to a different model")
        for k, (param, entries) in enumerate(zip(params, states, strict=True)):
            if not isinstance(entries, dict):
                raise RecoveryError(f"{where}: the optimizer state of parameter {k} is not a dict: {FIX}")
            mine = optimizer.state.get(param, {})
            for key, spec in entries.items():
                if isinstance(spec, TensorSpec):
                    check_state_tensor(spec, mine.get(key), param.numel(),
                                       f"{where}: optimizer state {key!r} of parameter {k}")


def check_settings(manifest: LayerManifest, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest's param-group settings and tied state (LR schedule, loss scaler), checked against
    `optimizer`'s own: the same keys, values of the same kinds."""
    what = f"checkpoint manifest {manifest.path}"
    settings = _unflatten(manifest.settings, [], f"{what}: settings")  # no tensor: `unflatten` refuses one
    if not isinstance(settings, dict) or set(settings) != {"param_group", "attached"}:
        raise RecoveryError(f"{what}: the settings are not {{param_group, attached}}: {FIX}")
    group, attached = settings["param_group"], settings["attached"]
    own = group_settings(optimizer)
    if not isinstance(group, dict) or set(group) != set(own):
        missing, extra = key_diff(group, own)
        raise RecoveryError(f"{what}: the optimizer's settings differ (missing {missing}, unexpected {extra}): it "
                            "belongs to a different optimizer")
    for key, value in group.items():
        if not same_kind(value, own[key]):
            raise RecoveryError(f"{what}: optimizer setting {key!r} is {brief(value)}, not like this optimizer's "
                                f"{brief(own[key])}: {FIX}")
    tied = attached_to(optimizer)
    if not isinstance(attached, dict) or set(attached) != set(tied) or not all(
            isinstance(v, dict) for v in attached.values()):
        missing, extra = key_diff(attached, tied)
        raise RecoveryError(f"{what} holds other training state than this stage (missing {missing}, unexpected "
                            f"{extra}): pass the same lr_scheduler and autocast options as the run that wrote it")
    return group, attached


def _unflatten(skeleton: Any, specs: list[Any], what: str) -> Any:
    try:
        return unflatten(skeleton, specs)
    except RecoveryError as e:
        raise RecoveryError(f"{what}: {e}: {FIX}") from None
