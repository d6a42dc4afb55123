"""Which modules of a model are mixture-of-experts experts, and what the model says of its routing.

Read by expert parallelism (parallel/experts.py) and by the planner and memory estimator (planning/),
which must not load FSDP2 or DTensor to read a model's shape: this module needs torch.nn alone.
"""

from __future__ import annotations

import inspect

import torch.nn as nn

EXPERT_ARGUMENTS = ("top_k_index", "top_k_weights")
"""What an experts module's forward takes beside the tokens (transformers 5's experts interface)."""


def is_experts_module(module: nn.Module) -> bool:
    """True for a module that holds every expert's weights and routes by `top_k_index`/`top_k_weights`."""
    try:
        parameters = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    return all(name in parameters for name in EXPERT_ARGUMENTS) and any(
        True for _ in module.parameters(recurse=False)
    )


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every experts module of `model`, in model order."""
    return [(name, module) for name, module in model.named_modules() if is_experts_module(module)]


def check_expert_parallel(model: nn.Module, ep_size: int) -> list[tuple[str, nn.Module]]:
    """The experts modules `ep_size` divides, or a ValueError naming what cannot be divided and why.

    A pure function of the model: every process reaches the same verdict before any communication.
    """
    found = find_experts(model)
    if not found:
        lists = [name for name, m in model.named_modules() if name.endswith("experts")]
        seen = f" It has {', '.join(lists[:3])}, but as separate expert modules." if lists else ""
        raise ValueError(
            f"ep_size={ep_size}: {type(model).__name__} has no experts module unison can divide.{seen} "
            "Expert parallelism recognises a module holding every expert's weights as tensors of "
            "[experts, ...] whose forward takes (hidden_states, top_k_index, top_k_weights), as "
            "transformers 5's mixtures of experts (Mixtral, Qwen2-MoE, OLMoE, ...) and examples/gpt's "
            "MoE block have. Drop ep_size, or use such a module (docs/expert-parallel.md)."
        )
    for name, module in found:
        experts = {p.shape[0] if p.dim() >= 2 else None for p in module.parameters(recurse=False)}
        if len(experts) != 1 or None in experts:
            shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in module.named_parameters(recurse=False))
            raise ValueError(
                f"ep_size={ep_size}: {name} ({type(module).__name__}) has parameters {shapes}, which do not "
                "all lead with the number of experts, so they cannot be divided by expert. Expert "
                "parallelism needs every parameter of an experts module to be [experts, ...]."
            )
        (count,) = experts
        if count % ep_size:
            raise ValueError(
                f"ep_size={ep_size} does not divide the {count} experts of {name}: each process of an EP "
                f"group holds the same number of experts. Choose an ep_size that divides {count}."
            )
    return found


_TOP_K_NAMES = ("num_experts_per_tok", "moe_top_k", "num_experts_per_token", "top_k", "n_activated_experts")
"""Where transformers configs (and MoE blocks) keep the number of experts each token goes to."""


def experts_per_token(model: nn.Module) -> int | None:
    """How many experts each token is sent to (top-k), from the model's config or its MoE blocks."""
    config = getattr(model, "config", None)
    for source in (config, *model.modules()):
        for name in _TOP_K_NAMES:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
