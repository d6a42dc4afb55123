"""Mixed precision in one process: bf16 and fp16 autocast on the CPU, and the fp16 loss scaler."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from slowness import budget
from torch import nn

from unison import (
    Accelerator,
    AcceleratorState,
    AutocastKwargs,
    GradientState,
    GradScalerKwargs,
    PartialState,
)

# Each test builds its own Accelerator (one precision per process), so each starts from no state.
pytestmark = pytest.mark.usefixtures("fresh_state")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True)


def train(mixed_precision: str, steps: int) -> tuple[list[float], nn.Module]:
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = make_batch()
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, accelerator.unwrap_model(model)


@pytest.mark.parametrize("mixed_precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_prepared_model_computes_in_low_precision_and_returns_fp32(mixed_precision, dtype):
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True)
    model = make_model()
    seen = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    model = accelerator.prepare(model)
    output = model(make_batch()[0])
    assert seen == [dtype]
    assert output.dtype == torch.float32
    with accelerator.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
    # Outside the prepared forward and autocast(), computation is full precision again.
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_bf16_training_follows_fp32_and_learns():
    fp32_losses, fp32_model = train("no", 30)
    for state in (AcceleratorState, PartialState, GradientState):
        state._reset_state()
    bf16_losses, bf16_model = train("bf16", 30)
    assert bf16_losses[-1] < 0.2 * bf16_losses[0]
    assert bf16_losses[-1] == pytest.approx(fp32_losses[-1], rel=0.1, abs=0.02)
    for p32, p16 in zip(fp32_model.parameters(), bf16_model.parameters()):
        assert p16.dtype == torch.float32  # master weights stay fp32
        assert torch.allclose(p32, p16, atol=0.05)


def test_fp16_scales_the_loss_and_clip_unscales_before_measuring():
    # A moderate initial scale keeps the scaled fp16 gradients finite (65536 would overflow here).
    accelerator = Accelerator(
        mixed_precision="fp16", cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=1024)]
    )
    assert accelerator.scaler.get_scale() == 1024
    model = make_model()
    reference = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = make_batch()
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    scaled = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1e9)
    nn.functional.mse_loss(reference(x), y).backward()
    reference_norm = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).norm()
    assert scaled == pytest.approx(accelerator.scaler.get_scale() * reference_norm.item(), rel=0.02)
    assert norm.item() == pytest.approx(reference_norm.item(), rel=0.02)


def test_fp16_overflow_skips_optimizer_and_scheduler_steps():
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = make_batch()
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    next(model.parameters()).grad[0, 0] = float("inf")
    optimizer.step()
    scheduler.step()
    assert accelerator.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scheduler.get_last_lr() == [0.05]
    optimizer.zero_grad()
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    scheduler.step()
    assert not accelerator.optimizer_step_was_skipped
    assert scheduler.get_last_lr() == [0.025]


def test_scheduler_steps_per_call_when_not_tied_to_the_optimizer():
    accelerator = Accelerator(gradient_accumulation_steps=2, step_scheduler_with_optimizer=False, cpu=True)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    x, y = make_batch()
    for _ in range(4):
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    assert scheduler.get_last_lr() == [1.0 / 2**4]


def test_autocast_takes_an_autocast_handler_for_the_block_as_accelerate_does():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    x = torch.randn(2, 2)
    with accelerator.autocast():
        assert (x @ x).dtype == torch.bfloat16
    with accelerator.autocast(AutocastKwargs(enabled=False)):  # full precision for this block only
        assert (x @ x).dtype == torch.float32
    with accelerator.autocast(AutocastKwargs(cache_enabled=False)):
        assert (x @ x).dtype == torch.bfloat16 and not torch.is_autocast_cache_enabled()
    with pytest.raises(TypeError, match=r"autocast\(False\): pass an AutocastKwargs"):
        accelerator.autocast(False)  # a bool would be a handler that is always "true"


class ReturnsItsLoss(nn.Module):
    """Hugging Face's convention with labels: a mapping with the model's own loss beside the logits."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x, labels=None):
        logits = self.proj(x)
        output = {"logits": logits, "hidden": [logits * 2]}
        if labels is not None:
            output["loss"] = nn.functional.cross_entropy(logits, labels)
        return output


