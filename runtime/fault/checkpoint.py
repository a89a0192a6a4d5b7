"""The last resort: periodic asynchronous checkpoints per stage, restored without trusting pickles.

Layout: `DIR/iter{N:08d}/stage{S}/` holds one stage's state after the optimizer step of iteration
N, written by `torch.distributed.checkpoint.async_save` (the call copies the state and returns;
the files are written in the background while training goes on), plus `manifest.json`, written
last and atomically once the files are complete: a stage's checkpoint exists iff its manifest
does. Iteration N is restorable when every stage has it (`latest_complete`). A stage cut from an
`nn.Sequential` model saves each layer's state under its model index instead (`checkpoint_layers`):
then iteration N is restorable when its stages together hold every layer, under whatever cuts they
were written, and a stage of any cut restores exactly its own layers from them.

One replica per stage writes (`policy`-free rule: the lowest live pipeline of the stage, see
`checkpoint_writer`); stages never wait for each other, as with the staggered optimizer.

Restoring trusts no pickle: the tensors are loaded with DCP's `weights_only` reader, the
structure around them comes from our JSON manifest (`transfer.flatten`), and DCP's own
`.metadata` (a pickle) is read by an unpickler that only builds DCP's metadata classes, torch
sizes and dtypes (`dcp_io.SafeReader`); anything else in it is refused. The manifest records a SHA-256
of each tensor's stored bytes, and everything (manifest, layout against the stage's own state,
metadata, digests) is checked before a tensor is allocated (`checkpoint_check`): a damaged or
crafted checkpoint is one RecoveryError naming its file.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcomp.errors import RecoveryError
from schedcomp.fileio import dumps_json, write_atomic
from schedcomp.partition import Partition
from schedcomp.runtime.fault.checkpoint_check import (
    CHECKPOINT_FORMAT,
    MANIFEST,
    Manifest,
    check_against_stage,
    read_manifest,
)
from schedcomp.runtime.fault.checkpoint_layers import covers, holds_layers, layered_save, layers_dir, restore_layers
from schedcomp.runtime.fault.checkpoint_storage import check_digests, check_metadata_matches, stored_digests
from schedcomp.runtime.fault.state_load import load_all_or_nothing
from schedcomp.runtime.fault.transfer import TensorSpec, flatten, load_stage_state, stage_state, unflatten
from schedcomp.topology import Topology, Worker

if TYPE_CHECKING:
    from schedcomp.runtime.fault.dcp_io import SafeReader

log = logging.getLogger(__name__)

_ITER_RE = re.compile(r"iter(\d{8})")



def checkpoint_dir(directory: str | Path, iteration: int, stage: int) -> Path:
    return Path(directory) / f"iter{iteration:08d}" / f"stage{stage}"


def checkpoint_writer(topology: Topology, stage: int) -> Worker | None:
    """The replica that writes stage `stage`'s checkpoints: its lowest live pipeline (None if none is left)."""
    group = topology.stage_group(stage)
    return group[0] if group else None


class AsyncCheckpointer:
    """Checkpoints one stage every `every` iterations, in the background; at most one save in flight."""

    def __init__(self, directory: str | Path, stage: int, every: int) -> None:
        if every < 1:
            raise RecoveryError(f"checkpoint interval must be at least 1 iteration, got {every}")
        self.directory, self.stage, self.every = Path(directory), stage, every
        self._pending: Future | None = None

    def after_step(self, iteration: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                   writer: bool = True, cut: Partition | None = None) -> bool:
        """Call after STEP of `iteration`: saves when it is due and this worker writes; True if it did."""
        if not writer or (iteration + 1) % self.every:
            return False
        self.save(iteration, module, optimizer, cut)
        return True

    def save(self, iteration: int, module: nn.Module, optimizer: torch.optim.Optimizer,
             cut: Partition | None = None) -> Future:
        """Start saving; the state is copied before this returns, so training may go on at once.

        `cut`: the partition of an `nn.Sequential` model the stage is cut from: then each layer's state is
        saved under its model index (`checkpoint_layers`), else the stage's state as one. A complete
        checkpoint of (`iteration`, stage) is never rewritten: the call does nothing.
        """
        self.wait()  # one save at a time: the next one would overtake a slow disk otherwise
        path = checkpoint_dir(self.directory, iteration, self.stage)
        if (path / MANIFEST).is_file() and cut is not None and not holds_layers(path, iteration, self.stage, cut):
            # Re-run under another cut (a re-formed plan): the stage's checkpoint lacks some of this writer's
            # layers, and no other writer of the new cut may hold them. Beside it, named by the span.
            path = layers_dir(path, cut, self.stage)
        if (path / MANIFEST).is_file():
            # Iteration re-run after a rollback (or after a restart): the complete checkpoint there holds
            # the same state (see `restart`), and rewriting it in place could tear it.
            done: Future = Future()
            done.set_result(iteration)
            return done
        if cut is not None:
            named, manifest, digests = layered_save(module, optimizer, cut, iteration, self.stage)
        else:
            skeleton, tensors = flatten(stage_state(module, optimizer))
            named = {f"t{i}": t for i, t in enumerate(tensors)}
            manifest = {"format": CHECKPOINT_FORMAT, "iteration": iteration, "stage": self.stage,
                        "skeleton": skeleton, "tensors": [TensorSpec.of(t).__dict__ for t in tensors]}
            digests = list(zip(named, manifest["tensors"], strict=True))
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecoveryError(f"cannot create checkpoint directory {path}: {e.strerror or e}") from None
        from schedcomp.runtime.fault import dcp_io  # DCP on first use: see `dcp_io`

        future = dcp_io.save_async(named, path)
        committed: Future = Future()  # done once the manifest is written, not just the files
        future.add_done_callback(lambda f: _commit(f, path, manifest, digests, committed))
        self._pending = committed
        return committed

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; raises if it failed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def _commit(saved: Future, path: Path, manifest: dict[str, Any], digests: list[tuple[str, dict[str, Any]]],
            committed: Future) -> None:
    from schedcomp.runtime.fault import dcp_io

    try:
        dcp_io.saved(saved, path)
        found = stored_digests(dcp_io.SafeReader(path).read_metadata(), path)
        for name, spec in digests:  # each tensor's spec in the manifest, by its DCP name
            spec["sha256"] = found[name]
        # the manifest appears whole or not at all, and a full disk leaves no half-written one behind
        write_atomic(path / MANIFEST, dumps_json(manifest), RecoveryError)
    except Exception as e:
        log.error("checkpoint %s failed: %s", path, e)
        committed.set_exception(e)
    else:
        committed.set_result(manifest["iteration"])


