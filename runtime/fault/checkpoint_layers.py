"""Per-layer checkpoints: written under any cut of an `nn.Sequential` model, restored into any other.

A stage of an `nn.Sequential` model checkpoints each layer it holds (global layer index L): the
layer's parameters and buffers, non-persistent ones too, and its trainable parameters' optimizer
state (`moves.layer_states`, the same state a layer move carries), stored in DCP as `layer{L}.{k}`;
plus the settings every stage shares (the param group's lr and betas, an LR schedule's and a loss
scaler's state). Its manifest says which layers it holds and of how many (`layered_save`).

Iteration N is restorable when the stage directories of N together hold every layer of the model
(`holders`, `covers`), whichever cuts they were written under. A worker building cut C restores, per
stage, exactly the layers C gives it, each from the lowest stage directory of N holding it
(`restore_layers`): after a re-run of N under another cut two directories may hold a layer, both its
state after step N (see `restart`). Everything is checked before a tensor is allocated
(`checkpoint_layers_check`, `checkpoint_storage`), and only the layers read are hashed and loaded.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from schedcomp.errors import RecoveryError
from schedcomp.partition import Partition, spans
from schedcomp.runtime.fault.checkpoint_check import LAYERED_FORMAT, MANIFEST
from schedcomp.runtime.fault.checkpoint_layers_check import (
    LayerManifest,
    check_layers,
    check_settings,
    read_layer_manifest,
    tensor_name,
)
from schedcomp.runtime.fault.checkpoint_storage import FIX, check_digests, check_metadata_matches
from schedcomp.runtime.fault.state_load import load_all_or_nothing
from schedcomp.runtime.fault.transfer import TensorSpec, flatten, unflatten
from schedcomp.runtime.moves import group_settings, layer_states, load_layer_optimizer, load_layer_state, tied_states

_STAGE_RE = re.compile(r"stage(\d+)(?:\.layers(\d+)-(\d+))?")
"""A stage's checkpoint directory, or one written beside it by a re-run under another cut (`layers_dir`)."""


def layers_dir(path: Path, cut: Partition, stage: int) -> Path:
    """Where (virtual) stage `stage` of `cut` writes when its own directory (`path`) holds a checkpoint of the
    same iteration under another cut that lacks some of its layers: beside it, named by its span of layers."""
    held = spans(cut)[stage]
    return path.with_name(f"{path.name}.layers{held.start}-{held.stop - 1}")


def holds_layers(path: Path, iteration: int, stage: int, cut: Partition) -> bool:
    """Whether the complete per-layer checkpoint in `path` holds every layer stage `stage` of `cut` holds (a
    checkpoint of the whole stage, written without a cut, holds none by index: False)."""
    try:
        manifest = read_layer_manifest(path, iteration, stage)
    except RecoveryError:
        return False  # not a per-layer one (or damaged): the writer's own layers go beside it
    return all(index in manifest.layers for index in spans(cut)[stage])


