"""Forward with a backward for later, on each Keras backend: what a pipeline stage needs.

A pipeline stage runs a micro-batch's forward now and its backward later, with the
gradient of its output coming from the next stage. Each backend keeps that pending
backward its own way: a ``tf.GradientTape``, a torch autograd graph, or a JAX
``vjp`` closure (the stage is run under a ``keras.StatelessScope`` so that the
weights are function arguments).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import keras

__all__ = ["forward_for_backward"]

Run = Callable[[Any], Any]  # the stage: input tensor -> output (or loss) tensor
Backward = Callable[[Optional[Any]], tuple[Optional[Any], list[Any]]]


def forward_for_backward(run: Run, x: Any, weights: Sequence[Any], input_grad: bool) -> tuple[Any, Backward]:
    """``run(x)``, and a function mapping the output's gradient to (input's gradient, weights' gradients).

    The output gradient may be ``None`` for a scalar output (the loss). The input's
    gradient is ``None`` unless ``input_grad``.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return _tensorflow(run, x, list(weights), input_grad)
    if backend == "torch":
        return _torch(run, x, list(weights), input_grad)
    return _jax(run, x, list(weights), input_grad)


def _tensorflow(run: Run, x: Any, weights: list[Any], input_grad: bool) -> tuple[Any, Backward]:
    import tensorflow as tf

    with tf.GradientTape() as tape:
        if input_grad:
            tape.watch(x)
        out = run(x)

    def backward(out_grad: Optional[Any]) -> tuple[Optional[Any], list[Any]]:
        got = tape.gradient(out, ([x] if input_grad else []) + weights, output_gradients=out_grad)
        return (got[0], got[1:]) if input_grad else (None, got)

    return out, backward


def _torch(run: Run, x: Any, weights: list[Any], input_grad: bool) -> tuple[Any, Backward]:
    import torch

    with torch.enable_grad():
        if input_grad:
            x = x.detach().requires_grad_(True)
        out = run(x)

    def backward(out_grad: Optional[Any]) -> tuple[Optional[Any], list[Any]]:
        sources = ([x] if input_grad else []) + [w.value for w in weights]
        got = list(torch.autograd.grad(out, sources, grad_outputs=out_grad, allow_unused=True))
        return (got[0], got[1:]) if input_grad else (None, got)

    return out, backward


def _jax(run: Run, x: Any, weights: list[Any], input_grad: bool) -> tuple[Any, Backward]:
    import jax

    def stage(values: list[Any], inputs: Any) -> Any:
        with keras.StatelessScope(state_mapping=list(zip(weights, values))):
            return run(inputs)

    out, vjp = jax.vjp(stage, [w.value for w in weights], x)

    def backward(out_grad: Optional[Any]) -> tuple[Optional[Any], list[Any]]:
        grads, x_grad = vjp(jax.numpy.ones_like(out) if out_grad is None else out_grad)
        return (x_grad if input_grad else None), list(grads)

    return out, backward
