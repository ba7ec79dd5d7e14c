"""The ``tf`` backend: TensorFlow's collective ops (the engine of tf.distribute).

:func:`init` starts TensorFlow's collective runtime over every rank (before any other
TensorFlow op); :class:`TFCommunicator` runs shardwise's collectives on it.
"""

from ._runtime import start as init
from .communicator import TFCommunicator

__all__ = ["TFCommunicator", "init"]
