"""Horovod's ``horovod.spark.torch`` on shardwise: fit a torch model on a DataFrame from the Spark driver.

    from shardwise.spark.torch import TorchEstimator
    model = TorchEstimator(num_proc=2, model=net, optimizer=opt, loss=F.cross_entropy, store=store,
                           feature_cols=["features"], label_cols=["label"], strategy="zero2").fit(df)
    predictions = model.transform(test_df)          # adds "label__output"
"""

from .estimator.torch import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
