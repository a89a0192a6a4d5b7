"""Everything of `torch.distributed.checkpoint` (DCP) the checkpoints use, in one module imported on
first use: importing DCP pulls in DTensor and sympy (about 1.3 s of CPU), which every worker process,
and every replacement joining a job, would otherwise pay at start-up whether it checkpoints or not.

- `save_async` / `saved`: DCP's background save of a stage's flat tensors, and its outcome.
- `SafeReader` / `load`: reading them back without trusting a pickle: DCP's own `.metadata` (a
  pickle) is read by an unpickler that only builds DCP's metadata classes, torch sizes and dtypes;
  anything else in it is refused, and the metadata is checked (`checkpoint_storage.check_storage`)
  before DCP sees it.
"""

from __future__ import annotations

import io
import pickle
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from schedcomp.errors import RecoveryError, SchedcompError
from schedcomp.fileio import read_bytes
from schedcomp.runtime.fault.checkpoint_storage import check_storage

# Per-stage checkpoints are single-process saves by design (`no_dist`); DCP warns about that from
# its writer threads too, where a `catch_warnings` block cannot reach.
warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*", category=UserWarning)


def save_async(tensors: dict[str, torch.Tensor], path: Path) -> Future:
    """Start writing `tensors` (by name) under `path`; the returned future completes when they are on disk."""
    return dcp.async_save(tensors, storage_writer=FileSystemWriter(path), no_dist=True)


def saved(future: Future, path: Path) -> None:
    """Wait for `save_async`'s future; RecoveryError if the save failed."""
    try:
        future.result()
    except CheckpointException as e:  # a BaseException: uncaught, it would leave a caller's future pending forever
        raise RecoveryError(f"checkpoint {path} could not be written ({first_line(e)})") from None


def load(target: dict[str, torch.Tensor], reader: SafeReader, path: Path) -> None:
    """Fill `target` (tensors by name, allocated by the caller) from the checked checkpoint `reader` reads."""
    try:
        dcp.load(target, storage_reader=reader, no_dist=True)
    except SchedcompError:
        raise
    except (Exception, CheckpointException) as e:  # a damaged data file: DCP wraps torch.load's complaint
        raise RecoveryError(f"checkpoint {path}: cannot read its tensors ({first_line(e)}): "
                            "pick another iteration (see latest_complete)") from None


def first_line(e: BaseException) -> str:
    """One line saying what went wrong: for DCP's exception, the first failure it wraps."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


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
    """DCP's file reader, except that its metadata pickle is read with an allow-list, and checked.

    The metadata is read and checked once (`checkpoint_storage.check_storage`: every data file inside
    the checkpoint's directory, every byte range present) and the same checked object is handed to
    DCP every time it asks, so the file cannot change between the check and the load.
    """

    _checked: Metadata | None = None

    @property
    def metadata_path(self) -> Path:
        return Path(self._get_metadata_path(None))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise RecoveryError("schedcomp checkpoints are written by one process: per-rank metadata is not used")
        if self._checked is None:
            self._checked = self._read_checked()
        self._checked.storage_meta.load_id = self.load_id
        return self._checked

    def _read_checked(self) -> Metadata:
        path = self.metadata_path
        data = read_bytes(path, "checkpoint metadata", RecoveryError)
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except Exception as e:  # anything a crafted pickle makes the allowed classes raise
            raise RecoveryError(f"checkpoint metadata {path} is not plain DCP metadata ({first_line(e)}): "
                                "refusing to load it") from None
        if not isinstance(metadata, Metadata):
            raise RecoveryError(f"checkpoint metadata {path} is a {type(metadata).__name__}, not DCP metadata")
        check_storage(metadata, self.path, str(path))
        if not isinstance(getattr(metadata, "storage_meta", None), StorageMeta):
            metadata.storage_meta = StorageMeta()
        return metadata
