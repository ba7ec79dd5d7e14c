"""Elastic jobs under torchrun: the ``shardwise run --elastic`` command line and commits kept on disk."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from shardwise import cli
from shardwise.core.errors import ConfigError
from shardwise.elastic.persist import RESTART_EXIT_CODE, CommitFile, commit_dir, torchrun_job
from shardwise.cli.launch import build_torchrun_command, torchrun_env

TORCHRUN = ["/opt/bin/torchrun"]


# -- the command line ------------------------------------------------------------------------------

def test_torchrun_command_of_a_multi_node_job():
    argv = build_torchrun_command(["python", "train.py", "--lr", "0.1"], min_np=4, max_np=8, nproc_per_node=2,
                                  max_restarts=5, rdzv_endpoint="node0:29400", rdzv_id="job7", torchrun=TORCHRUN)
    assert argv == ["/opt/bin/torchrun", "--nnodes=2:4", "--nproc-per-node=2", "--max-restarts=5",
                    "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", "--rdzv-id=job7", "--no-python",
                    "python", "train.py", "--lr", "0.1"]


def test_torchrun_command_of_a_one_node_job_runs_a_script_with_torchruns_python():
    argv = build_torchrun_command(["train.py"], min_np=2, max_np=2, nproc_per_node=2, torchrun=TORCHRUN)
    assert argv[1:5] == ["--nnodes=1:1", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d"]
    assert argv[5] == "--rdzv-endpoint=127.0.0.1:29400" and argv[6].startswith("--rdzv-id=shardwise-")
    assert argv[-1] == "train.py" and "--no-python" not in argv
    other = build_torchrun_command(["train.py"], min_np=2, max_np=2, nproc_per_node=2, torchrun=TORCHRUN)
    assert other[6] != argv[6], "each one-node job gets its own rendezvous id"


@pytest.mark.parametrize("kwargs, message", [
    (dict(command=[], min_np=1, max_np=2), "no command"),
    (dict(min_np=0, max_np=2), "--min-np"),
    (dict(min_np=3, max_np=2), "--min-np"),
    (dict(min_np=2, max_np=5, nproc_per_node=2), "multiples"),
    (dict(min_np=2, max_np=4, nproc_per_node=0), "--nproc-per-node"),
    (dict(min_np=1, max_np=1, max_restarts=-1), "--max-restarts"),
    (dict(min_np=1, max_np=3), "--rdzv-endpoint"),
    (dict(min_np=1, max_np=3, rdzv_endpoint="node0:29400"), "--rdzv-id"),
    (dict(min_np=1, max_np=3, rdzv_endpoint="node0", rdzv_id="j"), "host:port"),
    (dict(min_np=1, max_np=3, rdzv_endpoint="node0:29400", rdzv_id="a b"), "--rdzv-id"),
])
def test_torchrun_command_errors(kwargs, message):
    kwargs.setdefault("command", ["python", "x.py"])
    with pytest.raises(ConfigError, match=message):
        build_torchrun_command(torchrun=TORCHRUN, **kwargs)


def test_torchrun_env_selects_the_torch_backend_and_a_store_per_incarnation():
    env = torchrun_env({"SHARDWISE_BACKEND": "mpi", "PATH": "/bin"})
    assert env["SHARDWISE_BACKEND"] == "torch" and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert torchrun_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def test_cli_elastic_dry_run_and_errors(capsys):
    assert cli.main(["run", "--elastic", "--min-np", "2", "--max-np", "3", "--rdzv-endpoint", "h:1234",
                     "--rdzv-id", "j1", "--launcher", "/x/torchrun", "--dry-run", "--", "python", "t.py"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == ("SHARDWISE_BACKEND=torch TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 /x/torchrun --nnodes=2:3 "
                       "--nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=h:1234 "
                       "--rdzv-id=j1 --no-python python t.py")
    for argv, message in (
            (["--elastic", "--min-np", "2", "--", "python", "t.py"], "--max-np"),
            (["--elastic", "-np", "2", "--min-np", "1", "--max-np", "2", "--", "python", "t.py"], "no -np"),
            (["--elastic", "-H", "a:2", "--min-np", "1", "--max-np", "2", "--", "python", "t.py"], "no -H"),
            (["-np", "2", "--max-restarts", "2", "--", "python", "t.py"], "add --elastic"),
            (["--", "python", "t.py"], "needs -np")):
        assert cli.main(["run"] + argv) == 2
        assert message in capsys.readouterr().err


# -- commits on disk -------------------------------------------------------------------------------

def test_torchrun_job_from_the_environment():
    assert torchrun_job({}) is None
    assert torchrun_job({"TORCHELASTIC_RUN_ID": "j", "SHARDWISE_RDZV_ADDR": "h:1"}) is None  # a Ray job
    job = torchrun_job({"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_RESTART_COUNT": "2",
                        "TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                        "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (job.run_id, job.restart_count, job.max_restarts, job.group_rank, job.group_world_size,
            job.shares_agent_store) == ("j", 2, 3, 1, 2, True)
    with pytest.raises(ConfigError, match="TORCHELASTIC_RESTART_COUNT"):
        torchrun_job({"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_RESTART_COUNT": "x"})


def test_commit_dir_default_is_private_and_named_after_the_run(tmp_path):
    job = torchrun_job({"TORCHELASTIC_RUN_ID": "a/b c"})
    directory, private = commit_dir(job, {})
    assert private and directory.name == "shardwise-elastic-a_b_c"
    assert commit_dir(job, {"SHARDWISE_ELASTIC_DIR": str(tmp_path)}) == (tmp_path, False)


def test_commit_file_round_trip_and_clear(tmp_path):
    commits = CommitFile(tmp_path / "job", private=True)
    assert commits.load() is None
    commits.save({"w": [1.5, 2.5]}, world_size=3)
    assert (tmp_path / "job").stat().st_mode & 0o777 == 0o700
    record = commits.load_record()
    assert record["payload"] == {"w": [1.5, 2.5]} and record["meta"] == {"world_size": 3}
    assert record["format"] == 2 and record["commit"] == 0
    commits.save({"w": [0.0]}, world_size=2)
    assert commits.load() == {"w": [0.0]} and commits.load_record()["commit"] == 1
    assert [p.name for p in (tmp_path / "job").iterdir()] == ["ckpt-1"], "only the last commit is kept"
    assert sorted(p.name for p in (tmp_path / "job" / "ckpt-1").iterdir()) == ["commit.safetensors", "manifest.json"]
    commits.clear()
    assert not (tmp_path / "job").exists()


def test_commit_file_refuses_a_shared_private_directory_and_foreign_commits(tmp_path):
    from shardwise.checkpoint.store import save_checkpoint
    from shardwise.core.errors import CheckpointError

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        CommitFile(shared, private=True).save({"x": 1})
    other = tmp_path / "other"
    save_checkpoint(other, 0, {"commit.safetensors": b""}, metadata={"format": "something-else", "version": 1})
    with pytest.raises(CheckpointError, match="not a shardwise elastic commit"):
        CommitFile(other).load()
    newer = tmp_path / "newer"
    save_checkpoint(newer, 0, {"commit.safetensors": b""}, metadata={"format": "shardwise-elastic-commit",
                                                                     "version": 3})
    with pytest.raises(CheckpointError, match="newer than this shardwise reads"):
        CommitFile(newer).load()


# -- TorchState and elastic.run under torchrun ------------------------------------------------------

def _state():
    import torch

    import shardwise.torch as hvd

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(range(10), seed=1)
    return hvd.elastic.TorchState(net, opt, sampler=sampler, epoch=0, log=[]), net, opt, sampler


def _train_step(net, opt):
    import torch

    opt.zero_grad()
    net(torch.ones(4, 3)).sum().backward()
    opt.step()


@pytest.fixture
def local_shardwise():
    pytest.importorskip("torch")
    import shardwise

    shardwise.init(backend="local")
    yield
    shardwise.shutdown()


def test_torch_state_payload_round_trip(local_shardwise, tmp_path):
    state, net, opt, sampler = _state()
    _train_step(net, opt)
    sampler.record_indices(4)
    state.epoch, state.log = 1, ["a"]
    commits = CommitFile(tmp_path, codecs=state.payload_codecs())
    state.persist_to(commits)
    state.commit()
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    _train_step(net, opt)
    state.epoch = 2
    fresh, fresh_net, fresh_opt, fresh_sampler = _state()
    fresh.from_payload(commits.load())
    assert all(fresh_net.state_dict()[k].equal(v) for k, v in weights.items())
    assert fresh.epoch == 1 and fresh.log == ["a"] and fresh_sampler.state_dict() == {"epoch": 0, "processed_num": 4}
    assert fresh_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    other, *_ = _state()
    object.__setattr__(other, "_saved_state", {"epoch": 0})
    with pytest.raises(ConfigError, match="stored commit holds"):
        other.from_payload(commits.load())


def test_run_under_torchrun_resumes_from_the_commit_and_removes_it_when_done(local_shardwise, tmp_path,
                                                                              monkeypatch):
    import shardwise.torch as hvd

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "unit")
    monkeypatch.setenv("SHARDWISE_ELASTIC_DIR", str(tmp_path))
    monkeypatch.delenv("SHARDWISE_RDZV_ADDR", raising=False)
    earlier, net, opt, _ = _state()
    earlier.epoch, earlier.log = 3, ["x", "y"]
    earlier.save()
    CommitFile(tmp_path, codecs=earlier.payload_codecs()).save(earlier.to_payload(), world_size=2)
    state, *_ = _state()
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    seen = []

    @hvd.elastic.run
    def loop(state):
        seen.append((state.epoch, list(state.log)))
        state.epoch += 1
        state.commit()
        assert CommitFile(tmp_path, codecs=state.payload_codecs()).load()["attributes"]["epoch"] == 4
        return "done"

    assert loop(state) == "done"
    assert seen == [(3, ["x", "y"])] and resets == [1]
    assert list(tmp_path.iterdir()) == [], "the finished job removed its commits"


def test_run_under_torchrun_exits_for_a_restart_when_a_worker_is_lost(tmp_path):
    pytest.importorskip("torch")
    script = textwrap.dedent("""
        import shardwise, shardwise.torch as hvd, torch
        from shardwise.core.errors import WorkerLostError
        hvd.init()
        net = torch.nn.Linear(2, 1)
        state = hvd.elastic.TorchState(net, torch.optim.SGD(net.parameters(), lr=0.1), step=0)

        @hvd.elastic.run
        def loop(state):
            state.step = 5
            state.commit()
            raise WorkerLostError("allreduce: a rank left the job")

        loop(state)
        print("not reached")
    """)
    env = dict(os.environ, TORCHELASTIC_RUN_ID="unit", SHARDWISE_ELASTIC_DIR=str(tmp_path), SHARDWISE_BACKEND="local")
    env.pop("SHARDWISE_RDZV_ADDR", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == RESTART_EXIT_CODE, proc.stderr[-2000:]
    assert "not reached" not in proc.stdout and "torchrun re-forms the job" in proc.stderr
    from shardwise.adapters.torch.tensor_codec import TORCH_CODEC

    assert CommitFile(tmp_path, codecs=[TORCH_CODEC]).load()["attributes"]["step"] == 5


# -- commits as plain data --------------------------------------------------------------------------

def _realistic_state():
    """A bf16 model, Adam (int-keyed state, 0-d step tensors), an ElasticSampler and nested attributes."""
    import random

    import numpy as np
    import torch

    import shardwise.torch as hvd

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    net.to(torch.bfloat16)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.9, 0.99))
    sampler = hvd.elastic.ElasticSampler(range(10), seed=1)
    attributes = {"epoch": 2, "history": [(0, 1.25, float("nan")), (1, float("inf"), None)],
                  "best": {"loss": -0.0, "at": (1, 3), 7: [True, "x"]}, "rng": torch.get_rng_state(),
                  "py_rng": random.Random(3).getstate(), "np_rng": np.random.RandomState(5).get_state(),
                  "scale": np.float32(0.5), "ema": {"w": torch.zeros(2, dtype=torch.float16)}}
    state = hvd.elastic.TorchState(net, opt, sampler=sampler, **attributes)
    opt.zero_grad()
    net(torch.ones(5, 3, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    sampler.record_indices(4)
    return state, net, opt


def test_a_torch_state_commit_round_trips_as_plain_data(local_shardwise, tmp_path):
    import torch
    from test_plain_state import same

    state, net, opt = _realistic_state()
    commits = CommitFile(tmp_path, codecs=state.payload_codecs())
    state.persist_to(commits)
    state.commit()
    payload = state.to_payload()
    assert set(payload["tracked"]["optimizer"]["state"]) == {0, 1, 2, 3, 4, 5}, "int keys, as torch keeps them"
    loaded = commits.load()
    assert same(loaded, payload)
    assert loaded["tracked"]["model"]["0.weight"].dtype == torch.bfloat16
    assert loaded["tracked"]["model"]._metadata == payload["tracked"]["model"]._metadata
    step = commits.directory / "ckpt-0"
    assert sorted(p.name for p in step.iterdir()) == ["commit.safetensors", "manifest.json"]
    fresh, fresh_net, fresh_opt = _realistic_state()
    fresh.from_payload(loaded)
    assert all(fresh_net.state_dict()[k].equal(v) for k, v in net.state_dict().items())
    assert fresh.best == state.best and fresh.history[0][:2] == (0, 1.25) and isinstance(fresh.history[0], tuple)
    assert fresh.sampler.state_dict() == {"epoch": 0, "processed_num": 4}
    assert same(fresh_opt.state_dict(), opt.state_dict())


def test_an_attribute_that_is_not_plain_data_is_refused_at_commit_with_its_place(local_shardwise, tmp_path):
    import torch

    import shardwise.torch as hvd

    class Foo:
        pass

    net = torch.nn.Linear(2, 1)
    state = hvd.elastic.TorchState(net, torch.optim.SGD(net.parameters(), lr=0.1), epoch=0, helper={"x": Foo()})
    state.persist_to(CommitFile(tmp_path, codecs=state.payload_codecs()))
    with pytest.raises(ConfigError, match=r"^payload\['attributes'\]\['helper'\]\['x'\]: type "
                                          r"test_elastic_torchrun\..*Foo is not plain data"):
        state.commit()
    assert list(tmp_path.iterdir()) == [], "nothing was written"


def test_a_flipped_byte_in_the_commit_is_refused_on_load(tmp_path):
    import numpy as np

    from shardwise.core.errors import CheckpointError

    commits = CommitFile(tmp_path)
    commits.save({"w": np.arange(64, dtype=np.float32)}, world_size=2)
    assert commits.load()["w"].tolist() == list(range(64))
    data = tmp_path / "ckpt-0" / "commit.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0x01  # inside the tensor's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"the last elastic commit cannot be loaded: .*ckpt-0"):
        commits.load()


def test_a_commit_killed_midway_leaves_the_previous_one(tmp_path):
    commits = CommitFile(tmp_path)
    commits.save({"epoch": 1}, world_size=3)
    commits.save({"epoch": 2}, world_size=3)
    torn = tmp_path / "ckpt-2"  # the next commit, killed before its manifest
    torn.mkdir()
    (torn / "commit.safetensors").write_bytes(b"\x10\0\0\0")
    record = commits.load_record()
    assert record["payload"] == {"epoch": 2} and record["commit"] == 1
    commits.save({"epoch": 3}, world_size=2)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-3"] and commits.load() == {"epoch": 3}


def test_commit_meta_must_be_plain_data_and_tensors_need_their_codec(tmp_path):
    import torch

    from shardwise.core.errors import CheckpointError

    with pytest.raises(ConfigError, match=r"^meta\['when'\]: type builtins.object is not plain data"):
        CommitFile(tmp_path).save({}, when=object())
    with pytest.raises(ConfigError, match=r"^payload\['w'\]: type torch.Tensor is not plain data"):
        CommitFile(tmp_path).save({"w": torch.ones(1)})
    from shardwise.adapters.torch.tensor_codec import TORCH_CODEC

    CommitFile(tmp_path, codecs=[TORCH_CODEC]).save({"w": torch.ones(1)})
    with pytest.raises(CheckpointError, match=r"payload\['w'\]: a tensor of kind 'torch', and no codec"):
        CommitFile(tmp_path).load()


def test_a_format_1_pickle_is_ignored_with_a_warning_and_never_unpickled(tmp_path, caplog):
    marker = tmp_path / "unpickled"

    class Planted:
        def __reduce__(self):
            return (marker.touch, ())

    (tmp_path / "commit.pkl").write_bytes(pickle.dumps({"format": 1, "meta": {}, "payload": Planted()}))
    commits = CommitFile(tmp_path)
    with caplog.at_level("WARNING", logger="shardwise.elastic"):
        assert commits.load_record() is None
    assert not marker.exists(), "the pickle was loaded"
    assert "format 1" in caplog.text and "ignored" in caplog.text
    commits.save({"epoch": 1})
    assert commits.load() == {"epoch": 1}
    commits.clear()
    assert list(tmp_path.iterdir()) == []


def test_commits_are_read_without_pickle():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "shardwise"
    for name in ("elastic/persist.py", "checkpoint/plain_state.py", "adapters/torch/tensor_codec.py"):
        tree = ast.parse((root / name).read_text())
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in modules if m and m.split(".")[0] in ("pickle", "dill", "cloudpickle")}, name
        calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert not {c for c in calls if c.endswith(("torch.load", "pickle.load", "pickle.loads", "np.load"))}, name
