"""ZeRO stage 3 for Keras on torch: :class:`~.stage3.TorchStage3` (the torch adapter's
module hooks over Keras layers) and the regularization penalties it computes (:mod:`.penalties`)."""
