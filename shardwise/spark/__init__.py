"""Spark as the engine: shardwise jobs on Spark tasks, as Horovod's ``horovod.spark``.

    import shardwise.spark
    results = shardwise.spark.run(train, num_proc=2)      # like horovod.spark.run
    results = shardwise.spark.run_elastic(train, num_proc=2, min_num_proc=1, max_num_proc=4)
    from shardwise.spark.torch import TorchEstimator      # like horovod.spark.torch (.keras: KerasEstimator)

Needs ``pip install 'shardwise[spark]'`` and a Java runtime, with a Spark session
started by the caller.
"""

from .elastic import run_elastic
from .runner import run, worker_python
from .store import FsspecStore, LocalStore, Store

__all__ = ["run", "run_elastic", "worker_python", "Store", "LocalStore", "FsspecStore"]
