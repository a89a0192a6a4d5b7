"""Damaged and crafted checkpoints (issue 17): refused with a RecoveryError naming the file, before any
allocation, never reading outside the checkpoint's directory, the stage left as it was."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path

import pytest
from ckpt_craft import (
    ITERATION,
    STAGE,
    Witness,
    copy_checkpoint,
    fresh_stage,
    read_manifest,
    read_metadata,
    write_checkpoint,
    write_manifest,
    write_metadata,
)
from fault_procs import demo_stage, state_digest, train_demo
from full_disk import FullDisk

from schedcomp import fileio
from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.checkpoint import MANIFEST, AsyncCheckpointer, checkpoint_dir, latest_complete, restore
from schedcomp.runtime.fault.checkpoint_storage import stored_digests

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*:UserWarning")


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return write_checkpoint(tmp_path_factory.mktemp("genuine"))


@pytest.fixture
def ckpt(genuine: tuple[Path, str], tmp_path: Path) -> Path:
    return copy_checkpoint(genuine[0], tmp_path / "job")


def refused(root: Path, match: str) -> Witness:
    """Restore from `root` must raise a RecoveryError matching `match`, leaving the stage untouched."""
    module, optimizer, before = fresh_stage()
    witness = Witness()
    with witness.watching(), pytest.raises(RecoveryError, match=match) as info:
        restore(root, ITERATION, STAGE, module, optimizer)
    assert "\n" not in str(info.value)
    assert state_digest(module, optimizer) == before
    return witness


def test_a_genuine_checkpoint_restores_exactly_and_allocates_only_its_own_state(
        genuine: tuple[Path, str], ckpt: Path, tmp_path: Path) -> None:
    module, optimizer, _ = fresh_stage()
    witness = Witness()
    with witness.watching():
        restore(tmp_path / "job", ITERATION, STAGE, module, optimizer)
    assert state_digest(module, optimizer) == genuine[1]
    data = sum(p.stat().st_size for p in ckpt.glob("*.distcp"))
    assert 0 < sum(witness.allocated) <= data
    assert witness.outside(ckpt, tmp_path) == []


@pytest.mark.parametrize("escape", ["../../../other/iter00000003/stage0/__0_0.distcp", "absolute"])
def test_metadata_pointing_outside_the_checkpoint_is_refused_even_with_its_own_data_gone(
        genuine: tuple[Path, str], ckpt: Path, tmp_path: Path, escape: str) -> None:
    decoy = copy_checkpoint(genuine[0], tmp_path / "other")  # a valid checkpoint elsewhere
    target = str(decoy / "__0_0.distcp") if escape == "absolute" else escape
    assert (ckpt / target).resolve() == (decoy / "__0_0.distcp").resolve()
    metadata = read_metadata(ckpt)
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=target) for k, v in metadata.storage_data.items()}
    write_metadata(ckpt, metadata)
    (ckpt / "__0_0.distcp").unlink()
    witness = refused(tmp_path / "job", f"metadata {ckpt}/.metadata: .*outside the checkpoint's directory")
    assert witness.outside(ckpt, tmp_path) == [] and witness.allocated == []


def test_a_data_file_that_is_a_symlink_out_of_the_checkpoint_is_refused(
        genuine: tuple[Path, str], ckpt: Path, tmp_path: Path) -> None:
    decoy = copy_checkpoint(genuine[0], tmp_path / "other")
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(decoy / "__0_0.distcp")
    witness = refused(tmp_path / "job", "leads outside the checkpoint's directory")
    assert witness.outside(ckpt, tmp_path) == []


def test_missing_files_are_named(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "__0_0.distcp").unlink()
    refused(tmp_path / "job", f"data file {ckpt}/__0_0.distcp of tensor 't0' is missing")
    (ckpt / ".metadata").unlink()
    refused(tmp_path / "job", f"cannot read checkpoint metadata {ckpt}/.metadata")
    (ckpt / MANIFEST).unlink()
    refused(tmp_path / "job", f"cannot read checkpoint manifest {ckpt}/{MANIFEST}")


def test_a_huge_shape_in_the_manifest_is_refused_before_any_allocation(ckpt: Path, tmp_path: Path) -> None:
    manifest = read_manifest(ckpt)
    for spec in manifest["tensors"]:
        spec["shape"] = [1000000, 1000000]  # 4 TB in float32 each
    write_manifest(ckpt, manifest)
    witness = refused(tmp_path / "job", f"manifest {ckpt}/{MANIFEST}: module tensor .* \\[1000000, 1000000\\]")
    assert witness.allocated == []


def test_optimizer_state_bigger_than_its_parameter_is_refused(ckpt: Path, tmp_path: Path) -> None:
    manifest = read_manifest(ckpt)
    n_module = len(demo_stage(seed=0)[0].state_dict())
    manifest["tensors"][n_module + 1]["shape"] = [1000000, 1000000]  # exp_avg of the first parameter
    write_manifest(ckpt, manifest)
    witness = refused(tmp_path / "job", "optimizer state 'exp_avg' of parameter 0 is .* bigger than its parameter")
    assert witness.allocated == []


def test_metadata_that_disagrees_with_the_manifest_is_refused(ckpt: Path, tmp_path: Path) -> None:
    metadata = read_metadata(ckpt)
    del metadata.state_dict_metadata["t5"]
    write_metadata(ckpt, metadata)
    refused(tmp_path / "job", "does not hold exactly the tensors its manifest lists")


def test_metadata_built_without_its_tables_is_refused(ckpt: Path, tmp_path: Path) -> None:
    metadata = read_metadata(ckpt)  # found by the fuzz suite: a pickle may BUILD an object without them
    del metadata.state_dict_metadata
    write_metadata(ckpt, metadata)
    refused(tmp_path / "job", "has no tensor or storage table")


def test_a_byte_range_past_the_end_of_its_file_is_refused(ckpt: Path, tmp_path: Path) -> None:
    metadata = read_metadata(ckpt)
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], offset=10**12)
    write_metadata(ckpt, metadata)
    refused(tmp_path / "job", "stored at bytes 1000000000000\\+.* which holds")


def test_stream_transforms_are_refused(ckpt: Path, tmp_path: Path) -> None:
    metadata = read_metadata(ckpt)
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], transform_descriptors=["zstd"])
    write_metadata(ckpt, metadata)
    refused(tmp_path / "job", "through transforms")


def test_damaged_tensor_bytes_are_a_recovery_error_and_the_stage_is_untouched(ckpt: Path, tmp_path: Path) -> None:
    data = ckpt / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 1  # one bit of the last tensor's values: torch would load it without complaint
    data.write_bytes(bytes(raw))
    refused(tmp_path / "job", f"checkpoint {ckpt}: the stored bytes of tensor t27 do not match the digest")


def test_unreadable_tensor_bytes_with_matching_digests_are_a_recovery_error(ckpt: Path, tmp_path: Path) -> None:
    data = ckpt / "__0_0.distcp"
    data.write_bytes(b"\x00" * data.stat().st_size)
    manifest = read_manifest(ckpt)  # crafted consistently: the digests describe the zeros
    for spec, digest in zip(manifest["tensors"], stored_digests(read_metadata(ckpt), ckpt).values(), strict=True):
        spec["sha256"] = digest
    write_manifest(ckpt, manifest)
    refused(tmp_path / "job", f"checkpoint {ckpt}: cannot read its tensors")


def test_metadata_sending_a_tensor_to_another_ones_bytes_is_refused(ckpt: Path, tmp_path: Path) -> None:
    metadata = read_metadata(ckpt)
    keys = [k for k in metadata.storage_data if k.fqn in ("t2", "t3")]  # both float64 [5]
    a, b = (metadata.storage_data[k] for k in keys)
    metadata.storage_data[keys[0]], metadata.storage_data[keys[1]] = b, a
    write_metadata(ckpt, metadata)
    refused(tmp_path / "job", "the stored bytes of tensor t2 do not match the digest")


def test_a_checkpoint_of_an_older_format_is_refused_with_a_reason(ckpt: Path, tmp_path: Path) -> None:
    manifest = read_manifest(ckpt)
    manifest["format"] = 1
    write_manifest(ckpt, manifest)
    refused(tmp_path / "job", "written by an older schedcomp, without digests")


def _one_tensor(dtype: str, shape: list[int], device: str) -> str:
    spec = {"dtype": dtype, "shape": shape, "device": device, "sha256": "0" * 64}
    return json.dumps({"format": 2, "iteration": ITERATION, "stage": STAGE, "tensors": [spec]})


def _two_tensors(skeleton: object) -> str:
    spec = {"dtype": "float32", "shape": [1], "device": "cpu", "sha256": "0" * 64}
    return json.dumps({"format": 2, "iteration": ITERATION, "stage": STAGE, "tensors": [spec, spec],
                       "skeleton": skeleton})


@pytest.mark.parametrize(("text", "match"), [
    ("[1, 2]", "is a JSON list, not an object"),
    ("{", "is not valid JSON"),
    ("[" * 5000 + "]" * 5000, "nests more than 64 levels deep"),
    (b"\xff\xfe", "is not UTF-8"),
    ('{"format": 2, "iteration": 3, "stage": 0, "tensors": []}', "has no skeleton"),
    ('{"format": 4, "iteration": 3, "stage": 0}', "has format 4, expected 2"),
    ('{"format": 3, "iteration": 3, "stage": 0}', "holds each layer's state"),
    ('{"format": 2, "iteration": 4, "stage": 0}', "has iteration 4, expected 3"),
    ('{"format": 2, "iteration": 3, "stage": true}', "has stage True, expected 0"),
    (_one_tensor("Size", [1], "cpu"),
     "tensor 0 has unknown dtype 'Size'"),
    (_one_tensor("float32", [-1], "cpu"),
     "tensor 0 has shape \\[-1\\]"),
    (_one_tensor("float32", [1], "tpu"),
     "tensor 0 has device 'tpu'"),
    ('{"format": 2, "iteration": 3, "stage": 0, "tensors": [], "skeleton": {"t": 7}}',
     "skeleton names tensor 7, but there are 0"),
    ('{"format": 2, "iteration": 3, "stage": 0, "tensors": [], "skeleton": {"d": [[null, {"v": 1}]]}}',
     "a dict entry is not a"),
    ('{"format": 2, "iteration": 3, "stage": 0, "tensors": [], "skeleton": {"d": []}}',
     "does not hold a stage state"),
    (_two_tensors({"l": [{"t": 1}, {"t": 0}]}), "names tensor 1 where tensor 0 belongs"),  # swapped in place
    (_two_tensors({"l": [{"t": 0}]}), "places 1 of its 2 tensors"),
    (_two_tensors({"d": [["a", {"t": 0}], ["a", {"t": 1}]]}), "a dict repeats a key"),  # the last would win
])
def test_a_malformed_manifest_is_one_line_naming_it(ckpt: Path, tmp_path: Path, text: str | bytes, match: str) -> None:
    manifest = ckpt / MANIFEST
    manifest.write_bytes(text if isinstance(text, bytes) else text.encode())
    refused(tmp_path / "job", f"manifest {manifest}.*{match}")


def test_restoring_into_another_model_names_the_first_difference(ckpt: Path, tmp_path: Path) -> None:
    import torch

    module = torch.nn.Sequential(torch.nn.Linear(6, 7))
    optimizer = torch.optim.Adam(module.parameters())
    with pytest.raises(RecoveryError, match=r"holds another module's state .*: it belongs to a different model"):
        restore(tmp_path / "job", ITERATION, STAGE, module, optimizer)


def test_a_failed_manifest_write_leaves_no_manifest_and_names_the_path(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    module, optimizer = demo_stage(seed=0)
    monkeypatch.setattr(fileio, "os", FullDisk())
    path = checkpoint_dir(tmp_path, 0, 0)
    with pytest.raises(RecoveryError, match=f"cannot write {path}/{MANIFEST}: No space left on device"):
        AsyncCheckpointer(tmp_path, 0, every=1).save(0, module, optimizer).result(timeout=60)
    assert not (path / MANIFEST).exists() and not list(path.glob(f".{MANIFEST}*"))  # no half manifest


def test_a_failed_data_write_fails_the_save_instead_of_hanging(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    module, optimizer = demo_stage(seed=0)
    monkeypatch.setattr(os, "fsync", FullDisk.fsync)  # DCP's own writer fails (a BaseException inside DCP)
    path = checkpoint_dir(tmp_path, 0, 0)
    with pytest.raises(RecoveryError, match=f"checkpoint {path} could not be written .*No space left"):
        AsyncCheckpointer(tmp_path, 0, every=1).save(0, module, optimizer).result(timeout=60)
    assert not (path / MANIFEST).exists()


def test_non_finite_optimizer_settings_round_trip(tmp_path: Path) -> None:
    module, optimizer = demo_stage(seed=0)
    optimizer.param_groups[0]["max_norm"] = float("inf")  # JSON has no infinity: written as a tagged string
    train_demo(module, optimizer, steps=1)
    AsyncCheckpointer(tmp_path, 0, every=1).save(0, module, optimizer).result()
    assert "Infinity" not in (checkpoint_dir(tmp_path, 0, 0) / MANIFEST).read_text()
    fresh, fresh_opt = demo_stage(seed=4)
    fresh_opt.param_groups[0]["max_norm"] = 1.0
    restore(tmp_path, 0, 0, fresh, fresh_opt)
    assert fresh_opt.param_groups[0]["max_norm"] == float("inf")
    assert state_digest(fresh, fresh_opt) == state_digest(module, optimizer)


def test_a_checkpoint_directory_that_cannot_be_made_or_read_is_named(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    module, optimizer = demo_stage(seed=0)
    (tmp_path / "iter00000000").write_text("a file where the iteration's directory goes")
    with pytest.raises(RecoveryError, match=f"cannot create checkpoint directory {tmp_path}/iter00000000/stage0"):
        AsyncCheckpointer(tmp_path, 0, every=1).save(0, module, optimizer)
    assert latest_complete(tmp_path, 1) is None

    def unreadable(self: Path) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(Path, "iterdir", unreadable)  # (tests run as root: chmod would not stop them)
    with pytest.raises(RecoveryError, match=f"cannot list checkpoint directory {tmp_path}: Permission denied"):
        latest_complete(tmp_path, 1)


@pytest.mark.parametrize(("key", "match"), [("step", "does not load into this stage"),
                                            ("exp_avg", r"lacks \['exp_avg'\]")])
def test_a_renamed_optimizer_state_key_is_refused_and_a_trained_stage_keeps_its_state(
        ckpt: Path, tmp_path: Path, key: str, match: str) -> None:
    # Passes every check before the load (names, shapes, digests): renaming `step` fails inside torch's
    # load, renaming `exp_avg` loads a state Adam cannot step with. Either way the stage gets its own back.
    text = (ckpt / MANIFEST).read_text()
    assert f'"{key}"' in text
    (ckpt / MANIFEST).write_text(text.replace(f'"{key}"', f'"{key[:-1]}Q"', 1))  # parameter 0's only
    module, optimizer = demo_stage(seed=9)
    train_demo(module, optimizer, steps=1)  # a stage with optimizer state, a schedule's worth of it
    before = state_digest(module, optimizer)
    with pytest.raises(RecoveryError, match=match) as info:
        restore(tmp_path / "job", ITERATION, STAGE, module, optimizer)
    assert "\n" not in str(info.value) and str(ckpt) in str(info.value)
    assert state_digest(module, optimizer) == before
    train_demo(module, optimizer, steps=1)  # and it still steps
