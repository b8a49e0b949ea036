"""Weight sync through Ray's object store: the trainer returns a ``Weights`` snapshot from a call,
Ray moves its numpy arrays (zero-copy on the same node), and the receiver applies them between two
of its calls, so a forward pass never sees a mix of two versions."""

from __future__ import annotations

import warnings

import torch

from relayrl.types import Weights


def snapshot(model: torch.nn.Module, version: int) -> Weights:
    """Copy every parameter and persistent buffer into numpy arrays tagged with ``version``."""
    return Weights(
        version=version,
        tensors={name: t.detach().cpu().numpy().copy() for name, t in model.state_dict().items()},
    )


def apply(model: torch.nn.Module, weights: Weights) -> None:
    """Load a snapshot into ``model`` in place; every name must match."""
    with warnings.catch_warnings():
        # Ray hands out read-only views of the object store; load_state_dict only reads them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        state = {name: torch.from_numpy(array) for name, array in weights.tensors.items()}
    model.load_state_dict(state, strict=True)
