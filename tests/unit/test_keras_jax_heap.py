"""The heap XLA's compiler freed goes back to the system after each backend compile (glibc)."""

from __future__ import annotations

import jax
import jax.monitoring
import jax.numpy as jnp
import pytest

from shardwise.adapters.keras import jax_heap


class _Libc:
    def __init__(self) -> None:
        self.trims: list[int] = []

    def malloc_trim(self, pad: int) -> int:
        self.trims.append(pad)
        return 1


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch):
    fake = _Libc()
    monkeypatch.setattr(jax_heap.ctypes, "CDLL", lambda name: fake)
    yield fake
    jax.monitoring.unregister_event_duration_listener(jax_heap._trim_after_compile)


def test_trims_once_per_compile_however_often_installed(libc: _Libc) -> None:
    jax_heap.trim_heap_after_compiles()
    jax_heap.trim_heap_after_compiles()
    jax.monitoring.record_event_duration_secs(jax_heap.BACKEND_COMPILE_EVENT, 0.5)
    assert libc.trims == [0]
    jax.monitoring.record_event_duration_secs("/jax/core/compile/jaxpr_trace_duration", 0.5)
    assert libc.trims == [0]


def test_a_real_compile_is_the_event_it_listens_for(libc: _Libc) -> None:
    jax_heap.trim_heap_after_compiles()
    jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0).lower(jnp.ones((7, 5))).compile()
    assert libc.trims, f"no trim after a compile: JAX no longer records {jax_heap.BACKEND_COMPILE_EVENT!r}?"


def test_other_c_libraries_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[object] = []
    looked_up: list[str] = []

    class _NoTrim:  # a C library without malloc_trim (e.g. musl, macOS)
        def __getattr__(self, name: str) -> object:
            looked_up.append(name)
            raise AttributeError(name)

    def cdll(name: object) -> _NoTrim:
        opened.append(name)
        return _NoTrim()

    monkeypatch.setattr(jax_heap.ctypes, "CDLL", cdll)
    assert jax_heap._trim_after_compile(jax_heap.BACKEND_COMPILE_EVENT, 0.1) is None
    assert opened == [None] and looked_up == ["malloc_trim"]  # the process's own C library, asked once
    jax_heap._trim_after_compile("/jax/core/compile/jaxpr_trace_duration", 0.1)
    assert opened == [None]  # other events do not even open the C library
    jax_heap.trim_heap_after_compiles()
    try:  # installed as a listener, a compile event on such a library raises nothing either
        jax.monitoring.record_event_duration_secs(jax_heap.BACKEND_COMPILE_EVENT, 0.5)
    finally:
        jax.monitoring.unregister_event_duration_listener(jax_heap._trim_after_compile)
    assert opened == [None, None] and looked_up == ["malloc_trim", "malloc_trim"]