def latest_complete(directory: str | Path, pp: int, layers: int | None = None) -> int | None:
    """The newest iteration every one of the `pp` stages has a complete checkpoint of (None: none); with
    `layers`, the model's layer count, the newest whose stage checkpoints hold every layer, whichever cut
    wrote them (`checkpoint_layers.covers`)."""
    root = Path(directory)
    if not root.is_dir():
        return None
    try:
        names = [p.name for p in root.iterdir()]
    except OSError as e:
        raise RecoveryError(f"cannot list checkpoint directory {root}: {e.strerror or e}") from None
    done = sorted((int(m.group(1)) for name in names if (m := _ITER_RE.fullmatch(name))), reverse=True)
    for iteration in done:
        if layers is not None:
            if covers(checkpoint_dir(root, iteration, 0).parent, iteration, layers):
                return iteration
        elif all((checkpoint_dir(root, iteration, s) / MANIFEST).is_file() for s in range(pp)):
            return iteration
    return None


def complete_iterations(directory: str | Path, stage: int) -> list[int]:
    """The iterations stage `stage` has a complete checkpoint of, oldest first (logging-based recovery)."""
    root = Path(directory)
    try:
        names = [p.name for p in root.iterdir()] if root.is_dir() else []
    except OSError:  # a directory being written or removed: nothing known to be complete
        return []
    done = (int(m.group(1)) for name in names if (m := _ITER_RE.fullmatch(name)))
    return sorted(i for i in done if (checkpoint_dir(root, i, stage) / MANIFEST).is_file())


def restore(directory: str | Path, iteration: int, stage: int, module: nn.Module,
            optimizer: torch.optim.Optimizer, cut: Partition | None = None) -> None:
    """Load stage `stage`'s checkpoint of `iteration` into `module` and `optimizer` (nothing unpickled);
    with `cut` (an `nn.Sequential` model's), the layers `cut` gives stage `stage`, from whichever stage
    checkpoints of `iteration` hold them (`checkpoint_layers.restore_layers`).

    Everything is checked before anything is allocated or loaded (see `checkpoint_check`), and the
    tensors are read into fresh buffers before the stage's own state is touched: a damaged or
    crafted checkpoint is a RecoveryError naming the file, and leaves the stage as it was.
    """
    path = checkpoint_dir(directory, iteration, stage)
    if cut is not None:
        restore_layers(path.parent, iteration, cut, stage, module, optimizer)
        return
    manifest, reader = checked_checkpoint(path, iteration, stage, module, optimizer)
    specs = manifest.specs
    target = {f"t{i}": torch.empty(s.shape, dtype=s.torch_dtype) for i, s in enumerate(specs)}
    from schedcomp.runtime.fault import dcp_io

    dcp_io.load(target, reader, path)
    tensors = [target[f"t{i}"] for i in range(len(specs))]
    on_device = [t.to(torch.device("cuda", torch.cuda.current_device())) if s.device == "cuda" else t
                 for t, s in zip(tensors, specs, strict=True)]
    _load_into_stage(module, optimizer, manifest, on_device)


def checked_checkpoint(path: Path, iteration: int, stage: int, module: nn.Module,
                       optimizer: torch.optim.Optimizer | None) -> tuple[Manifest, SafeReader]:
    """The checkpoint in `path`, checked against itself and against this stage, before any allocation."""
    if not path.is_dir():
        raise RecoveryError(f"checkpoint {path} does not exist: pick another iteration (see latest_complete)")
    manifest = read_manifest(path, iteration, stage)
    check_against_stage(manifest, module, optimizer)
    from schedcomp.runtime.fault.dcp_io import SafeReader

    reader = SafeReader(path)
    metadata = reader.read_metadata()
    check_metadata_matches(metadata, manifest.stored, str(reader.metadata_path))
    check_digests(metadata, manifest.stored, path)
    return manifest, reader


def _load_into_stage(module: nn.Module, optimizer: torch.optim.Optimizer, manifest: Manifest,
                     tensors: list[torch.Tensor]) -> None:

    state = unflatten(manifest.skeleton, tensors)  # the skeleton was checked with the specs already
    load_all_or_nothing(module, optimizer, lambda: load_stage_state(module, optimizer, state), manifest.path)


def iterations_lost(checkpointed: int | None, reached: int) -> int:
    """Iterations to redo after restarting from `checkpointed` when the job had completed `reached`."""
    return reached - (checkpointed if checkpointed is not None else -1)
