"""Parent-side helpers of the GPU suite: skip marks by GPU count, plans, reading and checking results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from resilient_procs import flat

from schedcomp import CostModel, Topology
from schedcomp.lower import lower
from schedcomp.schedules import fault_free_order

TOLERANCE = 1e-10

NO_CUDA = "needs CUDA: no GPU is visible here (torch.cuda.is_available() is False); run tests/gpu/run.sh on a GPU"


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def need_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless at least `n` GPUs are visible (one process per GPU)."""
    have = gpus()
    reason = NO_CUDA if have == 0 else f"needs {n} GPUs (one process per GPU), this machine has {have}"
    return pytest.mark.skipif(have < n, reason=reason)


def fault_free_json(family: str, pp: int, dp: int, microbatches: int) -> str:
    return lower(fault_free_order(family, Topology.of(pp, dp), microbatches), CostModel.uniform(pp)).to_json()


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def assert_matches_reference(results: list[dict], families: list[str], device: str = "cuda") -> None:
    """Every run's losses and every active worker's stage equal the plain loop's (float64, 1e-10), on
    `device` ("cpu": the dry run on gloo in the CPU suite, tests/runtime/test_gpu_procs_on_cpu.py)."""
    reference = results[0]["reference"]
    for result in results:
        assert result["mismatches"] == [], f"tensors on a device their group does not serve: {result['mismatches']}"
        assert [r["family"] for r in result["runs"]] == families
        for run in result["runs"]:
            assert run["device"].startswith(device), run
            assert ("cuda:nccl" if device == "cuda" else "cpu:gloo") in run["backend"], run
            assert run["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE, rel=0), run["family"]
            if not run["active"]:
                continue
            stage = int(run["worker"].split(":")[1])
            for name, want in reference["states"][stage].items():
                err = (torch.tensor(run["state"][name]) - torch.tensor(want)).abs().max().item()
                assert err <= TOLERANCE, f"{run['family']} worker {run['worker']} {name} is off by {err:.3g}"


def check_transfer(tmp_path: Path) -> None:
    sender, receiver = read(tmp_path / "transfer.0.json"), read(tmp_path / "transfer.1.json")
    assert sender["mismatches"] == [] and receiver["mismatches"] == []
    assert receiver["before"] != sender["state"]  # it held other values before
    assert receiver["state"] == sender["state"]  # bit-exact, each tensor on the device type it had
    assert any(device == "cuda" for device, _ in receiver["state"]["tensors"])
    assert receiver["received"] == sender["sent"] and receiver["info"] == {"iteration": 7}


def assert_moves_match(results: list[dict], cut: tuple[int, ...], device: str = "cuda") -> None:
    """Each stage of the layer-move job (`moves_procs.train_moving`) holds the layers of `cut`, the last
    partition, with the state the one-process reference reaches (float64, 1e-10)."""
    want = results[0]["reference"]
    for stage, r in enumerate(results):
        assert r["devices"] == [device] and not r["mismatches"], r["mismatches"]
        assert {"isend", "irecv"} <= set(r["calls"])
        assert sorted(map(int, r["layers"])) == list(range(sum(cut[:stage]), sum(cut[: stage + 1])))
        for layer, state in r["layers"].items():
            for name, value in want[int(layer)].items():
                got, expected = flat(state[name]), flat(value)
                assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= TOLERANCE, (stage, layer, name)
