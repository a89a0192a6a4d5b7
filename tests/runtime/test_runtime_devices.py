"""Every tensor handed to torch.distributed is on a device its group serves (the NCCL-readiness of the runtime).

On a GPU the groups serve the CPU over gloo and the GPU over NCCL (`comm.backend_spec`); control
tensors go where `Comm.control_device` says, data tensors on the compute device. Here (CPU, gloo)
the same code runs under `dist_audit.Audit`; tests/gpu runs it again on NCCL, where a CPU tensor
on an NCCL-only group would fail. The unit tests use gloo registered for cuda only
("cuda:gloo"), which serves no CPU tensor exactly as an NCCL-only group does.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_audit import Audit
from torch import nn

from schedcomp import CostModel, Topology, Worker
from schedcomp.errors import RecoveryError, RuntimeSetupError
from schedcomp.lower import lower
from schedcomp.runtime.comm import (
    backend_config,
    backend_spec,
    control_device,
    local_device,
    pick_backend,
    require_device,
    served_devices,
)
from schedcomp.runtime.launch import spawn
from schedcomp.schedules import fault_free_order

H, ROWS = 4, 2


def test_backend_spec_reads_torch_forms() -> None:
    gpu = {"cpu": "gloo", "cuda": "nccl"}
    assert backend_spec("gloo") == {"cpu": "gloo"}
    assert backend_spec("nccl") == gpu  # plain NCCL would leave the control tensors without a backend
    assert backend_spec("cpu:gloo,cuda:nccl") == gpu
    assert backend_spec(" CPU:gloo, cuda:gloo ") == {"cpu": "gloo", "cuda": "gloo"}


@pytest.mark.parametrize("bad", ["mpi", "cpu:nccl", "cpu:gloo,cpu:gloo", "xpu:gloo", "cuda:", ""])
def test_backend_spec_refuses_what_it_cannot_build(bad: str) -> None:
    with pytest.raises(RuntimeSetupError, match="backend"):
        backend_spec(bad)


def test_backend_config_and_local_device() -> None:
    assert backend_config(backend_spec("nccl")) == "cpu:gloo,cuda:nccl"
    assert backend_config(backend_spec("gloo")) == "gloo"
    assert local_device(backend_spec("gloo")) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert pick_backend() == "gloo"
        with pytest.raises(RuntimeSetupError, match="one process per GPU, or use the gloo backend"):
            local_device(backend_spec("nccl"))


def test_nccl_settings_hold_only_while_our_groups_are_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from schedcomp.runtime.fault.groups import _nccl_env

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    with _nccl_env():
        assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1" and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


@pytest.fixture
def one_process_job():
    """A world of one over gloo in this process (gloo serves cpu and cuda), torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_control_device_prefers_the_cpu_and_falls_back_to_the_compute_device(one_process_job) -> None:
    cuda = torch.device("cuda", 0)
    both, cpu_only, gpu_only = (dist.new_group([0], backend=b) for b in ("cpu:gloo,cuda:gloo", "cpu:gloo", "cuda:gloo"))
    assert served_devices(both) == {"cpu", "cuda"} and served_devices(gpu_only) == {"cuda"}
    assert control_device(both, cuda) == torch.device("cpu")  # no GPU round trip for host data
    assert control_device(cpu_only, torch.device("cpu")) == torch.device("cpu")
    assert control_device(gpu_only, cuda) == cuda  # an NCCL-only control group: control tensors on the GPU
    with pytest.raises(RuntimeSetupError, match="serves only cuda"):
        control_device(gpu_only, torch.device("cpu"))
    require_device(both, cuda, "control")
    with pytest.raises(RuntimeSetupError, match="computes on cuda"):
        require_device(cpu_only, cuda, "point-to-point")


def test_served_devices_without_torchs_list_asks_each_backend(one_process_job) -> None:
    class Bare:  # a group as an older torch might expose it: no `_device_types`
        def __init__(self, group: dist.ProcessGroup) -> None:
            self._get_backend = group._get_backend

    for backend in ("cpu:gloo,cuda:gloo", "cpu:gloo", "cuda:gloo"):
        group = dist.new_group([0], backend=backend)
        assert served_devices(Bare(group)) == served_devices(group)


def test_a_backend_serving_two_devices_is_built_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A ProcessGroup keeps the first object registered per backend type and drops later ones; a dropped
    # gloo context closes its connections while slower members still connect ("Connection closed by
    # peer" under load). So "cpu:gloo,cuda:gloo" must build one gloo context that serves both devices.
    from schedcomp.runtime.fault import groups

    built = []
    real = dist.ProcessGroupGloo

    class Counting:
        _Options = real._Options
        create_device = staticmethod(real.create_device)

        def __new__(cls, *args):
            built.append(real(*args))
            return built[-1]

    monkeypatch.setattr(dist, "ProcessGroupGloo", Counting)
    pg = groups._make_group(dist.HashStore(), 0, 1, {"cpu": "gloo", "cuda": "gloo"}, "127.0.0.1",
                            datetime.timedelta(seconds=10), "both")
    assert len(built) == 1
    assert pg._get_backend(torch.device("cpu")) is built[0] and pg._get_backend(torch.device("cuda")) is built[0]
    assert served_devices(pg) == {"cpu", "cuda"}


