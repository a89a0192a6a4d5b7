"""Two GPUs: plan switches that change the partition move layers and their AdamW state over NCCL
(`runtime.moves`); the pipeline equals the whole model trained on one GPU (float64, 1e-10). Skips below
two GPUs (NCCL runs one process per GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_helpers import assert_moves_match, fault_free_json, need_gpus, read
from moves_procs import CUTS, train_moving

from schedcomp.runtime.launch import spawn

pytestmark = pytest.mark.timeout(300)


@need_gpus(2)
def test_layers_move_between_gpus_over_nccl(tmp_path: Path) -> None:
    spawn(train_moving, 2, (fault_free_json("zb-h1", 2, 1, 4), str(tmp_path)), timeout=240, backend=None)
    assert_moves_match([read(tmp_path / f"moves.{r}.json") for r in range(2)], CUTS[-1])
