"""Committed elastic state on disk, for launchers that restart every worker (torchrun's elastic agent).

torchrun (``--nnodes=MIN:MAX --rdzv-backend=c10d``) re-forms a job whose membership
changed by stopping *all* its workers and starting new ones: nothing in memory
survives. So under torchrun ``hvd.elastic.run`` keeps the last commit in a file:
rank 0 writes each commit's payload (pickled, written atomically with
:mod:`shardwise.checkpoint.atomic`), and the next incarnation's rank 0 reads it back
and broadcasts it. A worker that sees a peer lost exits with
:data:`RESTART_EXIT_CODE`, which tells its agent to re-form the job.

The directory is ``SHARDWISE_ELASTIC_DIR``, else
``$TMPDIR/shardwise-elastic-<TORCHELASTIC_RUN_ID>`` (a private directory of this
user). With several nodes, rank 0 of the next incarnation may run on another node:
set ``SHARDWISE_ELASTIC_DIR`` to a directory on a file system every node shares (NFS,
Lustre, ...). Commits are pickles: keep the directory writable by this user only
(the default one is created so, and checked). A job that finishes removes its commit; use a fresh ``--rdzv-id`` per job
anyway, or a job that crashed for good would hand its commit to the next job
with the same id. Start torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(``shardwise run --elastic`` does): torchrun's shared store otherwise hands a
re-formed job stale addresses.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, Optional

from ..checkpoint.atomic import atomic_save
from ..core.errors import CollectiveTimeoutError, ConfigError, HostsUpdatedInterrupt, is_peer_loss
from .state import State, broadcast_object, rank

__all__ = ["TorchrunJob", "torchrun_job", "commit_dir", "CommitFile", "RESTART_EXIT_CODE", "exit_for_restart",
           "torchrun_run_fn"]

_LOG = logging.getLogger("shardwise.elastic")

#: Exit status of a worker that leaves so that torchrun's agent re-forms the job (BSD's EX_TEMPFAIL).
RESTART_EXIT_CODE = 75
DIR_ENV = "SHARDWISE_ELASTIC_DIR"
_FORMAT = 1
_FILE = "commit.pkl"


@dataclass(frozen=True)
class TorchrunJob:
    """What torchrun's elastic agent tells a worker about the job and this incarnation of it."""

    run_id: str
    restart_count: int
    max_restarts: int
    group_rank: int
    group_world_size: int
    #: The workers' process groups are wired through the agent's TCPStore (torchrun >= 2.5's default).
    shares_agent_store: bool = False


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    try:
        return int(raw) if raw.strip() else default
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def torchrun_job(env: Optional[Mapping[str, str]] = None) -> Optional[TorchrunJob]:
    """The torchrun job this process is a worker of, or None (not under torchrun, or in a Ray job).

    torchrun's agent sets ``TORCHELASTIC_RUN_ID`` (its ``--rdzv-id``); shardwise's own
    elastic launchers set ``SHARDWISE_RDZV_ADDR`` and take precedence.
    """
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if not run_id or env.get("SHARDWISE_RDZV_ADDR"):
        return None
    return TorchrunJob(run_id, _int(env, "TORCHELASTIC_RESTART_COUNT", 0), _int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
                       _int(env, "GROUP_RANK", 0), _int(env, "GROUP_WORLD_SIZE", 1),
                       env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def _safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:120] or "job"