def test_audit_catches_a_cpu_tensor_on_a_group_without_a_cpu_backend(one_process_job) -> None:
    gpu_only = dist.new_group([0], backend="cuda:gloo")
    original = dist.all_reduce
    with Audit() as audit:
        dist.all_reduce(torch.ones(2))
        with pytest.raises(RuntimeError, match="device type cpu"):  # the error NCCL-only groups gave the trainer
            dist.all_gather([torch.zeros(1)], torch.ones(1), group=gpu_only)
    assert [c.name for c in audit.calls] == ["all_reduce", "all_gather"]
    assert [c.name for c in audit.mismatches()] == ["all_gather"]
    assert dist.all_reduce is original  # restored on exit


def test_trainer_refuses_groups_that_cannot_carry_its_tensors(one_process_job) -> None:
    from schedcomp.runtime import PipelineTrainer

    dist.destroy_process_group()
    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)  # no CPU backend
    plan = lower(fault_free_order("1f1b", Topology.of(1, 1), 2), CostModel.uniform(1))
    with pytest.raises(RuntimeSetupError, match="cpu:gloo,cuda:nccl"):
        PipelineTrainer(plan, lambda s: nn.Linear(H, H), F.mse_loss, lambda p: torch.optim.SGD(p, lr=0.1),
                        process=(0, 1, torch.device("cpu")))


def test_generation_refuses_an_unknown_backend() -> None:
    from schedcomp.runtime.fault.groups import Generation
    from schedcomp.runtime.fault.membership import View

    view = View.initial(1, 1)
    with pytest.raises(RecoveryError, match="cannot rebuild groups"):
        Generation(dist.HashStore(), view, view.members[0], backend="mpi")
    with pytest.raises(RecoveryError, match="no CPU backend"):
        Generation(dist.HashStore(), view, view.members[0], backend="cuda:nccl")


# ---- a 2 x 2 job under the audit: trainer, trace, a resilient generation's groups, a replica transfer ----------


def _stage(stage: int) -> nn.Module:
    torch.manual_seed(stage)
    return nn.Sequential(nn.Linear(H, H), nn.Tanh()).double()


def _batch(chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64),
            torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def audited_job(rank: int, outdir: str) -> None:
    from torch.distributed import distributed_c10d as c10d

    from schedcomp.runtime import PipelineTrainer
    from schedcomp.runtime.fault.groups import regroup
    from schedcomp.runtime.fault.membership import View
    from schedcomp.runtime.fault.transfer import recv_stage_state, send_stage_state

    topology = Topology.of(2, 2)
    plan = lower(fault_free_order("zb-h1", topology, 4), CostModel.uniform(2))
    batch = _batch(2 * plan.microbatches)
    with Audit() as audit:
        trainer = PipelineTrainer(plan, _stage, F.mse_loss, _sgd, profile=True)
        losses = [trainer.step(batch) for _ in range(2)]
        values = [float(v) for v in losses]
        trainer.save_trace(Path(outdir) / "trace.json")
        job = set(audit.names())
        # A resilient generation's groups, with gloo standing in for NCCL on cuda: both devices served.
        view = View.initial(2, 2)
        me = view.members[rank]
        groups = regroup(dist.PrefixStore("audit", c10d._get_default_store()), view, me,
                         backend="cpu:gloo,cuda:gloo")
        gen_trainer = PipelineTrainer(plan, _stage, F.mse_loss, _sgd, process=(groups.rank, len(view.members),
                                      torch.device("cpu")), make_group=groups.generation.new_group,
                                      setup_collectives=False)
        ledger = torch.zeros(2 * plan.microbatches, dtype=torch.float64)
        gen_trainer.run_iteration(batch, ledger=ledger)  # the ledger rides on the gradient all-reduce
        module = gen_trainer.stage.module
        before = {k: v.clone() for k, v in module.state_dict().items()}
        if me.pipeline == 0:
            send_stage_state(module, gen_trainer.stage.optimizer, groups.world, [groups.rank_of(Worker(1, me.stage))],
                             info={"iteration": 1})
            restored = True
        else:
            with torch.no_grad():
                for p in module.parameters():
                    p.zero_()
            recv_stage_state(module, gen_trainer.stage.optimizer, groups.world,
                             src=groups.rank_of(Worker(0, me.stage)))
            restored = all(torch.equal(before[k], v) for k, v in module.state_dict().items())
        world_served = sorted(served_devices(groups.world))
        groups.close()
    result = {"losses": values, "mismatches": [c.name for c in audit.mismatches()], "job": sorted(job),
              "names": sorted(audit.names()), "world_served": world_served, "restored": restored,
              "ledger": ledger.tolist()}
    (Path(outdir) / f"audit.{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow  # over ~5 s: make test-fast leaves it to make test
@pytest.mark.timeout(240)
def test_every_tensor_handed_to_a_collective_is_on_a_device_its_group_serves(tmp_path: Path) -> None:
    spawn(audited_job, 4, (str(tmp_path),), timeout=200, backend="cpu:gloo")
    results = [json.loads((tmp_path / f"audit.{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert r["mismatches"] == []
        # the audit saw the plan digest, shape probe, clock, p2p, gradient and loss reductions, trace gathering
        assert {"all_gather", "broadcast", "isend", "irecv", "all_reduce"} <= set(r["job"])
        assert {"isend", "irecv"} <= set(r["names"])  # replica transfer: abortable non-blocking p2p
        assert r["world_served"] == ["cpu", "cuda"]
        assert r["restored"]
        assert r["ledger"] == [1.0] * 8  # summed over the stage's replicas: every micro-batch counted once
    assert len({tuple(r["losses"]) for r in results}) == 1  # every rank reads the same reduced loss
    assert (tmp_path / "trace.json").is_file()
