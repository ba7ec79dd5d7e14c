"""Context parallelism's sequence plan: which positions of a sequence each context-parallel rank holds.

The sequence is cut into ``2 * cp`` equal chunks and rank ``r`` keeps chunks ``r`` and
``2 * cp - 1 - r`` (a head and a tail chunk, torchtitan's load balancing for causal
attention: every rank then attends to the same number of earlier positions). Ring attention
relies on that order: within a rank the positions rise, so a rank's own block is causal, and
against another rank's block either the whole query sees the other's head chunk (an earlier
rank) or only the query's tail chunk sees the whole block (a later rank).

Pure maths, no framework: :func:`chunk_plan` and :func:`local_positions` are used by the
torch adapter and by the planner alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["CONTEXT_MODES", "ChunkPlan", "chunk_plan", "local_positions", "check_heads"]

#: How attention is split over the context-parallel group.
CONTEXT_MODES = ("ring", "ulysses")


@dataclass(frozen=True)
class ChunkPlan:
    """The head/tail chunks of one sequence length over ``cp`` ranks."""

    seq_len: int
    """Tokens in the whole sequence."""
    cp: int
    """Context-parallel ranks."""

    @property
    def chunk(self) -> int:
        """Tokens per chunk (``seq_len / (2 cp)``)."""
        return self.seq_len // (2 * self.cp)

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk indices rank ``rank`` holds: its head and its tail."""
        return rank, 2 * self.cp - 1 - rank

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """``[start, end)`` of the rank's head and tail chunks, in that order."""
        c = self.chunk
        return [(i * c, (i + 1) * c) for i in self.chunks_of(rank)]


def chunk_plan(seq_len: int, cp: int) -> ChunkPlan:
    """The plan of ``seq_len`` tokens over ``cp`` ranks; :class:`ConfigError` unless ``2 cp`` divides it."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"cp must be a positive integer, got {cp!r}")
    if seq_len < 2 * cp or seq_len % (2 * cp):
        raise ConfigError(f"a sequence of {seq_len} tokens does not split into 2 x cp={cp} = {2 * cp} equal "
                          f"chunks (context parallelism gives each rank a head and a tail chunk); use a length "
                          f"divisible by {2 * cp}")
    return ChunkPlan(seq_len, cp)


def local_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The global positions rank ``rank`` holds, in its local order (head chunk, then tail chunk)."""
    plan = chunk_plan(seq_len, cp)
    return [p for start, end in plan.ranges(rank) for p in range(start, end)]


def check_heads(heads: int, kv_heads: int, cp: int) -> None:
    """Ulysses splits the attention heads over ``cp``: :class:`ConfigError` unless ``cp`` divides the query
    heads (the key/value heads are repeated where ``cp`` does not divide them)."""
    if heads % cp:
        raise ConfigError(f"Ulysses context parallelism splits the {heads} attention heads over cp={cp}, which "
                          f"does not divide them; use ring attention (context_parallel='ring') or a cp dividing "
                          f"{heads}")
    if kv_heads < 1 or heads % kv_heads:
        raise ConfigError(f"{heads} query heads do not group over {kv_heads} key/value heads")
