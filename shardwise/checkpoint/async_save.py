"""Checkpoint saves that do not stop training: the files are written, and the checkpoint committed,
by a background thread.

A save is three phases of :mod:`.store`: :func:`~.store.prepare_step_dir` (collective: make
``ckpt-<step>/``), :func:`~.store._write_own` (this rank's files, atomically) and
:func:`~.store.commit_checkpoint` (collective: gather the files' entries, rank 0 writes the
manifest last, prunes to ``keep``). :class:`BackgroundSaver` runs all three on a thread of its own,
after the caller has copied what it saves into buffers nobody else writes (for torch,
:mod:`shardwise.adapters.torch.checkpoint.staging`), so training goes on while the disk works.
The manifest is still written last: a process killed during the background write leaves the
previous checkpoint the newest complete one, and the new step directory without a manifest.

**Collectives from two threads.** The commit's collectives (an object allgather and a broadcast)
run on a communicator of their own, made once, with
:meth:`~shardwise.core.comm.Communicator.thread_safe_duplicate`, so they never interleave with
training's collectives on the world: on the ``torch`` backend a separate gloo group (gloo's groups
are independent, as torchtitan's ``async_mode`` uses one); on the ``mpi`` backend a duplicate of
the communicator when MPI runs at ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default; every
rank must have it). Where the backend cannot promise concurrent calls (MPI initialized at a lower
thread level, horovod, tf), the saver falls back to a safe scheme, *deferred commit*: the step
directory is made in the caller's thread, the background thread only writes this rank's files (no
collective) and the commit runs in the caller's thread at the next :meth:`BackgroundSaver.wait`
(the next save, ``wait_checkpoint()``, freeing the groups, or interpreter exit); until then the
checkpoint has no manifest. :attr:`BackgroundSaver.mode` says which scheme runs.

**Order and errors.** One save is in flight at a time: a save waits for the previous one first.
An error of the background write or commit is kept and raised by the next wait (or save) on every
rank: a rank that failed to write reports it in the commit, so no rank waits for it, and every
rank raises (the failing rank its own error, the others a :class:`CheckpointError` naming it).
At interpreter exit (``atexit``) and when the model's groups are freed, the saver waits for the
save in flight; an error found then is logged, since nobody is left to raise it to.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ..core.comm import Communicator
from ..core.errors import CheckpointError
from .atomic import PathLike
from .manifest import FileEntry
from . import store
from .store import Contents, checkpoint_dir, commit_checkpoint, prepare_step_dir

__all__ = ["SaveHandle", "BackgroundSaver", "THREADED", "DEFERRED", "SINGLE"]

_LOG = logging.getLogger("shardwise.checkpoint")

#: Modes of a :class:`BackgroundSaver`: write and commit on the background thread, over a duplicate
#: communicator that may be called concurrently with the world.
THREADED = "threaded"
#: The backend cannot take calls from two threads: the thread writes, the commit runs at the next wait.
DEFERRED = "deferred"
#: One rank: no collective at all; write and commit on the background thread.
SINGLE = "single"


def _lower_priority(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux: per thread); elsewhere a no-op."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError:  # not permitted or not supported: the save runs at the caller's priority
        pass


def _agree_started(comm: Optional[Communicator], failure: Optional[BaseException], step: int) -> None:
    """Collective over ``comm``: raise on every rank (a failing rank its own error) if any rank could not
    stage what it saves; return on every rank otherwise."""
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    every = comm.allgather_object(mine) if comm is not None else [mine]
    failed = [(r, message) for r, message in enumerate(every) if message is not None]
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(f"checkpoint step {int(step)} was not written: rank {failed[0][0]} failed to stage "
                              f"its state: {failed[0][1]}")


class SaveHandle:
    """A checkpoint being saved in the background (what ``save_checkpoint(..., async_save=True)`` returns).

    :meth:`done` tells, without blocking, whether the save is over (committed or failed);
    :meth:`wait` blocks until then and returns the checkpoint's directory, or raises the save's error.
    In deferred mode (see :mod:`.async_save`) the commit is collective and runs in the thread that
    waits, so ``done()`` stays False until :meth:`BackgroundSaver.wait` (every rank) has run.
    """

    def __init__(self, saver: "BackgroundSaver", step: int, path: Path) -> None:
        self._saver = saver
        self.step = int(step)
        #: The checkpoint directory, ``<directory>/ckpt-<step>``: complete once the save is done.
        self.path = path
        self._written = threading.Event()
        self._finished = threading.Event()
        self._entries: Optional[dict[str, FileEntry]] = None
        self._failure: Optional[BaseException] = None  # this rank's write failure (deferred commit)
        self._error: Optional[BaseException] = None  # the save's outcome, raised by wait()
        self._commit: Optional[Callable[[], Path]] = None  # deferred mode: the commit, run by a wait
        #: Set once the save's error has been raised to a caller (not raised again by the saver).
        self.reported = False

    def done(self) -> bool:
        """True once the save is over: committed (its manifest written) or failed. Never blocks."""
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> Path:
        """Block until the save is over; return the checkpoint directory or raise the save's error.

        Collective in deferred mode (it may run the commit): call it on every rank, or use the
        model's ``wait_checkpoint()``. ``timeout`` (seconds) raises :class:`TimeoutError` if the
        background write has not finished by then (the save goes on).
        """
        return self._saver.wait_for(self, timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<SaveHandle step {self.step} {self.path} {state}>"


class BackgroundSaver:
    """Runs checkpoint saves of one model on a background thread; one save in flight at a time.

    ``world`` is the communicator the checkpoints span (``None``: one process). ``staging`` is
    the caller's object for its host buffers (e.g. :class:`shardwise.adapters.torch.checkpoint.staging.HostStaging`), kept
    here so that it lives as long as the saver; it must not be written while a save is in flight
    (call :meth:`wait` first, as :meth:`start` does). The communicator for the background
    commit is made on the first :meth:`start` (collective, as the save is).
    """

    def __init__(self, world: Optional[Communicator], staging: Any = None, *,
                 write_hook: Optional[Callable[[Path], None]] = None, nice: int = 10) -> None:
        self.world = world
        self.staging = staging
        #: How much lower the background thread's CPU priority is than the caller's (Linux ``nice``
        #: increment of that thread alone): where the cores are all busy, training's threads get
        #: them first and the save takes the rest. 0: the same priority.
        self.nice = int(nice)
        #: Called by the background thread with the step directory before it writes this rank's
        #: files (tests make the write slow with it, deterministically); the one set when a save
        #: starts is the one its thread calls.
        self.write_hook = write_hook
        self._comm: Optional[Communicator] = None
        self._mode: Optional[str] = None
        self._pending: Optional[SaveHandle] = None
        self._thread: Optional[threading.Thread] = None
        self._exit_registered = False
        self._closed = False

    # ------------------------------------------------------------------ set-up
    @property
    def mode(self) -> Optional[str]:
        """:data:`THREADED`, :data:`DEFERRED` or :data:`SINGLE`; None before the first async save."""
        return self._mode

    def _ensure_comm(self) -> None:
        """Collective once: the communicator the background commit uses, or the deferred fallback."""
        if self._mode is not None:
            return
        if self.world is None or self.world.size == 1:
            self._mode = SINGLE
            return
        comm = self.world.thread_safe_duplicate()
        if comm is None:
            self._mode = DEFERRED
            _LOG.info("checkpoint: the %s backend cannot run collectives from a second thread; async saves "
                      "commit at the next wait (deferred commit)", self.world.backend)
            return
        self._comm, self._mode = comm, THREADED

    # ------------------------------------------------------------------- saves
    def start(self, directory: PathLike, step: int, contents: Optional[Mapping[str, Contents]], *,
              metadata: Optional[dict] = None, keep: Optional[int] = None,
              failure: Optional[BaseException] = None) -> SaveHandle:
        """Collective: begin saving ``contents`` (this rank's files, as for :func:`~.store.save_checkpoint`)
        as ``<directory>/ckpt-<step>``; returns at once with a :class:`SaveHandle`.

        Waits for the save in flight first (raising its error). ``failure``: this rank's error while
        preparing ``contents`` (staging); the ranks agree on it (one small collective, on the
        background thread unless the commit is deferred) before the step directory is touched, and
        if any rank failed, no file is written and every rank raises (that rank its own error) at
        the next wait, or at once in deferred mode. Then the step directory is made, the files
        written and the checkpoint committed in the background. ``contents`` must not change until
        the save is over: pass writers of buffers of their own (staged copies).
        """
        if self._closed:
            raise CheckpointError("this model's background checkpoint saver was closed (its groups were freed)")
        self.wait()
        self._ensure_comm()
        deferred = self._mode == DEFERRED
        commit_comm = self._comm if self._mode == THREADED else None
        if deferred:  # no collective may run on the background thread: agree and make the directory here
            _agree_started(self.world, failure, step)
            step_dir = prepare_step_dir(directory, step, self.world)
        else:
            step_dir = checkpoint_dir(directory, step)
        handle = SaveHandle(self, step, step_dir)
        contents = dict(contents or {})
        meta = dict(metadata or {})
        hook = self.write_hook  # the one set at the call

        def run() -> None:
            _lower_priority(self.nice)
            try:
                if not deferred:  # off the training thread too: the agreement, the fsyncs, the barrier
                    _agree_started(commit_comm, failure, step)
                    prepare_step_dir(directory, step, commit_comm)
                if hook is not None:
                    hook(step_dir)
                handle._entries = store._write_own(step_dir, contents)  # (looked up now: edited elsewhere)
            except BaseException as exc:  # reported in the commit, to every rank
                handle._failure = exc
            handle._written.set()
            if deferred:
                return
            try:
                commit_checkpoint(directory, step, handle._entries, comm=commit_comm, metadata=meta, keep=keep,
                                  failure=handle._failure)
            except BaseException as exc:
                handle._error = exc
            finally:
                handle._finished.set()

        if deferred:
            handle._commit = lambda: commit_checkpoint(
                directory, step, handle._entries, comm=self.world, metadata=meta, keep=keep,
                failure=handle._failure)
        self._register_exit()
        thread = threading.Thread(target=run, name=f"shardwise-ckpt-{int(step)}", daemon=False)
        self._pending, self._thread = handle, thread
        thread.start()
        return handle

    def wait_for(self, handle: SaveHandle, timeout: Optional[float] = None) -> Path:
        """Finish ``handle``'s save (see :meth:`SaveHandle.wait`)."""
        if not handle._written.wait(timeout):
            raise TimeoutError(f"checkpoint step {handle.step}: the background write is still running after "
                               f"{timeout} s")
        if not handle._finished.is_set():
            commit = handle._commit
            if commit is not None:  # deferred: the commit's collectives run here, in the waiting thread
                try:
                    commit()
                except BaseException as exc:
                    handle._error = exc
                finally:
                    handle._finished.set()
            elif not handle._finished.wait(timeout):
                raise TimeoutError(f"checkpoint step {handle.step}: the background commit is still running "
                                   f"after {timeout} s")
        if handle is self._pending:
            self._pending = None
            if self._thread is not None:
                self._thread.join()
                self._thread = None
        if handle._error is not None:
            handle.reported = True
            raise handle._error
        return handle.path

    def pending(self) -> Optional[SaveHandle]:
        """The save in flight (or finished but not yet waited for), if any."""
        return self._pending

    def wait(self) -> Optional[Path]:
        """Collective: finish the save in flight, if any; return its directory, or raise its error (on
        every rank) unless its handle's ``wait()`` already raised it. None: no save in flight."""
        handle = self._pending
        if handle is None:
            return None
        already = handle.reported
        try:
            return self.wait_for(handle)
        except BaseException:
            if already and handle.done():
                return None
            raise
        finally:
            if handle.done() and self._pending is handle:
                self._pending = None

    # --------------------------------------------------------------- teardown
    def _register_exit(self) -> None:
        if not self._exit_registered:
            atexit.register(self._at_exit)
            self._exit_registered = True

    def _at_exit(self) -> None:
        try:
            self.wait()
        except BaseException as exc:  # nobody is left to raise it to
            _LOG.error("checkpoint: the background save in flight at exit failed: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        """Collective: wait for the save in flight (logging, not raising, its error: this runs while
        tearing down), then free the background communicator. Idempotent."""
        if self._closed:
            return
        self._at_exit()
        self._closed = True
        if self._exit_registered:
            atexit.unregister(self._at_exit)
            self._exit_registered = False
        if self._comm is not None:
            self._comm.free()
            self._comm = None
