"""Framework-neutral plans and maths (standard library and numpy only).

Modules: ``comm`` (the Communicator interface), ``mesh`` (dp x pp x tp topology),
``buckets`` (gradient fusion), ``zero`` (ZeRO partitions), ``memory`` (model-state
memory), ``pipeline`` (schedules and simulator), ``layer_partition``,
``tensor_parallel`` (split rules), ``config``, ``launch_env``, ``errors``.
"""
