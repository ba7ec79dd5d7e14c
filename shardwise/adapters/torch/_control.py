"""Where shardwise puts the small int64 tensors that ranks exchange to agree on what comes next."""

from __future__ import annotations

import torch

from shardwise.core.comm import Communicator

__all__ = ["control_device"]


def control_device(comm: Communicator, data_device: torch.device) -> torch.device:
    """The device for control tensors next to data on ``data_device``.

    The host, where the communicator reads host memory (mpi, gloo): no device round trip and
    no wait on the device's queue. The data's own device for CUDA data on the ``torch``
    backend, whose NCCL groups move device memory only.
    """
    if data_device.type == "cuda" and comm.backend == "torch":
        return data_device
    return torch.device("cpu")
