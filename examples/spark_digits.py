"""The digits example (``torch_digits.py``) trained on Spark tasks instead of MPI ranks.

Run on this machine (a local Spark session, ``local[2]``, is started; needs Java)::

    python examples/spark_digits.py --np 2
    python examples/spark_digits.py --np 4 --master spark://head:7077    # a Spark cluster

Each Spark task runs ``torch_digits.main`` unchanged in its own process:
``shardwise.spark.run`` gives the tasks the torch backend (gloo on CPU) through a
rendezvous served by task 0, so with the same seed the run reaches the same accuracy
as ``shardwise run -np 2 -- python examples/torch_digits.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Optional, Sequence


def train(argv: list[str]) -> dict[str, float]:
    """One Spark task's rank: the unchanged MPI example's main()."""
    import torch_digits  # on the ranks' PYTHONPATH: shardwise.spark.run passes the driver's sys.path

    return torch_digits.main(argv)


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2, help="number of Spark tasks (training processes)")
    p.add_argument("--master", default=None, help="Spark master (default: local[NP] on this machine)")
    args, rest = p.parse_known_args(argv)

    from pyspark.sql import SparkSession

    import shardwise.spark

    spark = (SparkSession.builder.master(args.master or f"local[{args.np}]").appName("shardwise-digits")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    if "--checkpoint-dir" not in rest:
        rest += ["--checkpoint-dir", os.path.join(tempfile.gettempdir(), "shardwise-spark-digits")]
    results = shardwise.spark.run(train, args=(list(rest),), num_proc=args.np,
                                  env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    print(f"spark: {args.np} tasks, final test_accuracy={results[0]['test_accuracy']:.3f} "
          f"loss={results[0]['loss']:.4f}", flush=True)
    # One machine-readable line for scripts and tests: rank 0's figures (every rank's are equal).
    print("SHARDWISE_RESULT " + json.dumps({"example": "spark_digits", "tasks": args.np, **results[0]}), flush=True)
    spark.stop()
    return results


if __name__ == "__main__":
    main()
