"""Horovod's Spark estimators on shardwise: :mod:`.torch` (``TorchEstimator`` -> ``TorchModel``) and
:mod:`.keras` (``KerasEstimator`` -> ``KerasModel``), sharing :mod:`.common`.

Import the one you use (``from shardwise.spark.estimator.torch import TorchEstimator``): each
imports its framework.
"""