def commit_dir(job: TorchrunJob, env: Optional[Mapping[str, str]] = None) -> tuple[Path, bool]:
    """(directory of ``job``'s commits, whether it is the private default under ``$TMPDIR``)."""
    env = os.environ if env is None else env
    explicit = env.get(DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser(), False
    return Path(tempfile.gettempdir()) / f"shardwise-elastic-{_safe_name(job.run_id)}", True


class CommitFile:
    """The last commit of one elastic job, as a file that rank 0 replaces atomically.

    ``private``: the directory is created mode 0700 and refused when another user
    owns it or others may write to it (the default directory lives in a shared
    ``/tmp``, and a planted pickle would run code). Otherwise only the file's owner
    is checked.
    """

    def __init__(self, directory: os.PathLike, private: bool = False) -> None:
        self.directory, self.private = Path(directory), private
        self.path = self.directory / _FILE

    @classmethod
    def for_job(cls, job: TorchrunJob, env: Optional[Mapping[str, str]] = None) -> "CommitFile":
        """The commit file of ``job`` (see :func:`commit_dir`)."""
        directory, private = commit_dir(job, env)
        return cls(directory, private)

    def _check_owner(self, path: Path, strict: bool) -> None:
        info = path.stat()
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise ConfigError(f"{path} belongs to uid {info.st_uid}, not to this user: refusing to use it "
                              f"for elastic commits (set {DIR_ENV} to a directory of your own)")
        if strict and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(f"{path} is writable by other users: refusing to use it for elastic commits "
                              f"(chmod 700 it, or set {DIR_ENV})")

    def _prepare(self) -> None:
        self.directory.mkdir(mode=0o700 if self.private else 0o777, parents=True, exist_ok=True)
        self._check_owner(self.directory, strict=self.private)

    def save(self, payload: Any, **meta: Any) -> Path:
        """Replace the commit with ``payload`` (picklable); ``meta`` is kept beside it for inspection."""
        self._prepare()
        record = {"format": _FORMAT, "meta": meta, "payload": payload}
        return atomic_save(lambda f: pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL), self.path)

    def load_record(self) -> Optional[dict[str, Any]]:
        """The stored record (``format``, ``meta``, ``payload``), or None when there is no commit yet."""
        if not self.path.exists():
            return None
        self._check_owner(self.directory, strict=self.private)
        self._check_owner(self.path, strict=False)
        with open(self.path, "rb") as f:
            record = pickle.load(f)
        if not isinstance(record, dict) or record.get("format") != _FORMAT:
            raise ConfigError(f"{self.path} is not a shardwise elastic commit (format {_FORMAT})")
        return record

    def load(self) -> Optional[Any]:
        """The last committed payload, or None when there is no commit yet."""
        record = self.load_record()
        return None if record is None else record["payload"]

    def clear(self) -> None:
        """Remove the commit (the job finished), and the default directory once it is empty."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        if self.private:
            try:
                self.directory.rmdir()
            except OSError:
                pass


def exit_for_restart(reason: str, code: int = RESTART_EXIT_CODE) -> NoReturn:
    """End this worker now with ``code`` so that torchrun's agent re-forms the job.

    ``os._exit``: a broken process group must not be torn down (it may block), and
    the job's state is already on disk. Logs and standard streams are flushed first.
    """
    _LOG.warning("leaving with exit code %d so that torchrun re-forms the job: %s", code, reason)
    for handler in logging.getLogger().handlers + _LOG.handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - a broken handler must not keep us alive
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _abort_connections() -> None:
    """Close this process's collective connections, so that peers blocked on it fail at once."""
    import shardwise
    from shardwise.context import abort_connections

    if shardwise.is_initialized():
        try:
            abort_connections(shardwise.current())
        except Exception as exc:  # noqa: BLE001 - leaving anyway
            _LOG.warning("could not abort the process group before leaving: %s", exc)


def _resume(state: State, commits: CommitFile, job: TorchrunJob) -> None:
    """Rank 0 returns to the previous incarnation's last commit, if any; reset callbacks run after one."""
    meta = None
    if rank() == 0:
        if job.shares_agent_store:
            _LOG.warning("torchrun shares its agent's TCPStore with the workers: after a membership change the "
                         "new process group can read the old one's addresses and fail (pytorch/pytorch#135712); "
                         "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (shardwise run --elastic does)")
        record = commits.load_record()
        if record is not None:
            state.from_payload(record["payload"])  # type: ignore[attr-defined]
            meta = dict(record["meta"])
        elif job.restart_count > 0:
            _LOG.warning("torchrun restarted the job (restart %d) but %s holds no commit: starting over "
                         "(with several nodes, %s must be on a shared file system)",
                         job.restart_count, commits.path, DIR_ENV)
    meta = broadcast_object(meta)
    state.persist_to(commits)  # type: ignore[attr-defined]
    if meta is not None:
        _LOG.info("resuming from the commit of a %s-rank incarnation", meta.get("world_size", "?"))
        for callback in state._reset_callbacks:
            callback()


def torchrun_run_fn(func: Callable[..., Any], job: TorchrunJob) -> Callable[..., Any]:
    """Wrap ``func(state, ...)`` for a job under torchrun's elastic agent (``elastic.run`` there).

    On start, rank 0 returns to the last commit an earlier incarnation left in the
    job's :class:`CommitFile` and :meth:`~State.sync` hands it to every rank; each
    :meth:`~State.commit` is written there by rank 0. On a lost worker (or a
    :class:`HostsUpdatedInterrupt`) the process exits with :data:`RESTART_EXIT_CODE`:
    the agent then re-forms the job and starts every worker again. When ``func``
    has returned on every rank, the commit is removed. ``state`` must offer
    ``to_payload``, ``from_payload`` and ``persist_to`` (as ``TorchState`` does).
    The commit file belongs to the job, so a job runs one elastic function; rank 0
    pickles the whole state at each commit, so commit as often as a restart may cost.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        missing = [m for m in ("to_payload", "from_payload", "persist_to") if not hasattr(state, m)]
        if missing:
            raise ConfigError(f"under torchrun an elastic state must be saved to disk, but "
                              f"{type(state).__name__} has no {', '.join(missing)}: use TorchState")
        import shardwise

        commits = CommitFile.for_job(job)
        try:
            _resume(state, commits, job)
            state.sync()
            result = func(state, *args, **kwargs)
            shardwise.current().world.barrier()  # every rank is done before the commit goes
        except HostsUpdatedInterrupt:
            _abort_connections()
            exit_for_restart("the set of workers changed")
        except (RuntimeError, CollectiveTimeoutError) as exc:
            if not (is_peer_loss(exc) or isinstance(exc, CollectiveTimeoutError)):
                raise
            _abort_connections()
            exit_for_restart(f"lost a worker ({exc})")
        finally:
            state.persist_to(None)  # type: ignore[attr-defined]
        if rank() == 0:
            commits.clear()
        return result

    return wrapper
