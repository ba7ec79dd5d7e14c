"""Horovod compatibility shared by the torch, TensorFlow and Keras adapters.

Process-level calls (:mod:`.basics`), reduction ops (:mod:`.ops`), process sets
(:mod:`.process_sets`) and the name-negotiating :class:`~.coordinator.Coordinator`
with its timeline (:mod:`.timeline`). Nothing here imports a framework; each
adapter's ``hvd``-style module builds on these.
"""
