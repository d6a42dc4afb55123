"""A prepared optimizer behaves as a torch.optim.Optimizer in what users and libraries do with one."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from unison import Accelerator

pytestmark = pytest.mark.usefixtures("fresh_state")


def test_hooks_deepcopy_and_pickle_of_a_prepared_optimizer():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    post = optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    optimizer.register_state_dict_pre_hook(lambda opt: calls.append("state_dict"))
    optimizer.register_load_state_dict_post_hook(lambda opt: calls.append("loaded"))
    for _ in range(4):  # two windows of two micro-steps: the hooks run at the two real steps only
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
    assert calls == ["pre", "post", "pre", "post"]
    post.remove()
    optimizer.load_state_dict(optimizer.state_dict())
    assert calls[4:] == ["state_dict", "loaded"]

    twin = copy.deepcopy(optimizer)
    assert twin.optimizer is not optimizer.optimizer and twin.param_groups[0]["lr"] == 0.1
    momentum = next(iter(optimizer.state.values()))["momentum_buffer"]
    assert torch.equal(next(iter(twin.state.values()))["momentum_buffer"], momentum)
    assert pickle.loads(pickle.dumps(optimizer)).param_groups[0]["momentum"] == 0.9


def test_backward_outside_accumulate_with_accumulation_steps_warns_once(caplog):
    """Outside accumulate() nothing counts micro-steps: the optimizer steps on every micro-batch with
    a loss divided by k. The user hears it once; inside accumulate() nothing is said."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with caplog.at_level("WARNING", logger="unison"):
        for _ in range(4):  # one whole window, as documented: nothing to say
            with accelerator.accumulate(model):
                accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
        assert not caplog.records
        for _ in range(2):
            before = model.weight.detach().clone()
            accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            assert not torch.equal(model.weight, before)  # what the warning says: a step per micro-batch
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "gradient_accumulation_steps=4" in warnings[0], warnings
    assert "accelerator.accumulate(model)" in warnings[0]
