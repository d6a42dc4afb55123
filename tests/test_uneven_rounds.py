"""even_batches=False with a loader whose last round is short (drop_last=False, a length that does not
divide): refused at prepare() under every layout whose data-parallel engine torch's Join cannot shadow,
allowed under DDP, which says so when a pass begins outside join_uneven_inputs.

In-process: the round arithmetic of `short_last_round` (checked against what BatchSamplerShard deals)
and the rule of `check_loader_rounds_even` for each layout. One launch of
tests/workers/uneven_rounds_worker.py at 2 processes: the refusals on every rank, ZeRO-3 with a short
last batch but equal counts, DDP inside Join against its one-process reference, and the warning
outside it.
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import WORKERS, launch_ok
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from unison.data.sharding import BatchSamplerShard, short_last_round
from unison.parallel.config import ParallelismConfig
from unison.parallel.join import check_loader_rounds_even


def loader(samples: int, batch_size: int | None = 4, **kwargs) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(samples, 2)), batch_size=batch_size, **kwargs)


class Stream(IterableDataset):
    def __init__(self, length: int | None):
        self.length = length

    def __iter__(self):
        return iter(torch.zeros(self.length or 3, 2))

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("a stream without a length")
        return self.length


def dealt(samples: int, batch_size: int, n: int, split: bool) -> tuple[int, ...]:
    """How many batches BatchSamplerShard gives each process when nothing tops the last round up."""
    batches = BatchSampler(SequentialSampler(range(samples)), batch_size, drop_last=False)
    return tuple(len(list(BatchSamplerShard(batches, n, p, split, even_batches=False))) for p in range(n))


@pytest.mark.parametrize(
    ("samples", "batch_size", "n", "split"),
    [
        (18, 4, 2, False),
        (14, 4, 2, False),
        (17, 2, 4, False),
        (18, 4, 2, True),
        (13, 4, 4, True),
        (9, 2, 2, False),
    ],
)
def test_the_counts_are_what_the_shards_deal(samples, batch_size, n, split):
    short = short_last_round(loader(samples, batch_size), n, split)
    assert short is not None and short.batches == dealt(samples, batch_size, n, split)
    assert short.samples == samples and short.batch_size == batch_size
    round_size = batch_size if split else batch_size * n
    assert (short.round_size, short.last_round) == (round_size, samples % round_size)


def test_what_the_loader_says_decides_the_round():
    assert short_last_round(loader(16), 2, False) is None  # full rounds
    assert short_last_round(loader(18, drop_last=True), 2, False) is None  # the short round is dropped
    assert short_last_round(loader(3), 1, False) is None  # one process has nobody to be even with
    assert short_last_round(loader(5, batch_size=None), 2, False).batches == (3, 2)  # ready-made batches
    custom = DataLoader(TensorDataset(torch.zeros(9, 2)), batch_sampler=[[0, 1], [2], [3, 4, 5]])
    assert short_last_round(custom, 2, False).batches == (2, 1)  # sizes unknown: counts only
    assert short_last_round(custom, 2, False).samples is None
    assert short_last_round(DataLoader(Stream(18), batch_size=4), 2, False).batches == (3, 2)
    assert short_last_round(DataLoader(Stream(None), batch_size=4), 2, False) is None  # cannot know ahead


REFUSED = {  # (layout, processes): what the message says stands in the way
    "zero1": (ParallelismConfig.from_string("zero1"), 2, "ZeRO-1's sharded optimizer step"),
    "zero2": (ParallelismConfig.from_string("zero2"), 2, "FSDP2's collectives"),
    "zero3": (ParallelismConfig.from_string("zero3"), 2, "FSDP2's collectives"),
    "hsdp": (ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, zero_stage=3), 4, "FSDP2's collectives"),
    "dp x tp": (ParallelismConfig(tp_size=2), 4, "FSDP2's collectives"),
    "dp x cp": (ParallelismConfig(cp_size=2), 4, "FSDP2's collectives"),
    "pp x dp": (ParallelismConfig(pp_size=2, dp_shard_size=2), 4, "FSDP2's collectives"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_layouts_join_cannot_shadow_refuse_unequal_counts(name):
    config, processes, engine = REFUSED[name]
    layout = config.validate(processes)
    dp = layout.dp_size  # 2, or 4 under HSDP: 8 * dp + 2 samples leave ranks 1.. one batch fewer than rank 0
    with pytest.raises(ValueError) as error:
        check_loader_rounds_even(loader(8 * dp + 2), layout, False)
    message = str(error.value)
    for part in (
        f"even_batches=False under {layout.describe()}",
        f"{8 * dp + 2} samples in batches of 4 end on a round of 2 samples, not {4 * dp}",
        f"ranks {list(range(1, dp))} get 2 batches and the others 3",
        engine,
        "Keep even_batches=True",
        "drop_last=True",
        f"a multiple of {4 * dp}",
    ):
        assert part in message, (part, message)
    assert check_loader_rounds_even(loader(8 * dp), layout, False) is None
    assert check_loader_rounds_even(loader(8 * dp + 2, drop_last=True), layout, False) is None


def test_equal_counts_with_a_short_last_batch_run_outside_pipelines():
    """14 samples in 4s over 2: two batches each, rank 1's last one of 2 rows. FSDP2's collectives do not
    depend on the batch's rows, so only a pipeline (whose short batch runs a schedule cut by its size)
    refuses it."""
    for config, processes in ((ParallelismConfig.from_string("zero3"), 2), (ParallelismConfig(tp_size=2), 4)):
        assert check_loader_rounds_even(loader(14), config.validate(processes), False) is None
    pipeline = ParallelismConfig(pp_size=2, dp_shard_size=2).validate(4)
    with pytest.raises(ValueError, match="round of 6 samples, not 8.*last batches differ in size"):
        check_loader_rounds_even(loader(14), pipeline, False)


def test_ddp_and_layouts_without_replicas_are_not_refused():
    ddp = ParallelismConfig().validate(2)
    note = check_loader_rounds_even(loader(9, batch_size=2), ddp, False)
    assert "round of 1 sample, not 4" in note and "join_uneven_inputs([model])" in note, note
    assert check_loader_rounds_even(loader(14), ddp, False) is None  # equal counts: nothing to join
    for config in (ParallelismConfig(tp_size=2), ParallelismConfig(pp_size=2)):  # one replica: all read alike
        assert check_loader_rounds_even(loader(18), config.validate(2), False) is None


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("uneven_rounds")
    launch_ok(WORKERS / "uneven_rounds_worker.py", 2, out)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_prepare_refuses_on_every_rank_before_any_collective(records):
    assert records[0]["refused"] == records[1]["refused"]
    for layout, message in records[0]["refused"].items():
        assert "18 samples in batches of 4 end on a round of 2 samples, not 8" in message, (layout, message)
    assert records[0]["wrapped_before_refusal"] == {"zero3": 0, "zero1": 0, "zero2": 0}  # the loader first
    assert [record["after_refusals"] for record in records] == [1.0, 1.0]  # 0 + 1: nothing left unmatched


def test_zero3_runs_a_short_last_batch_with_equal_counts_as_one_process(records):
    for record in records:
        assert record["zero3_short_batch"]["batches"] == 2
        assert record["zero3_short_batch"]["max_param_diff"] < 1e-6, record["zero3_short_batch"]


def test_ddp_inside_join_gives_joins_gradients_and_says_nothing(records):
    for rank, record in enumerate(records):
        join = record["ddp_join"]
        assert join["steps"] == (3 if rank == 0 else 2)
        assert join["max_grad_diff"] < 1e-6 and join["max_param_diff"] < 1e-6, join
        assert join["warnings"] == []


def test_ddp_outside_join_says_once_what_will_wait(records):
    for rank, record in enumerate(records):
        outside = record["ddp_outside_join"]
        assert outside["batches"] == ([3, 3] if rank == 0 else [2, 2])
        assert outside["second"] == []
    (said,) = records[0]["ddp_outside_join"]["first"]  # the main process says it, for all
    assert "ranks [1] get 2 batches and the others 3" in said and "join_uneven_inputs([model])" in said
    assert records[1]["ddp_outside_join"]["first"] == []
