"""ZeRO stage 3 for Keras on JAX: :class:`~.stage3.JaxStage3` with its sharded variables
(:mod:`.variables`), per-layer gathers (:mod:`.layers`) and train step (:mod:`.steps`)."""
