"""The digits example (``torch_digits.py``) trained on Ray actors instead of MPI ranks.

Run on this machine (a local Ray instance is started)::

    python examples/ray_digits.py --np 2
    python examples/ray_digits.py --np 2 --address auto     # on a running Ray cluster

Each actor runs ``torch_digits.main`` unchanged: ``shardwise.ray`` gives the actors
the torch backend (gloo on CPU, NCCL with ``--gpus-per-worker 1``) through a
rendezvous hosted by this driver, so with the same seed the run reaches the same
accuracy as ``shardwise run -np 2 -- python examples/torch_digits.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))


def train(argv: list[str]) -> dict[str, float]:
    """One actor: the unchanged MPI example's main()."""
    import torch_digits  # shipped to the actors by Ray (runtime_env working_dir)

    return torch_digits.main(argv)


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2, help="number of Ray actors (training processes)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local instance)")
    p.add_argument("--cpus-per-worker", type=float, default=1)
    p.add_argument("--gpus-per-worker", type=float, default=0)
    args, rest = p.parse_known_args(argv)

    import ray

    import shardwise.ray

    if not ray.is_initialized():
        ray.init(address=args.address, include_dashboard=False,
                 runtime_env={"working_dir": HERE, "excludes": ["checkpoints"],
                              "env_vars": {"OMP_NUM_THREADS": "1"}})
    if "--checkpoint-dir" not in rest:  # the actors' working directory is Ray's copy of examples/
        rest += ["--checkpoint-dir", os.path.join(tempfile.gettempdir(), "shardwise-ray-digits")]
    results = shardwise.ray.run(train, [list(rest)], num_workers=args.np, cpus_per_worker=args.cpus_per_worker,
                                gpus_per_worker=args.gpus_per_worker)
    print(f"ray: {args.np} actors, final test_accuracy={results[0]['test_accuracy']:.3f} "
          f"loss={results[0]['loss']:.4f}", flush=True)
    # One machine-readable line for scripts and tests: rank 0's figures (every actor's are equal).
    print("SHARDWISE_RESULT " + json.dumps({"example": "ray_digits", "actors": args.np, **results[0]}), flush=True)
    return results


if __name__ == "__main__":
    main()
