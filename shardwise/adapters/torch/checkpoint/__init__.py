"""Checkpoints of torch training: pieces, staging, ZeRO and parallel-model state, DCP conversion.

The public names are in :mod:`shardwise.torch.checkpoint`. This file makes the folder a
regular package, so that ``pip install`` (not only an editable install) ships it.
"""
