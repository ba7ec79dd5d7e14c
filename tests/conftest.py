import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_KERAS_ORDER = {"tensorflow": 0, "torch": 1, "jax": 2}


def pytest_collection_modifyitems(session, config, items) -> None:
    """Run the multi-process Keras tests in one block, backend by backend, so that they share jobs.

    A shared job (``run_mpi(..., shared=True)``) serves one set of ranks and one
    environment, so the Keras tests of one backend, from every module, follow each
    other from where the first of them stood. Every other test keeps its order.
    """
    def is_keras(item) -> bool:
        return "distributed" in item.nodeid and "keras_backend" in getattr(getattr(item, "callspec", None),
                                                                           "params", {})

    keras = [item for item in items if is_keras(item)]
    if not keras:
        return
    first = items.index(keras[0])
    rest = [item for item in items if not is_keras(item)]
    keras.sort(key=lambda item: _KERAS_ORDER.get(item.callspec.params["keras_backend"], len(_KERAS_ORDER)))
    items[:] = rest[:first] + keras + rest[first:]


def pytest_sessionfinish(session, exitstatus) -> None:
    if "mpi_harness" in sys.modules:
        sys.modules["mpi_harness"].close_shared_jobs()
