"""Per-layer checkpoints (`checkpoint_layers`): written under one cut of an nn.Sequential, restored into others.

An 8-layer model trains two Adam steps (float64) stage by stage under the cut (2, 2, 2, 2), each stage with
its own optimizer and a StepLR schedule; every stage saves iteration 1. A fresh model restored into the
cuts (3, 1, 2, 2) and (1, 3, 3, 1) holds exactly the same per-layer parameters, Adam state and schedule,
and trains on exactly as the original.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from schedcomp.errors import RecoveryError
from schedcomp.partition import spans
from schedcomp.runtime.fault.checkpoint import MANIFEST, AsyncCheckpointer, checkpoint_dir, latest_complete, restore
from schedcomp.runtime.training import attach_lr_scheduler, lr_scheduler_of

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*:UserWarning")

LAYERS, WRITTEN, ITERATION = 8, (2, 2, 2, 2), 1


def model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(LAYERS))).double()


def stages(net: nn.Sequential, cut: tuple[int, ...]) -> list[tuple[nn.Sequential, torch.optim.Optimizer]]:
    """Each stage of `cut`: its layers of `net` (the same modules) and its own Adam with a StepLR schedule."""
    out = []
    for held in spans(cut):
        module = nn.Sequential(*(net[i] for i in held))
        optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
        attach_lr_scheduler(optimizer, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
        out.append((module, optimizer))
    return out


def train(net: nn.Sequential, held: list[tuple[nn.Sequential, torch.optim.Optimizer]], steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
        F.mse_loss(net(x), y).backward()
        for _, optimizer in held:
            optimizer.step()
            optimizer.zero_grad()
            lr_scheduler_of(optimizer).step()


def per_layer(net: nn.Sequential, held: list[tuple[nn.Sequential, torch.optim.Optimizer]]) -> list[dict]:
    """Each layer's parameters and its parameters' Adam state, and every stage's lr and schedule."""
    state = {id(p): s for _, optimizer in held for p, s in optimizer.state.items()}
    layers = [{"module": layer.state_dict(), "adam": [state.get(id(p), {}) for p in layer.parameters()]}
              for layer in net]
    settings = [(o.param_groups[0]["lr"], lr_scheduler_of(o).state_dict()["last_epoch"]) for _, o in held]
    return [*layers, settings]


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, nn.Sequential, list]:
    net = model(0)
    held = stages(net, WRITTEN)
    train(net, held, range(ITERATION + 1))
    for s, (module, optimizer) in enumerate(held):
        AsyncCheckpointer(tmp_path, s, every=1).save(ITERATION, module, optimizer, WRITTEN).result(timeout=60)
    return tmp_path, net, held


@pytest.mark.parametrize("cut", [(3, 1, 2, 2), (1, 3, 3, 1)])
def test_a_checkpoint_written_under_one_cut_restores_exactly_into_another(written, cut: tuple[int, ...]) -> None:
    root, net, held = written
    manifest = json.loads((checkpoint_dir(root, ITERATION, 1) / MANIFEST).read_text())
    assert [e["index"] for e in manifest["layers"]] == [2, 3] and manifest["model_layers"] == LAYERS
    assert latest_complete(root, len(cut), LAYERS) == ITERATION
    fresh = model(1)
    restored = stages(fresh, cut)
    assert not same(per_layer(fresh, restored)[:LAYERS], per_layer(net, held)[:LAYERS])
    for s, (module, optimizer) in enumerate(restored):
        restore(root, ITERATION, s, module, optimizer, cut)
    want = per_layer(net, held)
    got = per_layer(fresh, restored)
    assert same(got[:LAYERS], want[:LAYERS])  # parameters and Adam state, bit for bit
    assert got[LAYERS] == [want[LAYERS][0]] * len(cut)  # the lr and schedule every stage shares
    train(net, held, range(ITERATION + 1, ITERATION + 3))
    train(fresh, restored, range(ITERATION + 1, ITERATION + 3))
    for a, b in zip(fresh.parameters(), net.parameters(), strict=True):
        assert (a - b).abs().max().item() <= 1e-10


