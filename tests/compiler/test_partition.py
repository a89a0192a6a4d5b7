"""Plans that fix which layers each stage holds (`schedcomp.partition`): format and checks."""

from __future__ import annotations

import dataclasses

import pytest

from schedcomp import compile
from schedcomp.check import check
from schedcomp.errors import PlanFormatError, ValidationError
from schedcomp.ir import Plan
from schedcomp.partition import as_partition, even, spans, stage_of_layer


def test_spans_and_stage_of_layer_agree() -> None:
    partition = (2, 1, 3)
    assert spans(partition) == (range(0, 2), range(2, 3), range(3, 6))
    assert stage_of_layer(partition) == (0, 0, 1, 2, 2, 2)
    assert even(10, 4) == (3, 3, 2, 2)


@pytest.mark.parametrize("value", [[1, 2], [1, 0, 2], [1, 2.0, 3], [True, 1, 1], "123", None])
def test_a_bad_partition_is_refused_in_one_line(value: object) -> None:
    with pytest.raises(PlanFormatError) as exc:
        as_partition(value, 3)
    assert "\n" not in str(exc.value) and "layer" in str(exc.value)


def test_a_plan_with_a_partition_round_trips_as_version_3() -> None:
    plan = dataclasses.replace(compile(pp=4, dp=2, microbatches=4, failed=["1:2"]), partition=(3, 2, 1, 2))
    text = plan.to_json()
    assert '"version": 3' in text and '"partition": [3, 2, 1, 2]' in text
    assert Plan.from_json(text) == plan
    assert Plan.from_json(compile(pp=4, dp=2, microbatches=4).to_json()).partition is None


def test_a_partition_without_version_3_or_of_the_wrong_length_is_refused() -> None:
    plan = dataclasses.replace(compile(pp=4, dp=1, microbatches=4), partition=(1, 1, 1, 1))
    text = plan.to_json()
    with pytest.raises(PlanFormatError, match="version-3"):
        Plan.from_json(text.replace('"version": 3', '"version": 1'))
    with pytest.raises(PlanFormatError, match="4 stages"):
        Plan.from_json(text.replace('"partition": [1, 1, 1, 1]', '"partition": [1, 1, 1]'))
    with pytest.raises(ValidationError, match="partition"):
        check(dataclasses.replace(plan, partition=(1, 1)))
