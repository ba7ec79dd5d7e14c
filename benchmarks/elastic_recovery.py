"""Elastic recovery time on Ray: from a worker's SIGKILL to the survivors' first step.

Run:  python benchmarks/elastic_recovery.py [--workers 3] [--rounds 3]

Each round starts a fresh elastic job (``shardwise.ray.RayExecutor``, torch backend,
gloo) of ``--workers`` actors training an MLP under ``hvd.elastic.run`` with a commit
every 10 steps; rank ``workers - 1`` SIGKILLs itself at step 30. Printed per round
and as the median: the recovery time (kill -> first completed step on every
survivor: failure detected, last commit restored, new generation formed, state
synchronised) and the regrowth time (kill -> first step with the replacement).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from typing import Any

KILL_STEP, COMMIT_EVERY, STEPS = 30, 10, 400


def train(stamp: str, kill_rank: int, width: int) -> dict[str, Any]:
    """One worker: elastic training; returns when it recovered and when the job regrew."""
    import torch

    import shardwise
    import shardwise.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                   named_parameters=net.named_parameters())
    state = hvd.elastic.TorchState(net, opt, step=0)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    times: dict[str, float] = {}
    x, y = torch.randn(32, width), torch.randn(32, 1)

    @hvd.elastic.run
    def loop(state: Any) -> None:
        while state.step < STEPS:
            if (hvd.rank() == kill_rank and state.step == KILL_STEP
                    and shardwise.current().owned.get("elastic_generation") == 0):
                with open(stamp, "w") as out:
                    out.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            if len(resets) == 1 and "recovered" not in times:
                times["recovered"] = time.time()
            if len(resets) == 2 and "regrown" not in times:
                times["regrown"] = time.time()
            state.step += 1
            time.sleep(0.01)
            if state.step % COMMIT_EVERY == 0:
                state.commit()
        while hvd.size() <= kill_rank:  # end on the regrown job, so that regrowth is measured too
            time.sleep(0.1)
            state.check_host_updates()

    loop(state)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()

    import ray

    import shardwise.ray

    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    recovery, regrowth = [], []
    print(f"elastic recovery on Ray {ray.__version__}: {args.workers} actors, torch backend (gloo), "
          f"MLP width {args.width}, kill at step {KILL_STEP}, commit every {COMMIT_EVERY} steps")
    print("round  kill->first step on survivors (s)  kill->first step with replacement (s)")
    for r in range(args.rounds):
        stamp = os.path.join(tempfile.mkdtemp(), "killed_at")
        executor = shardwise.ray.RayExecutor(args.workers, elastic=True, min_workers=args.workers - 1,
                                             discovery_interval=1.0, timeout=300)
        executor.start()
        results = executor.run(train, [stamp, args.workers - 1, args.width])
        executor.shutdown()
        killed = float(open(stamp).read())
        rec = max(t["recovered"] for t in results if "recovered" in t) - killed
        grow = max(t["regrown"] for t in results if "regrown" in t) - killed
        recovery.append(rec)
        regrowth.append(grow)
        print(f"{r + 1:5d}  {rec:33.2f}  {grow:37.2f}   generations {[n for _, n in executor.history]}")
    print(f"median {statistics.median(recovery):33.2f}  {statistics.median(regrowth):37.2f}   "
          f"(target: recovery < 30 s)")
    ray.shutdown()


if __name__ == "__main__":
    main()
