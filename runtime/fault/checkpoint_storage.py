"""A checkpoint's DCP metadata and stored bytes, checked before torch reads any of it.

Steps 3 to 5 of a restore's checks (`checkpoint_check` has the whole list): DCP's `.metadata` names
only whole tensors in files inside the checkpoint's own directory (`check_storage`, run by
`dcp_io.SafeReader` on every read of it); it holds exactly the manifest's tensors
(`check_metadata_matches`); and their stored bytes have the SHA-256 the manifest recorded once DCP
had written them (`stored_digests`, `check_digests`). Every failure is a `RecoveryError` naming the file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from reprlib import repr as brief  # a value in an error message, cut short
from typing import TYPE_CHECKING, Any

import torch

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.transfer import TensorSpec

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

FIX = "pick another iteration (see latest_complete) or delete this checkpoint"
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class Stored:
    """One tensor as DCP stores it: its name there, what it is, and the SHA-256 of its stored bytes."""

    name: str
    spec: TensorSpec
    digest: str



def check_storage(metadata: Metadata, directory: str | os.PathLike[str], source: str) -> None:
    """Refuse metadata naming data outside `directory`, missing files or byte ranges, or odd chunks."""
    root = Path(directory).resolve()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # DCP on first use: see `dcp_io`

    what = f"checkpoint metadata {source}"
    # A pickle may BUILD an allowed class with any attributes: nothing is assumed present or typed.
    tensors, storage = (getattr(metadata, k, None) for k in ("state_dict_metadata", "storage_data"))
    if not isinstance(tensors, dict) or not isinstance(storage, dict):
        raise RecoveryError(f"{what} has no tensor or storage table: {FIX}")
    for fqn, md in tensors.items():
        if not isinstance(fqn, str) or not isinstance(md, TensorStorageMetadata):
            raise RecoveryError(f"{what}: entry {brief(fqn)} is not a tensor: it was not written by schedcomp")
        _check_chunks(fqn, md, storage, what)
    sizes: dict[Path, int] = {}
    for index, info in storage.items():
        _check_storage_item(index, info, root, sizes, what)


def _check_chunks(fqn: str, md: TensorStorageMetadata, storage: dict[Any, Any], what: str) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    size, chunks = getattr(md, "size", None), getattr(md, "chunks", None)
    chunk = chunks[0] if isinstance(chunks, list) and len(chunks) == 1 else None
    offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
    whole = (isinstance(size, torch.Size) and isinstance(chunk, ChunkStorageMetadata)
             and isinstance(offsets, torch.Size) and isinstance(sizes, torch.Size)
             and sizes == size and list(offsets) == [0] * len(size)
             and isinstance(getattr(getattr(md, "properties", None), "dtype", None), torch.dtype))
    if not whole:  # one process wrote the stage: each tensor is one whole chunk
        raise RecoveryError(f"{what}: tensor {fqn!r} is not stored as one whole chunk of a known dtype: "
                            "it was not written by schedcomp")
    if MetadataIndex(fqn, offsets) not in storage:
        raise RecoveryError(f"{what}: tensor {fqn!r} has no storage entry: {FIX}")


def _check_storage_item(index: Any, info: Any, root: Path, sizes: dict[Path, int], what: str) -> None:
    rel, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
    name = getattr(index, "fqn", index)
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts or "\0" in rel:
        raise RecoveryError(f"{what}: tensor {brief(name)} is stored at {brief(rel)}, outside the checkpoint's "
                            "directory: refusing to read it")
    path = (root / rel).resolve()
    if not path.is_relative_to(root):  # a symlink out of the directory
        raise RecoveryError(f"{what}: tensor {brief(name)} is stored at {rel!r}, which leads outside the "
                            "checkpoint's directory: refusing to read it")
    if getattr(info, "transform_descriptors", None):
        raise RecoveryError(f"{what}: tensor {brief(name)} is stored through transforms "
                            f"{brief(info.transform_descriptors)}: schedcomp never writes those")
    if path not in sizes:
        if not path.is_file():
            raise RecoveryError(f"{what}: data file {path} of tensor {brief(name)} is missing: {FIX}")
        sizes[path] = path.stat().st_size
    if not (is_int(offset) and is_int(length) and offset >= 0 and length >= 0 and offset + length <= sizes[path]):
        raise RecoveryError(f"{what}: tensor {brief(name)} is stored at bytes {brief(offset)}+{brief(length)} of "
                            f"{path}, which holds {sizes[path]}: {FIX}")


def check_metadata_matches(metadata: Metadata, stored: Sequence[Stored], source: str) -> None:
    """The metadata holds exactly the tensors `stored` (a manifest's), each stored in at least the bytes it needs."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    what = f"checkpoint metadata {source}"
    if set(metadata.state_dict_metadata) != {s.name for s in stored}:
        raise RecoveryError(f"{what} does not hold exactly the tensors its manifest lists: "
                            f"it was not written by schedcomp, or is damaged; {FIX}")
    for name, spec in ((s.name, s.spec) for s in stored):
        md = metadata.state_dict_metadata[name]
        if tuple(md.size) != spec.shape or md.properties.dtype != spec.torch_dtype:
            raise RecoveryError(f"{what}: tensor {name} is {md.properties.dtype} {list(md.size)}, its manifest "
                                f"says {describe(spec)}: {FIX}")
        stored_bytes = metadata.storage_data[MetadataIndex(name, md.chunks[0].offsets)].length
        if stored_bytes < spec.nbytes:
            raise RecoveryError(f"{what}: tensor {name} needs {spec.nbytes} bytes but only {stored_bytes} are "
                                f"stored: {FIX}")


def stored_digests(metadata: Metadata, directory: str | os.PathLike[str],
                   names: Collection[str] | None = None) -> dict[str, str]:
    """SHA-256 of the bytes each tensor (of `names`, default all) is stored in (metadata already
    `check_storage`d), by tensor name.

    Written into the manifest once DCP has saved, and compared before restoring: a data file whose
    bytes changed, or metadata that sends a tensor to another tensor's bytes, is refused.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex

    root = Path(directory).resolve()
    digests = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if names is not None and fqn not in names:
            continue
        info = metadata.storage_data[MetadataIndex(fqn, md.chunks[0].offsets)]
        digest = hashlib.sha256()
        with open(root / info.relative_path, "rb") as f:
            f.seek(info.offset)
            left = info.length
            while left > 0:
                chunk = f.read(min(left, _HASH_CHUNK))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
        digests[fqn] = digest.hexdigest()
    return digests


def check_digests(metadata: Metadata, stored: Sequence[Stored], directory: str | os.PathLike[str]) -> None:
    """Each tensor of `stored` (those about to be read) has the digest its manifest recorded."""
    try:
        found = stored_digests(metadata, directory, {s.name for s in stored})
    except OSError as e:
        raise RecoveryError(f"cannot read checkpoint data in {directory}: {e.strerror or e}") from None
    for s in stored:
        if found[s.name] != s.digest:
            raise RecoveryError(f"checkpoint {directory}: the stored bytes of tensor {s.name} do not match the "
                                f"digest in its manifest: the data was changed or damaged; {FIX}")


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def describe(x: Any) -> str:
    return f"{x.dtype} {list(x.shape)}" if isinstance(x, TensorSpec) else f"not a tensor ({brief(x)})"
