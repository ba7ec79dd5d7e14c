"""Horovod compatibility shared by the torch, TensorFlow and Keras adapters.

Process-level calls (:mod:`.basics`), reduction ops (:mod:`.ops`), process sets
(:mod:`.process_sets`), the name-negotiating :class:`~.coordinator.Coordinator`
with its timeline (:mod:`.timeline`), and the Keras and TensorFlow APIs' gradient
compression (:mod:`.compression`, the one module here that imports Keras). Each
adapter's ``hvd``-style module builds on these.
"""
