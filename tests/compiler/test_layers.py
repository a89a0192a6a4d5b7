"""Per-layer costs (`schedcomp.layers`): sums per stage, the static-memory limit rule, the file format."""

from __future__ import annotations

import json

import pytest

from schedcomp.costs import CostModel
from schedcomp.errors import CostModelError, MemoryLimitError
from schedcomp.layers import LayerCosts, moved_limit, stage_costs
from schedcomp.topology import Worker


def _layers() -> LayerCosts:
    costs = CostModel(forward=[1.0, 2.0, 3.0, 4.0, 5.0], backward_input=[2.0, 2.0, 2.0, 2.0, 2.0],
                      backward_weight=[0.5, 0.5, 1.0, 1.0, 1.0], allreduce=[0.1] * 5, optimizer=[0.2] * 5,
                      activation=[1.0, 3.0, 1.0, 1.0, 2.0], b_frees=[1.0, 0.0, 0.5, 0.5, 0.5], p2p=0.05)
    return LayerCosts(costs, static=(1.0, 2.0, 3.0, 4.0, 5.0))


def test_stage_costs_sum_each_stages_layers() -> None:
    stage = stage_costs(_layers(), (2, 3))
    assert stage.forward == (3.0, 12.0) and stage.backward_input == (4.0, 6.0)
    assert stage.backward_weight == (1.0, 3.0) and stage.activation == (4.0, 4.0)
    assert stage.allreduce == pytest.approx((0.2, 0.3)) and stage.optimizer == pytest.approx((0.4, 0.6))
    # B frees the activation-weighted mean: (1 * 1.0 + 3 * 0.0) / 4 at stage 0, (1 + 1 + 2) * 0.5 / 4 at 1.
    assert stage.b_frees == (0.25, 0.5)
    assert stage.p2p == 0.05 and stage.memory_limit is None


def test_even_layers_give_back_the_stage_model() -> None:
    unit = CostModel.uniform(4, p2p=0.1, allreduce=0.4)
    layers = LayerCosts.even(unit, 4)
    assert layers.layers == 16 and layers.costs.forward[0] == 0.25 and layers.static == (0.0,) * 16
    again = stage_costs(layers, (4, 4, 4, 4))
    assert again.forward == unit.forward and again.activation == unit.activation
    assert again.allreduce == pytest.approx(unit.allreduce)


def test_the_limit_moves_with_the_static_memory() -> None:
    layers = _layers()
    job = stage_costs(layers, (2, 3)).with_memory_limit([10.0, 20.0])
    # Stage 0 takes layer 2 (static 3): its room for activations shrinks by 3; stage 1 gains it.
    assert moved_limit(layers, (3, 2), job, (2, 3)) == (7.0, 23.0)
    costs = stage_costs(layers, (3, 2), limit_from=(job, (2, 3)))
    assert costs.memory_limit == (7.0, 23.0)
    assert stage_costs(layers, (3, 2), limit_from=(job.with_memory_limit(None), (2, 3))).memory_limit is None
    # Stage 0 holding four layers: static 10 more than 1 + 2, so 10 - 7 = 3 is left, below its 6 of activations.
    with pytest.raises(MemoryLimitError, match="stage 0"):
        moved_limit(layers, (4, 1), job, (2, 3))
    # A pipeline running half micro-batches needs room for half of them: 3 holds 6 / 2 (the limit is the same).
    assert moved_limit(layers, (4, 1), job, (2, 3), piece=0.5) == (3.0, 27.0)
    with pytest.raises(MemoryLimitError, match=r"one piece's \(0.6 of a micro-batch\) 3.6"):
        moved_limit(layers, (4, 1), job, (2, 3), piece=0.6)


def test_layer_costs_round_trip_through_json(tmp_path) -> None:
    layers = _layers()
    path = tmp_path / "layers.json"
    layers.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "schedcomp-layer-costs" and data["static"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert LayerCosts.load(path) == layers


@pytest.mark.parametrize("change, words", [
    ({"format": "nope"}, "format"),
    ({"version": 9}, "version 9"),
    ({"static": [1.0]}, "static has 1 entries"),
    ({"static": "big"}, "static must be"),
    ({"static": [-1.0] * 5}, "static must hold numbers"),
    ({"forward": [1.0, "x", 1.0, 1.0, 1.0]}, "forward"),
    ({"memory_limit": 4.0}, "no memory_limit"),
    ({"colour": 1}, "unknown cost model key"),
])
def test_bad_layer_cost_files_are_refused_in_one_line(tmp_path, change, words) -> None:
    data = {**_layers().to_dict(), **change}
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CostModelError) as exc:
        LayerCosts.load(path)
    assert words in str(exc.value) and "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_a_stage_cost_model_is_not_taken_for_layer_costs(tmp_path) -> None:
    path = tmp_path / "stages.json"
    CostModel.uniform(4).save(path)
    with pytest.raises(CostModelError, match="--costs"):
        LayerCosts.load(path)


def test_even_layers_keep_the_speed_factors() -> None:
    slow = CostModel(**{**CostModel.uniform(2).__dict__, "speed": {Worker(1, 0): 0.5}})
    assert LayerCosts.even(slow, 3).costs.speed == {Worker(1, 0): 0.5}
    assert stage_costs(LayerCosts.even(slow, 3), (3, 3)).speed == {Worker(1, 0): 0.5}
