"""Crafting damaged checkpoints for the hostile-input tests and the fuzz suite.

`Witness` records, through a Python audit hook, every file opened and every tensor the restore
allocates, so a test can assert that nothing outside the checkpoint's directory was read and that
nothing bigger than the stage itself was allocated.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_procs import demo_stage, state_digest, train_demo

from schedcomp.runtime.fault.checkpoint import MANIFEST, AsyncCheckpointer, checkpoint_dir
from schedcomp.runtime.fault.dcp_io import SafeReader

ITERATION, STAGE = 3, 0


def write_checkpoint(root: Path) -> tuple[Path, str]:
    """A genuine checkpoint of a trained demo stage under `root`; returns its directory and state digest."""
    module, optimizer = demo_stage(seed=0)
    train_demo(module, optimizer, steps=2)
    AsyncCheckpointer(root, STAGE, every=1).save(ITERATION, module, optimizer).result()
    return checkpoint_dir(root, ITERATION, STAGE), state_digest(module, optimizer)


def copy_checkpoint(source: Path, root: Path) -> Path:
    """A copy of the checkpoint directory `source` as iteration ITERATION, stage STAGE under `root`."""
    target = checkpoint_dir(root, ITERATION, STAGE)
    shutil.copytree(source, target)
    return target


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def write_manifest(path: Path, manifest: Any) -> None:
    (path / MANIFEST).write_text(json.dumps(manifest))


def read_metadata(path: Path) -> Any:
    return SafeReader(path).read_metadata()


def write_metadata(path: Path, metadata: Any) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def fresh_stage() -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:
    module, optimizer = demo_stage(seed=9)
    return module, optimizer, state_digest(module, optimizer)


class Witness:
    """What a restore opened and allocated (see the module docstring)."""

    active: Witness | None = None
    _hooked = False

    def __init__(self) -> None:
        self.opened: list[Path] = []
        self.allocated: list[int] = []  # bytes of each tensor `restore` allocated for the checkpoint

    @classmethod
    def _hook(cls, event: str, args: tuple[Any, ...]) -> None:
        if cls.active is not None and event == "open" and isinstance(args[0], (str, Path)):
            cls.active.opened.append(Path(args[0]).resolve())

    @contextmanager
    def watching(self) -> Iterator[Witness]:
        if not Witness._hooked:  # audit hooks cannot be removed: one for the whole session, gated by `active`
            sys.addaudithook(Witness._hook)
            Witness._hooked = True
        real_empty = torch.empty

        def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
            shape = torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size)
            itemsize = real_empty(0, dtype=kwargs.get("dtype")).element_size()
            self.allocated.append(shape.numel() * itemsize)
            return real_empty(*size, **kwargs)

        Witness.active = self
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "empty", empty)
            try:
                yield self
            finally:
                Witness.active = None

    def outside(self, directory: Path, root: Path) -> list[Path]:
        """Files under `root` that were opened although they are not in `directory`."""
        inside = directory.resolve()
        return [p for p in self.opened if p.is_relative_to(root.resolve()) and not p.is_relative_to(inside)]
