"""Context parallelism: the sequence split over a group of ranks, attention by ring or Ulysses.

:class:`ContextParallel` (:mod:`.attention`) is what ``parallelize`` installs; :mod:`.ring`
and :mod:`.ulysses` are the two attention algorithms, :mod:`.blocks` the block maths they share.
"""

from .attention import ContextParallel
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["ContextParallel", "ring_attention", "ulysses_attention"]
