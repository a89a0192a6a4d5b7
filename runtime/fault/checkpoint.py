"""The last resort: periodic asynchronous checkpoints per stage, restored without trusting pickles.

Layout: `DIR/iter{N:08d}/stage{S}/` holds one stage's state after the optimizer step of iteration
N, written by `torch.distributed.checkpoint.async_save` (the call copies the state and returns;
the files are written in the background while training goes on), plus `manifest.json`, written
last and atomically once the files are complete: a stage's checkpoint exists iff its manifest
does. Iteration N is restorable when every stage has it (`latest_complete`).

One replica per stage writes (`policy`-free rule: the lowest live pipeline of the stage, see
`checkpoint_writer`); stages never wait for each other, as with the staggered optimizer.

Restoring trusts no pickle: the tensors are loaded with DCP's `weights_only` reader, the
structure around them comes from our JSON manifest (`transfer.flatten`), and DCP's own
`.metadata` (a pickle) is read by an unpickler that only builds DCP's metadata classes, torch
sizes and dtypes (`SafeReader`); anything else in it is refused.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.transfer import TensorSpec, flatten, load_stage_state, stage_state, unflatten
from schedcomp.topology import Topology, Worker

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CHECKPOINT_FORMAT = 1
_ITER_RE = re.compile(r"iter(\d{8})")

# Per-stage checkpoints are single-process saves by design (`no_dist`); DCP warns about that from
# its writer threads too, where a `catch_warnings` block cannot reach.
warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*", category=UserWarning)


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
                   writer: bool = True) -> bool:
        """Call after STEP of `iteration`: saves when it is due and this worker writes; True if it did."""
        if not writer or (iteration + 1) % self.every:
            return False
        self.save(iteration, module, optimizer)
        return True

    def save(self, iteration: int, module: nn.Module, optimizer: torch.optim.Optimizer) -> Future:
        """Start saving; the state is copied before this returns, so training may go on at once.

        A complete checkpoint of (`iteration`, stage) is never rewritten: the call does nothing.
        """
        self.wait()  # one save at a time: the next one would overtake a slow disk otherwise
        path = checkpoint_dir(self.directory, iteration, self.stage)
        if (path / MANIFEST).is_file():
            # Iteration re-run after a rollback (or after a restart): the complete checkpoint there holds
            # the same state (see `restart`), and rewriting it in place could tear it.
            done: Future = Future()
            done.set_result(iteration)
            return done
        skeleton, tensors = flatten(stage_state(module, optimizer))
        path.mkdir(parents=True, exist_ok=True)
        manifest = {"format": CHECKPOINT_FORMAT, "iteration": iteration, "stage": self.stage, "skeleton": skeleton,
                    "tensors": [TensorSpec.of(t).__dict__ for t in tensors]}
        future = dcp.async_save({f"t{i}": t for i, t in enumerate(tensors)},
                                storage_writer=FileSystemWriter(path), no_dist=True)
        committed: Future = Future()  # done once the manifest is written, not just the files
        future.add_done_callback(lambda f: _commit(f, path, manifest, committed))
        self._pending = committed
        return committed

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; raises if it failed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def _commit(saved: Future, path: Path, manifest: dict[str, Any], committed: Future) -> None:
    try:
        saved.result()
        tmp = path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, path / MANIFEST)  # the manifest appears whole or not at all
    except Exception as e:
        log.error("checkpoint %s failed: %s", path, e)
        committed.set_exception(e)
    else:
        committed.set_result(manifest["iteration"])


def latest_complete(directory: str | Path, pp: int) -> int | None:
    """The newest iteration every one of the `pp` stages has a complete checkpoint of (None: none)."""
    root = Path(directory)
    if not root.is_dir():
        return None
    done = sorted((int(m.group(1)) for p in root.iterdir() if (m := _ITER_RE.fullmatch(p.name))), reverse=True)
    for iteration in done:
        if all((checkpoint_dir(root, iteration, s) / MANIFEST).is_file() for s in range(pp)):
            return iteration
    return None


def restore(directory: str | Path, iteration: int, stage: int, module: nn.Module,
            optimizer: torch.optim.Optimizer) -> None:
    """Load stage `stage`'s checkpoint of `iteration` into `module` and `optimizer` (nothing unpickled)."""
    path = checkpoint_dir(directory, iteration, stage)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("format") != CHECKPOINT_FORMAT or manifest["stage"] != stage:
            raise ValueError("format or stage mismatch")
        specs = [TensorSpec(s["dtype"], tuple(int(n) for n in s["shape"]), s["device"]) for s in manifest["tensors"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RecoveryError(f"checkpoint {path} has no readable manifest ({e}): pick another iteration "
                            "(see latest_complete)") from None
    target = {f"t{i}": torch.empty(s.shape, dtype=s.torch_dtype) for i, s in enumerate(specs)}
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    kinds = {k: type(v) for k, v in metadata.state_dict_metadata.items()}
    if kinds != dict.fromkeys(target, TensorStorageMetadata):
        raise RecoveryError(f"checkpoint {path} does not hold exactly the tensors its manifest lists: "
                            "it was not written by schedcomp, or is damaged")
    dcp.load(target, storage_reader=reader, no_dist=True)
    tensors = [target[f"t{i}"] for i in range(len(specs))]
    on_device = [t.to(torch.device("cuda", torch.cuda.current_device())) if s.device == "cuda" else t
                 for t, s in zip(tensors, specs, strict=True)]
    load_stage_state(module, optimizer, unflatten(manifest["skeleton"], on_device))


def iterations_lost(checkpointed: int | None, reached: int) -> int:
    """Iterations to redo after restarting from `checkpointed` when the job had completed `reached`."""
    return reached - (checkpointed if checkpointed is not None else -1)


# ---- reading DCP's pickled metadata safely ------------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    _DCP_METADATA: {"Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
                    "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # maps a layout's name to the layout
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata objects, `torch.Size` and dtypes: a pickle asking for anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader, except that its metadata pickle is read with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise RecoveryError(f"checkpoint metadata {path} is not plain DCP metadata ({e}): "
                                "refusing to load it") from None
        if not isinstance(metadata, Metadata):
            raise RecoveryError(f"checkpoint metadata {path} is a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
