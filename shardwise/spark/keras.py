"""Horovod's ``horovod.spark.keras`` on shardwise: fit a Keras 3 model on a DataFrame from the Spark driver.

    from shardwise.spark.keras import KerasEstimator
    model = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.SGD(0.1),
                           loss="sparse_categorical_crossentropy", store=store,
                           feature_cols=["features"], label_cols=["label"]).fit(df)
    predictions = model.transform(test_df)          # adds "label__output"
"""

from .estimator.keras import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
