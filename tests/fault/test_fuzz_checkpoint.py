"""Fuzzing checkpoint restore (issue 17): crafted manifests, DCP metadata and data files.

Each example copies a genuine checkpoint into a fresh folder next to a decoy (a valid checkpoint
of the same stage somewhere else), damages it, and restores it into a fresh stage. The restore
must either give exactly the checkpoint's tensors, or raise one line of RecoveryError naming a
file of the checkpoint and leave the stage as it was; it must never open a file outside the
checkpoint's folder nor allocate more than the checkpoint's data files hold. Examples are bounded
(see `FUZZ`); a hang is ended by the suite's pytest-timeout (a per-example deadline would be a
timed assertion). `pytest --hypothesis-show-statistics` prints counts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_craft import ITERATION, STAGE, Witness, copy_checkpoint, fresh_stage, read_metadata, write_checkpoint
from fault_procs import state_digest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.checkpoint import MANIFEST, restore
from schedcomp.runtime.fault.transfer import flatten, stage_state

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*:UserWarning")]

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@dataclass(frozen=True)
class Genuine:
    """A genuine checkpoint, its tensors (in `flatten` order), and how many bytes its data files hold."""

    path: Path
    tensors: list[torch.Tensor] = field(repr=False)
    data_bytes: int


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> Genuine:
    root = tmp_path_factory.mktemp("genuine")
    path, _ = write_checkpoint(root)
    module, optimizer, _ = fresh_stage()
    restore(root, ITERATION, STAGE, module, optimizer)
    data_bytes = sum(p.stat().st_size for p in path.glob("*.distcp"))
    return Genuine(path, flatten(stage_state(module, optimizer))[1], data_bytes)


def _restore_checked(genuine: Genuine, damage: Any) -> str:
    """Copy, `damage(path, decoy)`, restore; assert the fuzz properties. Returns "loaded" or "refused"."""
    source, tensors, data_bytes = genuine.path, genuine.tensors, genuine.data_bytes
    with tempfile.TemporaryDirectory(prefix="ckptfuzz-") as folder:
        root = Path(folder)
        path, decoy = copy_checkpoint(source, root / "job"), copy_checkpoint(source, root / "other")
        damage(path, decoy)
        module, optimizer, before = fresh_stage()
        witness = Witness()
        try:
            with witness.watching():
                restore(root / "job", ITERATION, STAGE, module, optimizer)
            outcome = "loaded"
        except RecoveryError as e:
            message = str(e)
            assert "\n" not in message and str(path) in message, message
            assert state_digest(module, optimizer) == before  # refused before the stage was touched
            outcome = "refused"
            event(f"refused: {_kind(message)}")
        assert witness.outside(path, root) == [], "read outside the checkpoint"
        assert sum(witness.allocated) <= data_bytes, "allocated more than the checkpoint holds"
        if outcome == "loaded":
            event("loaded")
            loaded = flatten(stage_state(module, optimizer))[1]
            assert len(loaded) == len(tensors)
            for got, want in zip(loaded, tensors, strict=True):
                assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        return outcome


def _kind(message: str) -> str:
    """Which check refused a checkpoint, for the statistics (`--hypothesis-show-statistics`)."""
    for needle, kind in (("digest", "digest"), ("cannot read its tensors", "tensor bytes"),
                         ("outside the checkpoint", "path outside"), ("checkpoint metadata", "metadata"),
                         ("checkpoint manifest", "manifest")):
        if needle in message:
            return kind
    return "other"


# ---- the manifest --------------------------------------------------------------------------------------

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.sampled_from([10**40, -(10**30), 2**63]),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                     st.sampled_from(["float32", "bfloat16", "Size", "cuda", "t", "d", "v", "f", "nan", "../x"]))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(["t", "d", "l", "u", "v", "f", "dtype", "shape", "x"]),
                                       inner, max_size=3), max_leaves=8)


def _mutate(node: Any, data: st.DataObject) -> Any:
    """`node` with one change somewhere inside it: a value replaced, a key or an item dropped or repeated."""
    children = list(node.items()) if isinstance(node, dict) else list(enumerate(node)) if isinstance(node, list) else []
    if children and data.draw(st.integers(0, 3)) > 0:  # go deeper (mostly)
        key, child = children[data.draw(st.integers(0, len(children) - 1))]
        node = dict(node) if isinstance(node, dict) else list(node)
        node[key] = _mutate(child, data)
        return node
    action = data.draw(st.sampled_from(["replace", "drop", "repeat", "scale"]))
    if action == "drop" and children:
        key = children[data.draw(st.integers(0, len(children) - 1))][0]
        return {k: v for k, v in node.items() if k != key} if isinstance(node, dict) else node[:key] + node[key + 1:]
    if action == "repeat" and isinstance(node, list) and node:
        return [*node, node[data.draw(st.integers(0, len(node) - 1))]]
    if action == "scale" and isinstance(node, int) and not isinstance(node, bool):
        return node * data.draw(st.sampled_from([0, -1, 2, 1000, 10**6, 10**12]))
    return data.draw(_JSON)


@FUZZ
@given(data=st.data(), changes=st.integers(1, 3))
def test_fuzz_manifest(genuine: Genuine, data: st.DataObject, changes: int) -> None:
    def damage(path: Path, _decoy: Path) -> None:
        manifest = json.loads((path / MANIFEST).read_text())
        for _ in range(changes):
            manifest = _mutate(manifest, data)
        (path / MANIFEST).write_text(json.dumps(manifest))

    _restore_checked(genuine, damage)


@FUZZ
@given(cut=st.one_of(st.just(0), st.integers(0, 5000)),
       flips=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 255)), max_size=3))
def test_fuzz_manifest_text(genuine: Genuine, cut: int,
                            flips: list[tuple[int, int]]) -> None:
    """Raw bytes: truncations and byte flips of the manifest's text (not only valid JSON)."""
    def damage(path: Path, _decoy: Path) -> None:
        text = bytearray((path / MANIFEST).read_bytes())
        for at, value in flips:
            text[at % len(text)] = value
        (path / MANIFEST).write_bytes(bytes(text[: len(text) - cut % len(text)] if cut else text))

    _restore_checked(genuine, damage)