@pytest.mark.parametrize(
    "convert, with_labels, logits_dtype",
    [
        (None, True, torch.bfloat16),  # the model computed its loss: its logits stay as computed
        (None, False, torch.float32),  # a loss computed outside the model gets fp32 logits, as Accelerate
        (True, True, torch.float32),
        (False, False, torch.bfloat16),
    ],
)
def test_convert_outputs_to_fp32_keeps_big_outputs_half_when_the_model_returned_its_loss(
    convert, with_labels, logits_dtype
):
    accelerator = Accelerator(mixed_precision="bf16", cpu=True, convert_outputs_to_fp32=convert)
    model = accelerator.prepare(ReturnsItsLoss())
    x, labels = torch.randn(4, 8), torch.tensor([1, 2, 3, 4])
    output = model(x, labels) if with_labels else model(x)
    assert output["logits"].dtype == output["hidden"][0].dtype == logits_dtype
    if with_labels:
        expected = torch.float32 if convert is not False else output["loss"].dtype
        assert output["loss"].dtype == expected
        output["loss"].backward()  # the converted loss still reaches the weights
        assert model.proj.weight.grad is not None


class ReturnsLogitsAndLoss(nn.Module):
    """nanoGPT's convention: (logits, loss), the loss None without targets."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 5)

    def forward(self, x, labels=None):
        logits = self.proj(x)
        return logits, None if labels is None else nn.functional.cross_entropy(logits, labels)


@pytest.mark.parametrize("convert", [None, True])
def test_a_tuple_with_a_scalar_loss_keeps_its_logits_half_by_default(convert):
    accelerator = Accelerator(mixed_precision="bf16", cpu=True, convert_outputs_to_fp32=convert)
    model = accelerator.prepare(ReturnsLogitsAndLoss())
    x, labels = torch.randn(4, 8), torch.tensor([1, 2, 3, 4])
    logits, loss = model(x, labels)
    assert loss.dtype == torch.float32
    assert logits.dtype == (torch.bfloat16 if convert is None else torch.float32)
    assert model(x)[0].dtype == torch.float32  # no loss inside: the loss computed outside gets fp32 logits


def test_convert_outputs_to_fp32_is_refused_unless_true_false_or_none():
    with pytest.raises(ValueError, match=r"convert_outputs_to_fp32='auto'.*True.*False.*None"):
        Accelerator(mixed_precision="bf16", cpu=True, convert_outputs_to_fp32="auto")


def test_a_hugging_face_model_given_labels_keeps_its_logits_in_bf16_and_its_loss_in_fp32():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.prepare(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 64, (2, 8))
    output = model(input_ids=ids, labels=ids)
    assert output.loss.dtype == torch.float32 and output["loss"] is output.loss
    assert output.logits.dtype == torch.bfloat16


def test_fp16_scaler_unscales_plain_and_dtensor_gradients_together():
    """Tensor parallelism leaves norms as plain tensors beside DTensor weights; torch's fused unscale
    refuses that mix, so the scaler unscales each layout separately (an overflow in either skips the step)."""
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from unison.precision import LayoutGroupedGradScaler
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        mesh = init_device_mesh("cpu", (1,))
        plain = torch.nn.Parameter(torch.ones(4))
        sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
        optimizer = torch.optim.SGD([plain, sharded], lr=1.0)
        for overflow in (False, True):
            scaler = LayoutGroupedGradScaler("cpu", init_scale=4.0)
            scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss on
            plain.grad = torch.full((4,), 8.0)
            grad = torch.full((4, 2), float("inf") if overflow else 4.0)
            sharded.grad = distribute_tensor(grad, mesh, [Shard(0)])
            scaler.unscale_(optimizer)
            assert plain.grad.tolist() == [2.0] * 4, plain.grad
            if not overflow:
                assert sharded.grad.full_tensor().eq(1.0).all(), sharded.grad
            before = sharded.detach().full_tensor().clone()
            scaler.step(optimizer)
            scaler.update()
            moved = not torch.equal(sharded.detach().full_tensor(), before)
            scale = scaler.get_scale()
            assert moved != overflow and (scale < 4.0) == overflow, (overflow, scale)
        dist.destroy_process_group()
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=budget(120)
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
