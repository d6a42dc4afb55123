"""The GPU paths in one process: device choice, batches on the GPU, bf16 and fp16 training.

Skipped where no CUDA device is visible (CI); run on a GPU machine with `python -m pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch
from slowness import budget
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, AcceleratorState, GradientState, PartialState

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("fresh_state"),
]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))


def make_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)


def train(accelerator: Accelerator, epochs: int = 3) -> tuple[list[float], nn.Module]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader())
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            assert x.device == accelerator.device and y.device == accelerator.device
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return losses, accelerator.unwrap_model(model)


def test_one_process_picks_the_gpu():
    accelerator = Accelerator()
    assert accelerator.device == torch.device("cuda", 0)
    assert accelerator.num_processes == 1


def test_fp32_on_gpu_matches_the_cpu():
    gpu_losses, gpu_model = train(Accelerator())
    for state in (AcceleratorState, PartialState, GradientState):
        state._reset_state()
    cpu_losses, cpu_model = train(Accelerator(cpu=True))
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-3, abs=1e-4)
    for gpu_param, cpu_param in zip(gpu_model.parameters(), cpu_model.parameters()):
        assert torch.allclose(gpu_param.cpu(), cpu_param, atol=1e-4)


@pytest.mark.parametrize("mixed_precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_on_gpu_learns(mixed_precision, dtype):
    accelerator = Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=2)
    seen = []
    probe = make_model()
    probe[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    accelerator.prepare(probe)(torch.randn(4, 16, device=accelerator.device))
    assert seen == [dtype]
    losses, model = train(accelerator, epochs=6)
    assert losses[-1] < 0.1 * losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (accelerator.scaler is not None) == (mixed_precision == "fp16")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs")
def test_legacy_data_parallel_matches_one_gpu():
    """parallelism='dataparallel': nn.DataParallel over every visible GPU gives one GPU's numbers."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).cuda()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model.load_state_dict(reference.state_dict())
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    accelerator = Accelerator(parallelism="dataparallel")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=16))
    assert isinstance(model, nn.DataParallel)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    for got, want in zip(model.module.parameters(), reference.parameters(), strict=True):
        assert (got - want).abs().max().item() < 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs")
def test_cuda_rng_synchronisation_gives_each_process_process_0s_device_state(tmp_path):
    import json
    import subprocess
    import sys

    from launching import REPO_ROOT, WORKERS

    command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", "2"]  # on the GPUs: no --cpu
    result = subprocess.run(
        [*command, str(WORKERS / "cuda_rng_worker.py"), str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=budget(300),
    )
    assert result.returncode == 0, result.stderr
    drawn = [json.loads((tmp_path / f"rank{rank}.json").read_text())["drawn"] for rank in range(2)]
    assert drawn[0] == drawn[1]
