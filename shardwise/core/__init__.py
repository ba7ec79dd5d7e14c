"""Framework-neutral plans and maths (standard library and numpy only).

Modules: ``comm`` (the Communicator interface), ``mesh`` (dp x pp x tp topology),
``buckets`` (gradient fusion), ``zero`` (ZeRO partitions), ``memory`` (model-state
memory), ``loss_scale``, ``pipeline`` (schedules and simulator), ``layer_partition``,
``tensor_parallel`` (split rules), ``config``, ``planner`` with ``cost_model``,
``hardware``, ``model_spec`` and ``hf_config``, ``monitor`` with ``timeline``, ``launch_env``,
``errors``.
"""