def layered_save(module: nn.Module, optimizer: Any, cut: Partition, iteration: int, stage: int
                 ) -> tuple[dict[str, Tensor], dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    """What (virtual) stage `stage` of `cut` saves after `iteration`: its tensors by DCP name, its manifest
    (digests still missing) and, by DCP name, the manifest entry each tensor's digest goes into."""
    held = spans(cut)[stage]
    states = layer_states(module, optimizer, held.start)
    settings, loose = flatten({"param_group": group_settings(optimizer), "attached": tied_states(optimizer)})
    if loose:
        raise RecoveryError("the optimizer's settings or the state tied to it (LR schedule, loss scaler) hold a "
                            "tensor: per-layer checkpoints keep plain numbers there")
    named: dict[str, Tensor] = {}
    digests: list[tuple[str, dict[str, Any]]] = []
    entries = []
    for index in held:
        skeleton, tensors = flatten(states[index])
        specs = [TensorSpec.of(t).__dict__ for t in tensors]
        for k, (tensor, spec) in enumerate(zip(tensors, specs, strict=True)):
            named[tensor_name(index, k)] = tensor
            digests.append((tensor_name(index, k), spec))
        entries.append({"index": index, "skeleton": skeleton, "tensors": specs})
    manifest = {"format": LAYERED_FORMAT, "iteration": iteration, "stage": stage, "model_layers": sum(cut),
                "layers": entries, "settings": settings}
    return named, manifest, digests


def holders(iteration_dir: Path, iteration: int, model_layers: int) -> dict[int, LayerManifest]:
    """Each layer of iteration `iteration`'s complete stage checkpoints (in `iteration_dir`), with the
    manifest of the lowest stage holding it; RecoveryError for a manifest of another model or damaged."""
    try:
        names = [p.name for p in iteration_dir.iterdir()] if iteration_dir.is_dir() else []
    except OSError as e:
        raise RecoveryError(f"cannot list checkpoint directory {iteration_dir}: {e.strerror or e}") from None
    # A stage's own directory, then those written beside it, lowest span first (one order on every worker).
    stages = sorted((int(m.group(1)), int(m.group(2) or -1), name) for name in names
                    if (m := _STAGE_RE.fullmatch(name)))
    found: dict[int, LayerManifest] = {}
    for stage, _, name in stages:
        directory = iteration_dir / name
        if not (directory / MANIFEST).is_file():
            continue  # being written, or its writer died first
        manifest = read_layer_manifest(directory, iteration, stage)
        if manifest.model_layers != model_layers:
            raise RecoveryError(f"checkpoint manifest {manifest.path} holds layers of a {manifest.model_layers}-layer "
                                f"model, this one has {model_layers}: it belongs to another model; {FIX}")
        for index in manifest.layers:
            found.setdefault(index, manifest)
    return found


def covers(iteration_dir: Path, iteration: int, model_layers: int) -> bool:
    """Whether iteration `iteration`'s complete stage checkpoints hold every layer of the model."""
    return len(holders(iteration_dir, iteration, model_layers)) == model_layers


def restore_layers(iteration_dir: Path, iteration: int, cut: Partition, stage: int, module: nn.Module,
                   optimizer: Any) -> None:
    """Load the layers (virtual) stage `stage` of `cut` holds into `module` (its `nn.Sequential`) and
    `optimizer`, from iteration `iteration`'s stage checkpoints, whichever cut wrote them."""
    from schedcomp.runtime.fault import dcp_io  # DCP on first use: see `dcp_io`

    held = spans(cut)[stage]
    if not isinstance(module, nn.Sequential) or len(module) != len(held):
        raise RecoveryError(f"stage {stage} of cut {list(cut)} holds {len(held)} layers, but its module is not an "
                            "nn.Sequential of them: restore per-layer checkpoints into stages cut from the model")
    found = holders(iteration_dir, iteration, sum(cut))
    missing = [index for index in held if index not in found]
    if missing:
        raise RecoveryError(f"checkpoint {iteration_dir} holds no complete state of layers {missing}: pick another "
                            "iteration (see latest_complete)")
    sources: dict[Path, tuple[LayerManifest, list[int]]] = {}
    for index in held:
        sources.setdefault(found[index].path, (found[index], []))[1].append(index)
    readers = []
    for manifest, indices in sources.values():  # every check, before anything is allocated
        check_layers(manifest, {index: module[index - held.start] for index in indices}, optimizer)
        reader = dcp_io.SafeReader(manifest.path.parent)
        metadata = reader.read_metadata()
        check_metadata_matches(metadata, manifest.stored, str(reader.metadata_path))
        check_digests(metadata, [s for index in indices for s in manifest.layers[index].stored], manifest.path.parent)
        readers.append(reader)
    first = found[held.start] if len(held) else next(iter(found.values()))
    group, attached = check_settings(first, optimizer)
    states = {}
    for (manifest, indices), reader in zip(sources.values(), readers, strict=True):
        wanted = [s for index in indices for s in manifest.layers[index].stored]
        target = {s.name: torch.empty(s.spec.shape, dtype=s.spec.torch_dtype) for s in wanted}
        dcp_io.load(target, reader, manifest.path.parent)
        for index in indices:
            entry = manifest.layers[index]
            states[index] = unflatten(entry.skeleton, [_placed(target[s.name], s.spec) for s in entry.stored])
    _load(module, optimizer, [states[index] for index in held], group, attached, first.path)


def _placed(tensor: Tensor, spec: TensorSpec) -> Tensor:
    return tensor.to(torch.device("cuda", torch.cuda.current_device())) if spec.device == "cuda" else tensor


def _load(module: nn.Sequential, optimizer: Any, states: list[Any], group: dict[str, Any],
          attached: dict[str, Any], path: Path) -> None:
    def load() -> None:
        for layer, state in zip(module, states, strict=True):
            load_layer_state(layer, state)
        load_layer_optimizer(optimizer, list(module), states, group, attached)

    load_all_or_nothing(module, optimizer, load, path)
