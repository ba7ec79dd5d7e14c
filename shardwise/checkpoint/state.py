"""Framework-neutral pieces of training state: numpy arrays, RNG streams, shape checks."""

from __future__ import annotations

import base64
import random
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from ..core.errors import CheckpointError
from .atomic import PathLike, atomic_save

__all__ = ["save_arrays", "load_arrays", "capture_rng", "restore_rng", "check_mismatch"]


def save_arrays(path: PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """Atomically write ``arrays`` as an ``.npz`` file (plain dtypes only, no pickled objects)."""
    plain = {}
    for key, value in arrays.items():
        arr = np.asarray(value)
        if arr.dtype.hasobject:
            raise CheckpointError(f"array {key!r} has dtype object, which would need pickle; store numbers")
        plain[key] = arr
    atomic_save(lambda f: np.savez(f, **plain), path)


def load_arrays(path: PathLike) -> dict[str, np.ndarray]:
    """Read an ``.npz`` file with ``allow_pickle=False``."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except ValueError as exc:  # object arrays refuse to load without pickle
        raise CheckpointError(f"{path}: refusing to unpickle: {exc}") from None
    except (OSError, EOFError, KeyError) as exc:
        raise CheckpointError(f"{path} is not a readable .npz file: {exc}") from None


def capture_rng() -> dict[str, Any]:
    """JSON-safe state of Python's ``random``, numpy's global RNG and (if imported) torch's CPU RNG."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"name": name, "keys": np.asarray(keys).tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        raw = torch.get_rng_state().numpy().tobytes()
        state["torch"] = base64.b64encode(raw).decode("ascii")
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng` returned (torch's only if torch is imported)."""
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        npy = state["numpy"]
        np.random.set_state((npy["name"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"],
                             npy["has_gauss"], npy["cached_gaussian"]))
        torch = sys.modules.get("torch")
        if torch is not None and "torch" in state:
            raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
            torch.set_rng_state(torch.from_numpy(raw))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot restore RNG state: {type(exc).__name__}: {exc}") from None


def _listing(items: Sequence[str], limit: int = 12) -> str:
    more = f", ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_mismatch(expected: Mapping[str, Sequence[int]], found: Mapping[str, Sequence[int]], *,
                   what: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` listing missing, unexpected and shape-differing keys.

    ``expected`` maps keys to shapes of the model; ``found`` those of the ``what``.
    """
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    differ = sorted(k for k in set(expected) & set(found) if tuple(expected[k]) != tuple(found[k]))
    if not (missing or unexpected or differ):
        return
    parts = []
    if missing:
        parts.append(f"missing from the {what} ({len(missing)}): {_listing(missing)}")
    if unexpected:
        parts.append(f"unexpected in the {what} ({len(unexpected)}): {_listing(unexpected)}")
    if differ:
        shapes = [f"{k} {what} {tuple(found[k])} vs model {tuple(expected[k])}" for k in differ]
        parts.append(f"shape differs ({len(differ)}): {_listing(shapes)}")
    raise CheckpointError(f"{what} does not match the model: " + "; ".join(parts))