# ---- DCP's metadata and the data files -----------------------------------------------------------------

_PATHS = st.sampled_from(["../../../other/iter00000003/stage0/__0_0.distcp", "DECOY", "", ".", "..",
                          "sub/../../x", "__0_0.distcp\0", "/dev/zero", "/etc/passwd", ".metadata",
                          "manifest.json", "__0_0.distcp", "nonexistent.distcp"])
_INTS = st.one_of(st.integers(-5, 50000), st.sampled_from([2**63, 10**12, True, None, 1.5, "7"]))


def _metadata_change(metadata: Any, decoy: Path, data: st.DataObject) -> None:
    items = sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn)
    index, info = items[data.draw(st.integers(0, len(items) - 1))]
    names = sorted(metadata.state_dict_metadata)
    fqn = names[data.draw(st.integers(0, len(names) - 1))]
    md = metadata.state_dict_metadata[fqn]
    action = data.draw(st.sampled_from(["path", "offset", "length", "transform", "size", "chunks", "dtype",
                                        "drop-tensor", "drop-storage", "swap-storage", "wrong-type"]))
    if action == "path":
        rel = data.draw(_PATHS)
        metadata.storage_data[index] = dataclasses.replace(
            info, relative_path=str(decoy / "__0_0.distcp") if rel == "DECOY" else rel)
    elif action in ("offset", "length"):
        metadata.storage_data[index] = dataclasses.replace(info, **{action: data.draw(_INTS)})
    elif action == "transform":
        metadata.storage_data[index] = dataclasses.replace(info, transform_descriptors=data.draw(
            st.sampled_from([["zstd"], ["x"], "zstd", [None]])))
    elif action == "size":
        md.size = torch.Size(data.draw(st.lists(st.sampled_from([0, 1, 3, 5, 10**6]), max_size=3)))
    elif action == "chunks":
        md.chunks = data.draw(st.sampled_from([[], [md.chunks[0], md.chunks[0]], None, "x"]))
    elif action == "dtype":
        md.properties.dtype = data.draw(st.sampled_from([torch.float32, torch.int8, torch.complex128, "float32"]))
    elif action == "drop-tensor":
        del metadata.state_dict_metadata[fqn]
    elif action == "drop-storage":
        del metadata.storage_data[index]
    elif action == "swap-storage":  # another tensor's bytes: caught unless both are alike in every checked way
        other = items[data.draw(st.integers(0, len(items) - 1))][1]
        metadata.storage_data[index] = other
    else:
        target = data.draw(st.sampled_from(["state_dict_metadata", "storage_data", "md.properties", "md.size",
                                            "info.relative_path"]))
        value = data.draw(st.sampled_from([None, 0, "x", [], {}, math.nan]))
        if target == "md.properties":
            md.properties = value
        elif target == "md.size":
            md.size = value
        elif target == "info.relative_path":
            metadata.storage_data[index] = dataclasses.replace(info, relative_path=value)
        else:
            setattr(metadata, target, value)


@FUZZ
@given(data=st.data(), changes=st.integers(1, 2), drop_own_data=st.booleans())
def test_fuzz_metadata(genuine: Genuine, data: st.DataObject, changes: int,
                       drop_own_data: bool) -> None:
    def damage(path: Path, decoy: Path) -> None:
        metadata = read_metadata(path)
        for _ in range(changes):
            _metadata_change(metadata, decoy, data)
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
        if drop_own_data:
            (path / "__0_0.distcp").unlink()

    outcome = _restore_checked(genuine, damage)
    assert not (drop_own_data and outcome == "loaded"), "loaded tensors whose data file was deleted"


@FUZZ
@given(target=st.sampled_from([".metadata", "__0_0.distcp"]), cut=st.one_of(st.just(0), st.integers(0, 50000)),
       flips=st.lists(st.tuples(st.integers(0, 50000), st.integers(0, 255)), max_size=4))
def test_fuzz_metadata_and_data_bytes(genuine: Genuine, target: str, cut: int,
                                      flips: list[tuple[int, int]]) -> None:
    def damage(path: Path, _decoy: Path) -> None:
        raw = bytearray((path / target).read_bytes())
        for at, value in flips:
            raw[at % len(raw)] = value
        (path / target).write_bytes(bytes(raw[: len(raw) - cut % len(raw)] if cut else raw))

    _restore_checked(genuine, damage)
