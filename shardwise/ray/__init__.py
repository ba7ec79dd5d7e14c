"""Ray as the engine: run shardwise training functions on Ray actors (elastic if asked).

    import shardwise.ray
    results = shardwise.ray.run(train, num_workers=2)            # like Horovod's RayExecutor
    results = shardwise.ray.run(train, num_workers=3, elastic=True, min_workers=2)
"""

from .executor import RayExecutor, run

__all__ = ["RayExecutor", "run"]