def test_an_iteration_is_complete_only_when_its_stages_hold_every_layer(written) -> None:
    root, net, held = written
    other = stages(net, (1, 3, 3, 1))  # the same trained layers, cut otherwise (fresh optimizers)
    # iteration 3: stage 0 written under (1, 3, 3, 1) holds layer 0 only, stages 1-3 under (2, 2, 2, 2): no layer 1
    AsyncCheckpointer(root, 0, every=1).save(3, *other[0], (1, 3, 3, 1)).result(timeout=60)
    for s in (1, 2, 3):
        AsyncCheckpointer(root, s, every=1).save(3, *held[s], WRITTEN).result(timeout=60)
    assert latest_complete(root, 4, LAYERS) == ITERATION
    with pytest.raises(RecoveryError, match=r"holds no complete state of layers \[1\]"):
        restore(root, 3, 0, *stages(model(1), WRITTEN)[0], WRITTEN)
    # iteration 5: stage 0 written under (3, 1, 2, 2) holds layers 0-2, stage 1 under (2, 2, 2, 2) layers 2-3 (an
    # iteration re-run under another cut): complete, layer 2 is read from stage 0, the lowest holding it
    wide = stages(net, (3, 1, 2, 2))
    AsyncCheckpointer(root, 0, every=1).save(5, *wide[0], (3, 1, 2, 2)).result(timeout=60)
    for s in (1, 2, 3):
        AsyncCheckpointer(root, s, every=1).save(5, *held[s], WRITTEN).result(timeout=60)
    assert latest_complete(root, 4, LAYERS) == 5
    (checkpoint_dir(root, 5, 2) / MANIFEST).unlink()  # stage 2's writer died before its manifest
    assert latest_complete(root, 4, LAYERS) == ITERATION


