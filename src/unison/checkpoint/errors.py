"""The error of a checkpoint that cannot be loaded as asked, and the messages that say why."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete or damaged, or an object in it cannot be loaded safely."""


def describe_keys(missing: list[str], unexpected: list[str]) -> str:
    """How a saved state dict and the live object's keys differ (up to five keys of each kind), for errors
    that name the keys as torch's load_state_dict(strict=True) does."""

    def shown(keys: list[str]) -> str:
        return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

    parts = [f"has no {shown(missing)}"] if missing else []
    parts += [f"holds {shown(unexpected)}, which the model has not"] if unexpected else []
    return "the checkpoint " + " and ".join(parts)


def model_keys_error(missing: list[str], unexpected: list[str]) -> CheckpointError:
    """The error of a strict load (load_state's default) into a model whose keys are not the checkpoint's."""
    return CheckpointError(
        f"{describe_keys(missing, unexpected)}: it was saved from another model. Load it into the model of "
        "the run that saved it, or pass load_state(..., strict=False) to load the weights both have."
    )


def check_shapes(name: str, live: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """Raise CheckpointError if a tensor of the state dict `saved` (the file `name`) has another shape than
    the live one of its key. torch's load_state_dict copies the tensors that fit before it raises for
    the others, leaving a model half loaded; checked first, nothing is applied."""
    differ = [
        f"{key} is {list(value.shape)} there, {list(live[key].shape)} here"
        for key, value in saved.items()
        if key in live
        and hasattr(value, "shape")
        and hasattr(live[key], "shape")
        and tuple(value.shape) != tuple(live[key].shape)
    ]
    if differ:
        shown = "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise CheckpointError(
            f"{name} holds tensors of other shapes than the model's ({shown}): it was saved from another "
            "model (another size or configuration). Load it into the model of the run that saved it; "
            "strict=False does not help, a tensor cannot be loaded into another shape."
        )
