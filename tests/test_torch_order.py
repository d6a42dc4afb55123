"""A prepared shuffled loader yields, over all processes of each step, the plain PyTorch loader's
samples in the plain loader's order, with the same seeds (issue: data order as PyTorch's).

The references are computed here, in one process, by plain torch; tests/workers/torch_order_worker.py
runs the same seeding prepared on 1-4 real processes (process 0 seeded like the reference, the
others not), with and without split_batches, under accumulation.
"""

import json

import pytest
import torch
from launching import WORKERS, launch_ok
from torch.utils.data import DataLoader, TensorDataset

SIZE, PER_PROCESS, GLOBAL, EPOCHS = 45, 3, 12, 2  # as in the worker


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"{n}proc")
def run(request, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp(f"torch_order{n}")
    launch_ok(WORKERS / "torch_order_worker.py", n, out)
    return n, [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(n)]


def plain_batches(seeding: str, batch_size: int) -> list:
    """The unprepared loader's batches over EPOCHS passes, in one process."""
    torch.manual_seed(0)
    generator = None
    if seeding == "generator":
        generator = torch.Generator().manual_seed(5)
    elif seeding == "reseeded":
        generator = torch.Generator().manual_seed(1)
    loader = DataLoader(torch.arange(SIZE), batch_size=batch_size, shuffle=True, generator=generator)
    torch.nn.Linear(1, 1)  # the worker's model, built between the loader and the first pass
    if seeding == "reseeded":
        generator.manual_seed(7)
    return [batch.tolist() for _ in range(EPOCHS) for batch in loader]


@pytest.mark.parametrize("seeding", ["global", "generator", "reseeded"])
@pytest.mark.parametrize("split", [False, True])
def test_each_step_holds_the_plain_loaders_batches_in_order(run, seeding, split):
    n, records = run
    plain = plain_batches(seeding, GLOBAL if split else PER_PROCESS)
    per_step = 1 if split else n  # without split_batches a step takes one plain batch per process
    batches_per_epoch = len(plain) // EPOCHS
    expected = []
    for epoch in range(EPOCHS):
        epoch_batches = plain[epoch * batches_per_epoch : (epoch + 1) * batches_per_epoch]
        for start in range(0, len(epoch_batches), per_step):
            expected.append([i for batch in epoch_batches[start : start + per_step] for i in batch])
    for rec in records:
        assert rec["orders"][f"{seeding}-split{int(split)}"] == expected, f"process {records.index(rec)}"


def test_a_plain_training_loop_gives_the_plain_loops_parameters(run):
    n, records = run
    if n == 3:
        pytest.skip("a global batch of 8 does not split over 3 processes")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = torch.arange(48 * 5, dtype=torch.float32).reshape(48, 5).sin()
    loader = DataLoader(TensorDataset(data[:, :4], data[:, 4:]), batch_size=8, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(EPOCHS):
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    expected = torch.cat([p.detach().flatten() for p in model.parameters()])
    for rec in records:
        got = torch.tensor([v for p in rec["parameters"] for v in p])
        assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got - expected).abs().max()


class WorkerSeeds(torch.utils.data.Dataset):
    """Each sample with the seed of the worker process that loaded it."""

    def __len__(self):
        return 10

    def __getitem__(self, index):
        return torch.tensor([index, torch.utils.data.get_worker_info().seed % 2**31])


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_get_the_plain_loaders_seeds_and_the_global_rng_ends_where_it_would(persistent):
    from unison.data import prepare_data_loader

    def passes(prepare: bool) -> tuple[list, torch.Tensor]:
        torch.manual_seed(3)
        loader = DataLoader(
            WorkerSeeds(), batch_size=3, shuffle=True, num_workers=2, persistent_workers=persistent
        )
        if prepare:
            loader = prepare_data_loader(loader, num_processes=1, process_index=0)
        return [batch.tolist() for _ in range(3) for batch in loader], torch.get_rng_state()

    (plain, plain_rng), (prepared, prepared_rng) = passes(False), passes(True)
    assert prepared == plain
    assert torch.equal(prepared_rng, plain_rng)
