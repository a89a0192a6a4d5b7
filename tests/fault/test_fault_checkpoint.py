"""Asynchronous per-stage checkpoints: consistent while training goes on, restored without trusting pickles."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from fault_procs import demo_stage, state_digest, train_demo

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.checkpoint import (
    MANIFEST,
    AsyncCheckpointer,
    checkpoint_dir,
    checkpoint_writer,
    iterations_lost,
    latest_complete,
    restore,
)
from schedcomp.topology import Topology, Worker

# per-stage checkpoints are single-process DCP saves by design; DCP warns about that
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*:UserWarning")


def test_async_checkpoint_holds_the_state_at_save_time_while_training_goes_on(tmp_path: Path) -> None:
    module, optimizer = demo_stage(seed=0)
    train_demo(module, optimizer, steps=2)
    saved = state_digest(module, optimizer)
    ckpt = AsyncCheckpointer(tmp_path, stage=0, every=1)
    assert ckpt.after_step(1, module, optimizer)
    train_demo(module, optimizer, steps=1)  # changes the tensors while the files are being written
    ckpt.wait()
    assert (checkpoint_dir(tmp_path, 1, 0) / MANIFEST).is_file()

    fresh, fresh_opt = demo_stage(seed=5)
    assert state_digest(fresh, fresh_opt) != saved
    restore(tmp_path, 1, 0, fresh, fresh_opt)
    assert state_digest(fresh, fresh_opt) == saved
    train_demo(fresh, fresh_opt, steps=1)  # and it trains on exactly as the original did
    assert state_digest(fresh, fresh_opt) == state_digest(module, optimizer)


def test_latest_complete_needs_every_stage_and_counts_lost_iterations(tmp_path: Path) -> None:
    stages = [demo_stage(seed=s) for s in range(2)]
    ckpts = [AsyncCheckpointer(tmp_path, stage=s, every=2) for s in range(2)]
    assert latest_complete(tmp_path, pp=2) is None
    for it in range(6):
        for s, (m, o) in enumerate(stages):
            if it == 5 and s == 1:
                continue  # stage 1 has not reached its step of iteration 5 when the job dies
            ckpts[s].after_step(it, m, o)
    for c in ckpts:
        c.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter00000001", "iter00000003", "iter00000005"]
    assert latest_complete(tmp_path, pp=2) == 3
    assert iterations_lost(3, reached=5) == 2
    assert iterations_lost(None, reached=5) == 6


def test_checkpoint_writer_is_the_lowest_live_replica() -> None:
    topo = Topology.of(2, 3, [(0, 1)])
    assert checkpoint_writer(topo, 0) == Worker(0, 0)
    assert checkpoint_writer(topo, 1) == Worker(1, 1)
    assert checkpoint_writer(Topology.of(1, 1, [(0, 0)]), 0) is None


class _Evil:
    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def test_restore_refuses_metadata_that_would_run_code(tmp_path: Path) -> None:
    module, optimizer = demo_stage(seed=0)
    AsyncCheckpointer(tmp_path, stage=0, every=1).save(0, module, optimizer).result()
    marker = tmp_path / "pwned"
    evil = _Evil()
    evil.target = str(marker)
    (checkpoint_dir(tmp_path, 0, 0) / ".metadata").write_bytes(pickle.dumps(evil))
    with pytest.raises(RecoveryError, match="not plain DCP metadata"):
        restore(tmp_path, 0, 0, module, optimizer)
    assert not marker.exists()


def test_restore_refuses_a_checkpoint_that_does_not_match_its_manifest(tmp_path: Path) -> None:
    module, optimizer = demo_stage(seed=0)
    AsyncCheckpointer(tmp_path, stage=0, every=1).save(0, module, optimizer).result()
    manifest = checkpoint_dir(tmp_path, 0, 0) / MANIFEST
    manifest.write_text(manifest.read_text().replace('"tensors": [', '"tensors": [{"dtype": "float32", '
                                                                      '"shape": [1], "device": "cpu"}, ', 1))
    with pytest.raises(RecoveryError, match=f"{manifest}: tensor 0 is not {{dtype, shape, device, sha256}}"):
        restore(tmp_path, 0, 0, module, optimizer)  # the extra tensor has no place in the state
    with pytest.raises(RecoveryError, match="does not exist"):
        restore(tmp_path, 7, 0, module, optimizer)
