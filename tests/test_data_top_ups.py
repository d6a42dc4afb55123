"""What a completed pass topped up (unison.data.top_ups), in one process: the arithmetic against the
shards' own batches, the rule gather_for_metrics applies after the loop, and what prepared loaders
note. The real 2- and 3-process runs are in test_accelerator.py (gather_after_the_loop)."""

import pytest
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from unison import GradientState
from unison.data import BatchSamplerShard, prepare_data_loader
from unison.data.top_ups import KEPT_PASSES, CompletedPass, completed_pass, note_pass, rows_to_keep


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_dropping_each_processes_top_ups_leaves_every_sample_once(n, split):
    """Every process's rows of a pass, concatenated in process order, less the noted repeats at the end
    of each process's part: exactly the dataset (the single-process truth), for every size."""
    for batch_size in (n, 2 * n) if split else (1, 2, 3):
        for size in range(1, 5 * n * batch_size):
            base = BatchSampler(SequentialSampler(range(size)), batch_size, False)
            shards = [BatchSamplerShard(base, n, p, split_batches=split) for p in range(n)]
            held = [[i for batch in shard for i in batch] for shard in shards]
            per_process = shards[0].process_batch_size
            noted = completed_pass(len(list(shards[0])), n, per_process, shards[0].remainder)
            assert noted.rows == len(held[0]) and all(len(rows) == noted.rows for rows in held)
            kept = [i for rows, top_up in zip(held, noted.top_ups) for i in rows[: noted.rows - top_up]]
            assert sorted(kept) == list(range(size)), (size, batch_size, noted)


def test_completed_pass_of_one_process_or_no_batch_is_not_noted():
    assert completed_pass(4, 1, 2, -1) is None
    assert completed_pass(0, 2, 2, -1) is None
    assert completed_pass(3, 2, 4, -1) == CompletedPass(12, (0, 0))
    assert completed_pass(4, 3, 2, 1) == CompletedPass(8, (1, 2, 2))


THIRTEEN = CompletedPass(8, (1, 2))  # 13 rows, batches of 2, 2 processes
SIXTEEN = CompletedPass(8, (0, 0))  # 16 rows: as many per process, nothing repeated
FOURTEEN = CompletedPass(8, (0, 2))


@pytest.mark.parametrize("running", [[], [2], [4, 3]], ids=["after", "in_a_loop", "in_nested_loops"])
def test_rows_to_keep_drops_each_processes_tail_and_marks_the_pass(running):
    """After the loop, or inside loops whose batches have another size (evaluation during training)."""
    noted = CompletedPass(8, (1, 2))
    verdict = rows_to_keep([noted, CompletedPass(6, (0, 0))], 8, 16, running)
    assert verdict.keep == (slice(0, 7), slice(8, 14)) and verdict.warning is None
    assert noted.gathered


@pytest.mark.parametrize(
    "passes,rows,gathered,running",
    [
        ([], 8, 16, []),  # nothing noted
        ([THIRTEEN], 7, 14, []),  # another length
        ([THIRTEEN], None, 16, []),  # leaves of several lengths, or 0-d
        ([THIRTEEN], 8, 24, []),  # another number of processes
        ([SIXTEEN], 8, 16, []),  # the pass repeated nothing
    ],
)
def test_rows_to_keep_keeps_all_silently_where_no_pass_with_repeats_fits(passes, rows, gathered, running):
    verdict = rows_to_keep([CompletedPass(p.rows, p.top_ups) for p in passes], rows, gathered, running)
    assert verdict.keep is None and verdict.warning is None


@pytest.mark.parametrize(
    "passes,running,said",
    [
        ([THIRTEEN, SIXTEEN], [], "[0, 0], [1, 2]"),
        ([THIRTEEN, FOURTEEN], [], "[0, 2], [1, 2]"),
        ([THIRTEEN], [8], "batches of 8 rows is being iterated"),
        ([THIRTEEN], [None], "batches of unknown size"),
    ],
)
def test_rows_to_keep_keeps_all_and_says_why_where_the_length_is_ambiguous(passes, running, said):
    passes = [CompletedPass(p.rows, p.top_ups) for p in passes]
    verdict = rows_to_keep(passes, 8, 16, running)
    assert verdict.keep is None
    assert said in verdict.warning and "got 8 rows per process" in verdict.warning
    assert "all 16 gathered rows" in verdict.warning and "as Accelerate does" in verdict.warning
    assert "call gather_for_metrics on each batch inside the evaluation loop" in verdict.warning
    assert not any(p.gathered for p in passes)


def test_note_pass_replaces_retires_the_gathered_and_keeps_the_latest():
    passes: dict = {}
    loaders = [object() for _ in range(KEPT_PASSES + 2)]
    note_pass(passes, loaders[0], CompletedPass(8, (1, 2)))
    note_pass(passes, loaders[0], CompletedPass(6, (0, 2)))  # its next pass replaces it
    assert list(passes.values()) == [CompletedPass(6, (0, 2))]
    passes[id(loaders[0])].gathered = True
    note_pass(passes, loaders[1], None)  # another loader's pass begins: the gathered one is retired
    assert passes == {}
    for loader in loaders:
        note_pass(passes, loader, CompletedPass(4, (0, 1)))
    assert list(passes) == [id(loader) for loader in loaders[-KEPT_PASSES:]]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(13))

    def __len__(self):
        return 13


def two_processes(loader: DataLoader, process_index: int = 0, **options):
    return lambda: prepare_data_loader(loader, num_processes=2, process_index=process_index, **options)


@pytest.mark.parametrize(
    "make,noted",
    [
        (two_processes(DataLoader(range(13), batch_size=2)), CompletedPass(8, (1, 2))),
        (two_processes(DataLoader(range(13), batch_size=4), 1, split_batches=True), CompletedPass(8, (1, 2))),
        (
            two_processes(DataLoader(Stream(), batch_size=2), dispatch_batches=False),
            CompletedPass(8, (1, 2)),
        ),
        (two_processes(DataLoader(range(13), batch_size=2, drop_last=True)), CompletedPass(6, (0, 0))),
        (two_processes(DataLoader(range(13), batch_size=2), even_batches=False), None),
        (two_processes(DataLoader(range(13), batch_size=None)), None),  # ready-made batches, sizes unknown
        (lambda: prepare_data_loader(DataLoader(range(13), batch_size=2)), None),  # one process
    ],
    ids=["shard", "split", "iterable_shard", "drop_last", "uneven", "ready_made", "one_process"],
)
def test_a_prepared_loaders_complete_pass_is_noted(fresh_state, make, noted):
    loader = make()
    passes = GradientState().completed_passes
    for _ in loader:
        assert id(loader) not in passes  # noted once complete
    assert passes.get(id(loader)) == noted
    for _ in loader:  # a pass broken off forgets the one before and is not noted
        assert id(loader) not in passes
        break
    assert id(loader) not in passes