def test_damaged_or_crafted_per_layer_checkpoints_are_one_line(written, tmp_path: Path) -> None:
    root, _, _ = written
    cut = (3, 1, 2, 2)

    def restore_stage(s: int) -> None:
        module, optimizer = stages(model(1), cut)[s]
        restore(root, ITERATION, s, module, optimizer, cut)

    # a data file changed after the save: stage 2 of (3, 1, 2, 2) reads layers 4-5 from stage 2's directory
    data = next(p for p in checkpoint_dir(root, ITERATION, 2).iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[-9] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(RecoveryError, match=r"stage2: the stored bytes of tensor layer\d\.\d do not match"):
        restore_stage(2)
    restore_stage(1)  # layer 3 lies in stage 1's directory, untouched
    # a manifest claiming a bigger layer: refused before anything is allocated
    path = checkpoint_dir(root, ITERATION, 1) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["layers"][1]["tensors"][0]["shape"] = [4096, 4096]
    path.write_text(json.dumps(manifest))
    with pytest.raises(RecoveryError, match=r"stage1/manifest.json: layer 3: module tensor '0.weight' is "
                                            r"float64 \[4096, 4096\], but this stage's is float64 \[4, 4\]"):
        restore_stage(1)
    manifest["layers"][1]["index"] = 2  # two entries of layer 2
    path.write_text(json.dumps(manifest))
    with pytest.raises(RecoveryError, match=r"stage1/manifest.json: layer entry .* of a new layer index below 8"):
        latest_complete(root, 4, LAYERS)
    manifest["model_layers"] = 9
    manifest["layers"][1]["index"] = 3
    path.write_text(json.dumps(manifest))
    with pytest.raises(RecoveryError, match="holds layers of a 9-layer model, this one has 8"):
        latest_complete(root, 4, LAYERS)
    # a checkpoint of one stage's state (an older schedcomp's, or a stage builder's) where layers are expected
    module, optimizer = stages(model(0), WRITTEN)[0]
    AsyncCheckpointer(tmp_path / "old", 0, every=1).save(0, module, optimizer).result(timeout=60)
    with pytest.raises(RecoveryError, match="holds one stage's state, not each layer's: it was written by an older "
                                            "schedcomp or for a stage builder"):
        latest_complete(tmp_path / "old", 4, LAYERS)
    # and the other way round
    with pytest.raises(RecoveryError, match="holds each layer's state"):
        restore(root, ITERATION, 0, module, optimizer)


def test_a_crafted_schedule_state_is_refused_and_the_stage_keeps_its_own(written) -> None:
    # A field the schedule does not have passes the checks (names and digests of tensors, top-level
    # names of the settings) and StepLR's load_state_dict takes it into its __dict__: the next step fails.
    root, _, _ = written
    path = checkpoint_dir(root, ITERATION, 0) / MANIFEST
    manifest = json.loads(path.read_text())
    attached = dict(manifest["settings"]["d"])["attached"]
    schedule = dict(attached["d"])["lr_scheduler"]
    schedule["d"].append(["optimizer", {"v": 0}])
    path.write_text(json.dumps(manifest))
    net = model(1)
    module, optimizer = stages(net, WRITTEN)[0]
    before = per_layer(net, [(module, optimizer)])
    with pytest.raises(RecoveryError, match=r"stage0/manifest.json: the optimizer's state tied lr_scheduler holds "
                                            r"\['optimizer'\] unlike this stage's"):
        restore(root, ITERATION, 0, module, optimizer, WRITTEN)
    assert same(per_layer(net, [(module, optimizer)]), before)
    lr_scheduler_of(optimizer).step()  # the stage's own schedule still steps


def test_a_re_formed_plans_writers_each_save_their_own_pipelines_span_and_together_every_layer(written,
                                                                                             tmp_path: Path) -> None:
    # pp 4, dp 2, worker 0:1 failed, pipeline 0 re-formed (3, 0, 3, 2). Each place's writer (its lowest live
    # pipeline) saves under its own pipeline's partition (`PipelineTrainer.own_cut`, the resilient job's
    # `checkpoint_cut`): 0:0 layers 0-2, 1:1 layers 2-3, 0:2 layers 3-5, 0:3 layers 6-7. Together they hold every
    # layer (a re-formed pipeline's live workers hold the whole model), and restore bit for bit into the even cut.
    from types import SimpleNamespace

    from schedcomp.runtime.fault.checkpoint import checkpoint_writer
    from schedcomp.runtime.trainer import PipelineTrainer
    from schedcomp.topology import Topology, Worker

    _, net, held = written
    root = tmp_path / "reformed"
    partitions = ((3, 0, 3, 2), (2, 2, 2, 2))
    topology = Topology.of(4, 2, [Worker(0, 1)])
    for s in range(4):
        writer = checkpoint_writer(topology, s)
        cut = PipelineTrainer.own_cut.fget(SimpleNamespace(cuts=partitions, worker=writer, partition=WRITTEN))
        assert cut == partitions[writer.pipeline]
        # the same training under the writer's cut (its held places: a failed one has no layers, no optimizer)
        trained, live = model(0), [place for place, n in enumerate(cut) if n]
        stage = stages(trained, tuple(cut[place] for place in live))
        train(trained, stage, range(ITERATION + 1))
        AsyncCheckpointer(root, s, every=1).save(ITERATION, *stage[live.index(s)], cut).result(timeout=60)
    saved = [[e["index"] for e in json.loads((checkpoint_dir(root, ITERATION, s) / MANIFEST).read_text())["layers"]]
             for s in range(4)]
    assert saved == [[0, 1, 2], [2, 3], [3, 4, 5], [6, 7]]
    assert latest_complete(root, 4, LAYERS) == ITERATION
    fresh = model(1)
    restored = stages(fresh, WRITTEN)
    for s, (module, optimizer) in enumerate(restored):
        restore(root, ITERATION, s, module, optimizer, WRITTEN)
    assert same(per_layer(fresh, restored)[:LAYERS], per_layer(net, held)[:LAYERS])


def test_a_re_run_under_a_re_formed_cut_writes_the_layers_its_stage_checkpoint_lacks_beside_it(written,
                                                                                             tmp_path: Path) -> None:
    # pp 4, iteration 1 due a checkpoint. Under the even cut place 2's writer completes stage2 (layers 4, 5);
    # then 0:0 dies before it steps. The re-run under pipeline 0 re-formed, (0, 3, 3, 2), has place 2's writer
    # hold layers 3-5: stage2 lacks layer 3 and no other writer holds it, so it writes beside stage2 (its own
    # complete checkpoint is never rewritten in place), and the iteration holds every layer again.
    _, net, held = written
    root = tmp_path / "rerun"

    def save(place: int, cut: tuple[int, ...]) -> None:
        trained, live = model(0), [p for p, n in enumerate(cut) if n]
        stage = stages(trained, tuple(cut[p] for p in live))
        train(trained, stage, range(ITERATION + 1))
        AsyncCheckpointer(root, place, every=1).save(ITERATION, *stage[live.index(place)], cut).result(timeout=60)

    save(2, WRITTEN)
    reformed = (0, 3, 3, 2)
    save(1, reformed)  # layers 0-2
    save(2, reformed)  # layers 3-5: beside stage2
    save(3, WRITTEN)   # place 3's writer (another pipeline, not re-formed): layers 6, 7
    assert (checkpoint_dir(root, ITERATION, 2).parent / "stage2.layers3-5" / MANIFEST).is_file()
    assert latest_complete(root, 4, LAYERS) == ITERATION
    save(2, reformed)  # a second re-run finds both complete: nothing rewritten
    assert sorted(p.name for p in checkpoint_dir(root, ITERATION, 2).parent.iterdir()) == \
        ["stage1", "stage2", "stage2.layers3-5", "stage3"]
    fresh = model(1)
    restored = stages(fresh, WRITTEN)
    for s, (module, optimizer) in enumerate(restored):
        restore(root, ITERATION, s, module, optimizer, WRITTEN)
    assert same(per_layer(fresh, restored)[:LAYERS], per_layer(net, held)[:LAYERS])
