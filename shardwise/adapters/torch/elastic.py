"""Horovod's ``hvd.elastic`` for PyTorch: :class:`TorchState`, :class:`ElasticSampler` and :func:`run`.

``TorchState(model, optimizer, sampler=..., epoch=0, batch=0)`` commits each
module's and optimizer's ``state_dict`` by deep copy and brings new workers to
rank 0's state by broadcast. A :class:`~shardwise.torch.DistributedOptimizer`
(global process set) is re-bound to the new world after a reset; a
:class:`~shardwise.torch.ZeroOptimizer` commits its *full* state (gathered from
every shard) and re-partitions it for the new world size.

Under torchrun's elastic agent (``TORCHELASTIC_RUN_ID`` set, no shardwise
rendezvous), which restarts every worker when the job re-forms, :func:`run` keeps
each commit on disk instead and a worker that loses a peer exits so that the agent
re-forms the job (see :mod:`shardwise.elastic.persist`): the commit is stored as
plain data (tensors through :data:`~shardwise.adapters.torch.tensor_codec.TORCH_CODEC`),
so every attribute must be plain data or a tensor (see :meth:`TorchState.to_payload`).
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any, Callable, Iterator, Optional

import torch

from ...checkpoint.plain_state import TensorCodec, check_plain
from ...core.errors import ConfigError
from ...elastic.persist import CommitFile, torchrun_job, torchrun_run_fn
from ...elastic.run import run_fn
from ...elastic.state import ObjectState, broadcast_object
from .functions import broadcast_optimizer_state, broadcast_parameters
from .tensor_codec import TORCH_CODEC
from ...context import current, is_initialized

__all__ = ["TorchState", "ElasticSampler", "run"]


def _world() -> Any:
    return current().world


def _reset(lost: bool) -> None:
    """Horovod's reset: shut down (abruptly if a rank was ``lost``) and initialise again."""
    from .basics import abandon, init, shutdown

    abandon() if lost else shutdown()
    init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: ``func(state, ...)`` survives lost and added workers (see :func:`shardwise.elastic.run_fn`).

    Under torchrun's elastic agent the job survives by restarting: commits go to
    disk and a lost worker ends the process (:func:`shardwise.elastic.persist.torchrun_run_fn`).
    """
    job = torchrun_job()
    if job is not None:
        return torchrun_run_fn(func, job)
    return run_fn(func, _reset)


class ElasticSampler(torch.utils.data.Sampler):
    """Like ``DistributedSampler``, but after a reset it shares only the samples not yet seen this epoch.

    Call :meth:`record_batch` after each batch and :meth:`set_epoch` at the end of
    each epoch; keep the sampler in a :class:`TorchState`. The epoch's order is a
    seeded shuffle, identical on every rank; rank ``r`` of ``n`` takes every n-th of the
    remaining indices, so after a reset no sample is repeated or skipped (the last
    batch is padded with repeats to split evenly, as ``DistributedSampler`` does).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas, self.rank = 1, 0
        self.remaining_indices: list[int] = []
        self.num_samples = self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (call it at the end of the previous one, so a partial epoch is not repeated)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` per rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, count: int) -> None:
        """Count ``count`` samples in total (over every rank) as processed."""
        self.processed_num += count

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.processed_num = int(state["epoch"]), int(state["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Re-split this epoch's remaining indices over the current world."""
        world = current().world if is_initialized() else None
        self.split(*((world.size, world.rank) if world is not None else (1, 0)))

    def split(self, num_replicas: int, rank: int) -> None:
        """Share this epoch's remaining indices among ``num_replicas`` ranks, as rank ``rank``."""
        self.num_replicas, self.rank = num_replicas, rank
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices[:]
        if indices:
            while len(indices) < self.total_size:
                indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """Commit/restore/sync of one tracked object."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Adapt to a new world (before sync)."""


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def restore(self) -> None:
        from .optimizer import DistributedOptimizer

        if isinstance(self.value, DistributedOptimizer):  # drop the step the lost worker interrupted
            self.value.drop_step()
        super().restore()

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)

    def reset(self) -> None:
        from .optimizer import DistributedOptimizer

        if isinstance(self.value, DistributedOptimizer):
            self.value.rebind(_world())


class _ZeroHandler(_Handler):
    """A ZeroOptimizer: the committed copy is the full (unsharded) state, re-split on reset.

    Gathering the full state is collective, so nothing is gathered when the state
    object is built (a worker that joins a running job builds it alone): the first
    :meth:`sync` takes the starting point, later ones hand rank 0's commit to all.
    """

    def save(self) -> None:
        self.saved = self.value.full_state_dict() if hasattr(self, "saved") else None

    def restore(self) -> None:
        if self.saved is not None:
            self.value.load_full_state_dict(self.saved)

    def reset(self) -> None:
        self.value.reshard(_world())

    def sync(self) -> None:
        committed = broadcast_object(self.saved if _world().rank == 0 else None)
        if committed is None:  # the job's first start: every rank is here, none has committed yet
            self.saved = self.value.full_state_dict()
        else:
            self.saved = committed
        self.value.load_full_state_dict(self.saved)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))

    def reset(self) -> None:
        self.value.reset()


def _handler_for(value: Any) -> Optional[_Handler]:
    from .zero import ZeroOptimizer

    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, ZeroOptimizer):
        return _ZeroHandler(value)
    if isinstance(value, torch.optim.Optimizer) or hasattr(value, "synchronizer"):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """A PyTorch training's elastic state: ``model``, ``optimizer`` and any other attributes.

    Modules, optimizers (plain, :class:`~shardwise.torch.DistributedOptimizer` or
    :class:`~shardwise.torch.ZeroOptimizer`) and :class:`ElasticSampler` objects passed
    as keyword arguments are committed through their ``state_dict``; anything else is
    deep-copied like :class:`~shardwise.elastic.ObjectState` does.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(value) if value is not None else None
            if handler is not None:
                handlers[name] = handler
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            if _handler_for(value) is None:
                raise ConfigError(f"TorchState.{name} tracks a {type(handlers[name].value).__name__}; "
                                  f"cannot replace it with a {type(value).__name__}")
            handlers[name] = _handler_for(value)
        object.__setattr__(self, name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def commit(self) -> None:
        """Keep the current state as the one to return to (on disk too under torchrun); check host updates.

        Under torchrun every rank first checks that the state is plain data (see
        :meth:`to_payload`), so that an attribute that is not raises :class:`ConfigError`
        on every rank at once, not on rank 0 alone.
        """
        self.save()
        commits = self.__dict__.get("_commit_file")
        if commits is not None:
            payload = self.to_payload()
            check_plain(payload, commits.codecs)
            if _world().rank == 0:
                commits.save(payload, world_size=_world().size)
        self.check_host_updates()

    @staticmethod
    def payload_codecs() -> tuple[TensorCodec, ...]:
        """How the tensors of :meth:`to_payload` are stored on disk: torch's codec."""
        return (TORCH_CODEC,)

    def persist_to(self, commits: Optional[CommitFile]) -> None:
        """From now on rank 0 also writes each commit to ``commits`` (None: stop)."""
        object.__setattr__(self, "_commit_file", commits)

    def to_payload(self) -> dict[str, Any]:
        """The last commit: each tracked object's committed state and the plain attributes.

        Under torchrun this is written to disk as plain data
        (:mod:`shardwise.checkpoint.plain_state`): dicts with str or int keys, lists,
        tuples, str, int, float, bool, None, torch tensors and numpy arrays. Any other
        attribute value is refused at :meth:`commit` with a :class:`ConfigError` naming it
        (store such an object's ``state_dict()`` instead). A ZeroOptimizer's entry is its
        full (unsharded) state, ``None`` before its first commit.
        """
        return {"tracked": {name: handler.saved for name, handler in self._handlers.items()},
                "attributes": dict(self._saved_state)}

    def from_payload(self, payload: dict[str, Any]) -> None:
        """Make ``payload`` (from :meth:`to_payload`, maybe of another world size; read from disk its tensors
        are on the CPU) the last commit, and return to it."""
        tracked, attributes = payload["tracked"], payload["attributes"]
        if set(tracked) != set(self._handlers) or set(attributes) != set(self._saved_state):
            raise ConfigError(f"the stored commit holds {sorted(tracked)} and attributes {sorted(attributes)}, "
                              f"this TorchState {sorted(self._handlers)} and {sorted(self._saved_state)}")
        for name, handler in self._handlers.items():
            handler.saved = tracked[name]
        self._saved_state = dict(attributes)
        self.restore()
