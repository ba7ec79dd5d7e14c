"""Spark as the engine: shardwise jobs on Spark tasks, as Horovod's ``horovod.spark``.

    import shardwise.spark
    results = shardwise.spark.run(train, num_proc=2)      # like horovod.spark.run

Needs ``pip install 'shardwise[spark]'`` and a Java runtime, with a Spark session
started by the caller.
"""

from .runner import run

__all__ = ["run"]
