"""Where a Spark estimator keeps its data, checkpoints and logs (Horovod's ``horovod.spark.common.store``).

A store is a prefix path; under it::

    <prefix>/intermediate_train_data.<idx>/   Parquet written by Spark (``df.write.parquet``)
    <prefix>/intermediate_val_data.<idx>/
    <prefix>/runs/<run_id>/checkpoint/          one sub-folder per epoch (``epoch-<e>``)
    <prefix>/runs/<run_id>/logs/

:meth:`Store.create` picks :class:`LocalStore` for a local path or a ``file://`` URL and
:class:`FsspecStore` for any other URL (``hdfs://``, ``s3://``, ``gs://``, ``abfs://``...),
which reads and writes through fsspec. Both are plain picklable objects: the workers
receive the store and open its files themselves (pyarrow or fsspec, never Spark).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
from typing import Any, Iterator
from urllib.parse import urlparse

from shardwise.core.errors import ConfigError


class Store:
    """Base: the paths of one store (``prefix_path``) and the file system that reads them."""

    def __init__(self, prefix_path: str) -> None:
        if not isinstance(prefix_path, str) or not prefix_path:
            raise ConfigError(f"a store needs a non-empty prefix path, got {prefix_path!r}")
        self.prefix_path = prefix_path.rstrip("/") or "/"

    @staticmethod
    def create(prefix_path: str) -> "Store":
        """:class:`LocalStore` for a local path or ``file://`` URL, :class:`FsspecStore` otherwise."""
        scheme = urlparse(prefix_path).scheme if isinstance(prefix_path, str) else ""
        if scheme in ("", "file") or len(scheme) == 1:  # "C:\\..." parses with scheme "c"
            return LocalStore(prefix_path)
        return FsspecStore(prefix_path)

    # -- paths (Horovod's names) ------------------------------------------------------------------
    def _join(self, *parts: str) -> str:
        return posixpath.join(self.prefix_path, *parts)

    def get_train_data_path(self, idx: Any = None) -> str:
        """Parquet folder of the training rows of dataset ``idx`` (a run id, or None)."""
        return self._join("intermediate_train_data" + (f".{idx}" if idx is not None else ""))

    def get_val_data_path(self, idx: Any = None) -> str:
        """Parquet folder of the validation rows of dataset ``idx``."""
        return self._join("intermediate_val_data" + (f".{idx}" if idx is not None else ""))

    def get_runs_path(self) -> str:
        return self._join("runs")

    def get_run_path(self, run_id: str) -> str:
        return posixpath.join(self.get_runs_path(), run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        """Folder of the run's checkpoints (one ``epoch-<e>`` sub-folder per epoch)."""
        return posixpath.join(self.get_run_path(run_id), "checkpoint")

    def get_logs_path(self, run_id: str) -> str:
        return posixpath.join(self.get_run_path(run_id), "logs")

    def spark_path(self, path: str) -> str:
        """``path`` as Spark's ``df.write.parquet`` takes it (a URL with its scheme)."""
        return path

    # -- file access (workers and driver) -------------------------------------------------------
    @property
    def filesystem(self) -> Any:
        """An fsspec file system for this store's paths."""
        raise NotImplementedError

    def fs_path(self, path: str) -> str:
        """``path`` as :attr:`filesystem` takes it."""
        return path

    def exists(self, path: str) -> bool:
        return bool(self.filesystem.exists(self.fs_path(path)))

    def read(self, path: str) -> bytes:
        with self.filesystem.open(self.fs_path(path), "rb") as f:
            return f.read()

    def write(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (parents created)."""
        fs, p = self.filesystem, self.fs_path(path)
        fs.makedirs(posixpath.dirname(p), exist_ok=True)
        with fs.open(p, "wb") as f:
            f.write(data)

    def list_files(self, path: str) -> list[str]:
        """Every file under folder ``path`` (recursive), sorted by name, as :attr:`filesystem` takes them."""
        fs = self.filesystem
        return sorted(fs.find(self.fs_path(path)))

    def open(self, path: str, mode: str = "rb") -> Any:
        return self.filesystem.open(path, mode)

    def remove(self, path: str) -> None:
        """Delete folder or file ``path`` if it exists."""
        fs, p = self.filesystem, self.fs_path(path)
        if fs.exists(p):
            fs.rm(p, recursive=True)

    @contextlib.contextmanager
    def local_dir(self, path: str) -> Iterator[str]:
        """A local folder whose contents end up at ``path`` of the store when the block exits."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"


class LocalStore(Store):
    """A store on this machine's (or a shared mounted) file system: a path or a ``file://`` URL."""

    def __init__(self, prefix_path: str) -> None:
        super().__init__(prefix_path)
        path = prefix_path[len("file://"):] if prefix_path.startswith("file://") else prefix_path
        self.prefix_path = os.path.abspath(path)

    @property
    def filesystem(self) -> Any:
        import fsspec

        return fsspec.filesystem("file")

    def spark_path(self, path: str) -> str:
        return "file://" + path

    @contextlib.contextmanager
    def local_dir(self, path: str) -> Iterator[str]:
        os.makedirs(path, exist_ok=True)
        yield path


class FsspecStore(Store):
    """A store at any URL fsspec opens (``hdfs://``, ``s3://``, ``gs://``...): its protocol's package
    (``pyarrow`` for HDFS, ``s3fs``, ``gcsfs``...) must be installed on the driver and the workers.
    ``storage_options`` go to ``fsspec.filesystem``."""

    def __init__(self, prefix_path: str, **storage_options: Any) -> None:
        super().__init__(prefix_path)
        self.protocol = urlparse(prefix_path).scheme
        if not self.protocol:
            raise ConfigError(f"FsspecStore needs a URL with a scheme (hdfs://, s3://...), got {prefix_path!r}")
        self.storage_options = storage_options

    @property
    def filesystem(self) -> Any:
        import fsspec

        return fsspec.filesystem(self.protocol, **self.storage_options)

    def fs_path(self, path: str) -> str:
        return self.filesystem._strip_protocol(path)

    def list_files(self, path: str) -> list[str]:
        # fsspec lists without the scheme; give the URL back so open() finds the same file
        fs = self.filesystem
        return sorted(fs.unstrip_protocol(p) for p in fs.find(self.fs_path(path)))

    def open(self, path: str, mode: str = "rb") -> Any:
        return self.filesystem.open(self.fs_path(path), mode)

    @contextlib.contextmanager
    def local_dir(self, path: str) -> Iterator[str]:
        tmp = tempfile.mkdtemp(prefix="shardwise-store-")
        try:
            yield tmp
            fs = self.filesystem
            fs.makedirs(self.fs_path(path), exist_ok=True)
            fs.put(tmp.rstrip("/") + "/", self.fs_path(path), recursive=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
