"""unison.planning.stages: the cost model's closed-form stage split is the pipeline's own split (its dynamic
programme, unison.parallel.pipeline_split), block for block."""

from __future__ import annotations

import pytest

from unison.parallel.pipeline_split import _balance
from unison.planning.stages import slowest_device_blocks, stage_blocks


def pipeline_split(layers: int, stages: int, end_weight: float) -> list[int]:
    unit = 1000
    weights = [unit] * layers
    weights[0] += round(end_weight * unit)
    weights[-1] += round(end_weight * unit)
    starts = [*_balance(weights, stages), layers]
    return [b - a for a, b in zip(starts, starts[1:])]


def test_the_closed_form_cuts_as_the_pipelines_split_does():
    cases = 0
    for layers in (4, 10, 24, 44, 60, 96, 105):
        for stages in (2, 3, 5, 8, 12, 31, 35):
            for end_weight in (0.0, 0.34, 1.0, 4.17):
                if stages <= layers:
                    assert list(stage_blocks(layers, stages, end_weight)) == pipeline_split(
                        layers, stages, end_weight
                    ), (layers, stages, end_weight)
                    cases += 1
    assert cases > 150


def test_a_stage_count_that_does_not_divide_the_blocks_runs_at_its_fullest_stages_pace():
    # 96 blocks over 31 stages (OPT-175B's depth on 992 devices at TP 8): some stages hold 4, the mean is
    # 3.1, so the pipeline runs 4 / 3.1 = 1.29x slower than its average stage
    assert max(stage_blocks(96, 31, 0.34)) == 4
    assert slowest_device_blocks(96, 31, 1, 0.34, 0.34) == 4
    # 32 stages divide them: 3 blocks each, the output layer beside the last stage's
    assert stage_blocks(96, 32, 0.34) == (3,) * 32
    assert slowest_device_blocks(96, 32, 1, 0.34, 0.34) == pytest.approx(3.34)
    # interleaved: device d holds stages d and d + p; the output layer rides on the last stage
    assert slowest_device_blocks(12, 2, 2, 0.0, 0.5) == pytest.approx(6.5)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="stages=0"):
        stage_blocks(4, 0, 0.0)
