"""Committed elastic state on disk, for launchers that restart every worker (torchrun's elastic agent).

torchrun (``--nnodes=MIN:MAX --rdzv-backend=c10d``) re-forms a job whose membership
changed by stopping *all* its workers and starting new ones: nothing in memory
survives. So under torchrun ``hvd.elastic.run`` keeps the last commit on disk: rank
0 writes each commit's payload as a checkpoint of :mod:`shardwise.checkpoint.store`
(``<dir>/ckpt-<n>/``, ``n`` counting the commits), and the next incarnation's rank 0
reads it back and broadcasts it. A worker that sees a peer lost exits with
:data:`RESTART_EXIT_CODE`, which tells its agent to re-form the job.

A commit is plain data, never a pickle (format 2): the payload's structure and
values are a JSON tree in the checkpoint manifest's metadata
(``{"format": "shardwise-elastic-commit", "version": 2, "meta": ..., "tree": ...}``,
see :mod:`shardwise.checkpoint.plain_state`) and its tensors' bytes are in
``commit.safetensors``; reading it runs no code. The manifest, written last, holds the
file's size and checksums: a commit interrupted by a kill has no manifest and the
previous one is used, and a damaged one is refused on load. Tensors come back on the
CPU. A ``commit.pkl`` (format 1, written by shardwise before plain-data commits) found
in the directory is not read: a warning says it is ignored and the job starts from
scratch (unless a format-2 commit is there too); :meth:`CommitFile.clear` removes it.

The directory is ``SHARDWISE_ELASTIC_DIR``, else
``$TMPDIR/shardwise-elastic-<TORCHELASTIC_RUN_ID>`` (a private directory of this
user). With several nodes, rank 0 of the next incarnation may run on another node:
set ``SHARDWISE_ELASTIC_DIR`` to a directory on a file system every node shares (NFS,
Lustre, ...). Keep it writable by this user only (the default one is created so, and
checked): a commit planted there would become the job's state. A job that finishes
removes its commits; use a fresh ``--rdzv-id`` per job anyway, or a job that crashed
for good would hand its commit to the next job with the same id. Start torchrun with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``shardwise run --elastic`` does):
torchrun's shared store otherwise hands a re-formed job stale addresses.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, NoReturn, Optional, Sequence

from .. import context
from ..checkpoint.atomic import fsync_dir
from ..checkpoint.manifest import MANIFEST_NAME
from ..checkpoint.plain_state import NUMPY_CODEC, TensorCodec, from_plain, read_buffers, to_plain, write_buffers
from ..checkpoint.store import check_format, list_checkpoints, load_checkpoint, save_checkpoint
from ..core.errors import CheckpointError, CollectiveTimeoutError, ConfigError, HostsUpdatedInterrupt, is_peer_loss
from .state import State, broadcast_object, rank

__all__ = ["TorchrunJob", "torchrun_job", "commit_dir", "CommitFile", "RESTART_EXIT_CODE", "exit_for_restart",
           "torchrun_run_fn"]

_LOG = logging.getLogger("shardwise.elastic")

#: Exit status of a worker that leaves so that torchrun's agent re-forms the job (BSD's EX_TEMPFAIL).
RESTART_EXIT_CODE = 75
DIR_ENV = "SHARDWISE_ELASTIC_DIR"
#: The manifest metadata's ``format`` of an elastic commit, and the version written and read.
COMMIT_FORMAT = "shardwise-elastic-commit"
COMMIT_VERSION = 2
_FILE = "commit.safetensors"
_LEGACY_FILE = "commit.pkl"  # format 1: a pickle, never read


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
    """The commits of one elastic job: checkpoints ``<directory>/ckpt-<n>/`` of which rank 0 keeps the last.

    ``codecs`` store the payload's tensors (:class:`~shardwise.checkpoint.plain_state.TensorCodec`;
    numpy's is always added). ``private``: the directory is created mode 0700 and
    refused when another user owns it or others may write to it (the default
    directory lives in a shared ``/tmp``). Otherwise only its owner is checked.
    """

    def __init__(self, directory: os.PathLike, private: bool = False, codecs: Sequence[TensorCodec] = ()) -> None:
        self.directory, self.private = Path(directory), private
        self.codecs: tuple[TensorCodec, ...] = tuple(codecs) + (NUMPY_CODEC,)
        self._warned_legacy = False

    @classmethod
    def for_job(cls, job: TorchrunJob, env: Optional[Mapping[str, str]] = None,
                codecs: Sequence[TensorCodec] = ()) -> "CommitFile":
        """The commits of ``job`` (see :func:`commit_dir`), their tensors stored through ``codecs``."""
        directory, private = commit_dir(job, env)
        return cls(directory, private, codecs)

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

    def _complete(self) -> list[tuple[int, Path]]:
        """The commits whose manifest is written (the save finished), oldest first."""
        return [(n, p) for n, p in list_checkpoints(self.directory) if (p / MANIFEST_NAME).exists()]

    def save(self, payload: Any, **meta: Any) -> Path:
        """Make ``payload`` the last commit; ``meta`` is kept beside it for inspection. Returns its directory.

        Both must be plain data (``payload`` may hold tensors of the codecs'): anything
        else raises :class:`ConfigError` naming where it is, before anything is written.
        """
        plain = to_plain(payload, self.codecs, root="payload")
        meta_tree = to_plain(meta, (), root="meta").tree
        self._prepare()
        number = max((n for n, _ in list_checkpoints(self.directory)), default=-1) + 1
        metadata = {"format": COMMIT_FORMAT, "version": COMMIT_VERSION, "meta": meta_tree, "tree": plain.tree,
                    "tensors": len(plain.buffers)}

        def write(f: BinaryIO) -> None:
            write_buffers(f, plain.buffers, {"format": COMMIT_FORMAT})

        return save_checkpoint(self.directory, number, {_FILE: write}, metadata=metadata, keep=1)

    def _warn_legacy(self) -> None:
        legacy = self.directory / _LEGACY_FILE
        if not self._warned_legacy and legacy.exists():
            self._warned_legacy = True
            _LOG.warning("%s is an elastic commit of format 1 (a pickle, written by an older shardwise): it is "
                         "ignored, not loaded; this job starts from scratch unless a newer commit is there "
                         "(remove the file to silence this warning)", legacy)

    def load_record(self) -> Optional[dict[str, Any]]:
        """The last commit as ``{"format", "meta", "payload", "commit"}`` (``commit``: its number), or None
        when there is none yet.

        Raises :class:`CheckpointError` when the last complete commit is damaged (its
        file fails the manifest's checksums) or is not an elastic commit.
        """
        if not self.directory.exists():
            return None
        self._check_owner(self.directory, strict=self.private)
        self._warn_legacy()
        complete = self._complete()
        if not complete:
            return None
        number, path = complete[-1]
        for owned in (path, path / MANIFEST_NAME, path / _FILE):
            if owned.exists():
                self._check_owner(owned, strict=False)
        try:
            checkpoint = load_checkpoint(path, verify=False)
            metadata = checkpoint.metadata
            check_format(metadata, path, COMMIT_FORMAT, COMMIT_VERSION, "a shardwise elastic commit")
            count = metadata.get("tensors")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise CheckpointError(f"{path}: the manifest's tensor count {count!r} is not a count")
            buffers = read_buffers(checkpoint.read_bytes(_FILE), count, str(path / _FILE))  # verified first
            payload = from_plain(metadata.get("tree"), buffers, self.codecs, root="payload")
            meta = from_plain(metadata.get("meta", {"dict": []}), [], (), root="meta")
        except CheckpointError as exc:
            raise CheckpointError(f"the last elastic commit cannot be loaded: {exc} (remove {self.directory} to "
                                  "start the job over)") from None
        if not isinstance(meta, dict):
            raise CheckpointError(f"{path}: the commit's meta is a {type(meta).__name__}, not a dict")
        return {"format": COMMIT_VERSION, "meta": meta, "payload": payload, "commit": number}

    def load(self) -> Optional[Any]:
        """The last committed payload, or None when there is no commit yet."""
        record = self.load_record()
        return None if record is None else record["payload"]

    def clear(self) -> None:
        """Remove every commit (the job finished) and a format-1 ``commit.pkl``; then the default directory
        once it is empty."""
        for _, path in list_checkpoints(self.directory):
            (path / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete first: a crash mid-removal is harmless
            shutil.rmtree(path, ignore_errors=True)
        (self.directory / _LEGACY_FILE).unlink(missing_ok=True)
        if self.directory.is_dir():
            fsync_dir(self.directory)
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
    if context.is_initialized():
        try:
            context.abort_connections(context.current())
        except Exception as exc:  # noqa: BLE001 - leaving anyway
            _LOG.warning("could not abort the process group before leaving: %s", exc)


def _resume(state: State, commits: CommitFile, job: TorchrunJob) -> None:
    """Rank 0 returns to the previous incarnation's last commit, if any; reset callbacks run after one.

    A commit rank 0 cannot load (damaged, of another state) raises the same error on every rank.
    """
    meta, failure = None, None
    if rank() == 0:
        if job.shares_agent_store:
            _LOG.warning("torchrun shares its agent's TCPStore with the workers: after a membership change the "
                         "new process group can read the old one's addresses and fail (pytorch/pytorch#135712); "
                         "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (shardwise run --elastic does)")
        try:
            record = commits.load_record()
            if record is not None:
                state.from_payload(record["payload"])  # type: ignore[attr-defined]
                meta = dict(record["meta"])
            elif job.restart_count > 0:
                _LOG.warning("torchrun restarted the job (restart %d) but %s holds no commit: starting over "
                             "(with several nodes, %s must be on a shared file system)",
                             job.restart_count, commits.directory, DIR_ENV)
        except (CheckpointError, ConfigError, OSError) as exc:
            failure = exc
    meta, message = broadcast_object((meta, None if failure is None else str(failure)))
    if failure is not None:
        raise failure
    if message is not None:
        raise CheckpointError(f"rank 0 could not resume from the last elastic commit: {message}")
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
    ``to_payload``, ``from_payload`` and ``persist_to`` (as ``TorchState`` does), and
    ``payload_codecs()`` where its payload holds tensors other than numpy arrays.
    The commits belong to the job, so a job runs one elastic function; rank 0
    writes the whole state at each commit, so commit as often as a restart may cost.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        missing = [m for m in ("to_payload", "from_payload", "persist_to") if not hasattr(state, m)]
        if missing:
            raise ConfigError(f"under torchrun an elastic state must be saved to disk, but "
                              f"{type(state).__name__} has no {', '.join(missing)}: use TorchState")
        codecs = state.payload_codecs() if hasattr(state, "payload_codecs") else ()
        commits = CommitFile.for_job(job, codecs=codecs)
        try:
            _resume(state, commits, job)
            state.sync()
            result = func(state, *args, **kwargs)
            context.current().world.barrier()  # every rank is done before the commit goes
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
