"""Launchers: the Slurm command builders and sbatch scripts, the resource pool, and the Ray
launcher on a real local Ray cluster of two CPU nodes.

One tiny GRPO job (4 workers, 2 steps) runs twice: once through examples/slurm/grpo_moe.sbatch on
one node (a stand-in `srun` that records its arguments and starts the one task, as Slurm would on
a one-node allocation; the torchrun it starts is real), once on Ray. Both must give the same
metrics, and the resource pool must have seen the released ranks. Two `torchrun-node` stages
with `--max-restarts` act as two nodes on this machine (c10d rendezvous) and restart together
after a worker of one is killed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from distributed import REPO, end_job, free_port, job_processes

from flexfloor.launch.pool import ResourcePool
from flexfloor.launch.slurm import Allocation, expand_hostlist, ray_auth_env
from flexfloor.launch.slurm import main as slurm_main

CONFIG = os.path.join(REPO, "examples", "configs", "grpo_tiny.yaml")
TINY = [  # 4 prompts x 4 samples of at most 24 tokens: ranks 2 and 3 get no work and leave early
    "trainer.steps=2", "trainer.sft_warmup_steps=0", "trainer.prompts_per_step=4",
    "trainer.micro_batch_size=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24",
    "rollout.progress=false", "data.synthetic_num_prompts=8", "logging.tensorboard=false",
    "logging.timeline_plot=false", "parallel.expert_parallel_size=4",
    "data.val_size=16",  # the example validates on 256 held-out prompts: a few suffice here
    # one EP group: the ranks released are those with fewer steps (a replica leaving whole is
    # released only if another is still decoding: the wall clock's call)
    "rollout.replicas=1",
]
# metrics that depend only on the tokens and the weights (not on seconds)
SAME = ("step", "reward/", "response_length/", "actor/", "rollout/occupied_worker_steps",
        "rollout/tokens_per_occupied_worker_step", "scheduler/mae")


def deterministic(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith(SAME)}


def same_numbers(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


# ------------------------------------------------------------------------------------- Slurm


def test_hostlist_expansion():
    assert expand_hostlist("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert expand_hostlist("node7") == ["node7"]
    assert expand_hostlist("a[8-11]") == ["a8", "a9", "a10", "a11"]
    assert expand_hostlist("r[1-2]n[01-02],login") == ["r1n01", "r1n02", "r2n01", "r2n02", "login"]
    for bad in ("gpu[01-03", "gpu[a-b]", "gpu[1-[2]]"):
        with pytest.raises(ValueError, match="host list"):
            expand_hostlist(bad)


def test_the_stop_line_says_resume_only_where_the_same_command_resumes(tmp_path):
    """A stop's last line (`launch.local.to_go_on`) from what checkpoint.dir holds: a worker
    sees the workers' files; a Ray driver that finds none cannot tell, and says so."""
    from flexfloor.config import CheckpointConfig, Resume
    from flexfloor.launch.local import Saved, to_go_on

    def line(here=True, **cfg):
        return to_go_on(Saved.standing("w", CheckpointConfig(**cfg), here=here))

    again = "run the same command again to start it again (nothing to resume from)"
    assert line() == again  # no checkpoint.dir
    assert line(dir=str(tmp_path)) == again  # nothing saved there yet
    assert "if there is one" in line(dir=str(tmp_path), here=False)
    (tmp_path / "latest").write_text("iter_0000002\n")
    assert line(dir=str(tmp_path)) == "run the same command again to resume"
    assert line(dir=str(tmp_path), here=False) == "run the same command again to resume"
    # resume=off never reads checkpoint.dir: the same command starts again
    assert line(dir=str(tmp_path), resume=Resume.OFF) == (
        "checkpoint.resume=off: the same command starts again; run it with "
        "checkpoint.resume=auto to resume")
    assert line(dir=str(tmp_path / "none"), resume=Resume.OFF) == again


def slurm_env(nodelist: str, nnodes: int, node: str, node_id: int, **extra) -> dict:
    """What Slurm sets in a batch script / a job step (the parts the launcher reads)."""
    return {"SLURM_JOB_ID": "734512", "SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": str(nnodes),
            "SLURMD_NODENAME": node, "SLURM_NODEID": str(node_id), "SLURM_PROCID": str(node_id),
            "SLURM_SUBMIT_DIR": REPO, **extra}


def test_allocation_reads_slurm_variables():
    env = slurm_env("gpu[01-03,07]", 4, "gpu07", 3, SLURM_GPUS_ON_NODE="8",
                    SLURM_NTASKS_PER_NODE="1", SLURM_CPUS_ON_NODE="64", SLURM_CPUS_PER_TASK="32")
    a = Allocation.from_env(env)
    assert (a.nodes, a.head, a.node_rank, a.procs_per_node, a.num_workers, a.cpus_per_task) == (
        ("gpu01", "gpu02", "gpu03", "gpu07"), "gpu01", 3, 8, 32, 32)
    cpu = Allocation.from_env(slurm_env("c[1-2]", 2, "c2", 1, SLURM_NTASKS_PER_NODE="4(x2)"))
    assert (cpu.node_rank, cpu.procs_per_node, cpu.gpus_on_node, cpu.cpus_per_task) == (1, 4, 0, 0)
    with pytest.raises(ValueError, match="SLURM_NNODES=3"):
        Allocation.from_env(slurm_env("c[1-2]", 3, "c1", 0))
    with pytest.raises(ValueError, match="SLURM_JOB_ID"):
        Allocation.from_env({})


STAND_IN_SRUN = f"""#!{sys.executable}
# srun stand-in: records its arguments; with SRUN_RUN=1 it starts the task once, with the step
# variables Slurm sets on the first node (a one-node allocation)
import json, os, sys
args = sys.argv[1:]
with open(os.environ["SRUN_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if os.environ.get("SRUN_RUN") == "1":
    task = next(i for i, a in enumerate(args) if not a.startswith("-"))
    os.environ.update(SLURM_PROCID="0", SLURM_NODEID="0", SLURM_LOCALID="0", SLURM_STEP_ID="0")
    os.execvp(args[task], args[task:])
"""


def stand_in_env(tmp) -> tuple[dict, object]:
    """An environment with the stand-in `srun` first on PATH, and the file it records to."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(STAND_IN_SRUN)
    (bin_dir / "srun").chmod(0o755)
    log = tmp / "srun.jsonl"
    home = tmp / "home"  # the job must not read or write the real home (e.g. ~/.ray/auth_token)
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SRUN_LOG=str(log), HOME=str(home),
               PYTHON=sys.executable, PYTHONPATH=REPO, OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", RAY_USAGE_STATS_ENABLED="0",
               # every process of the job carries it: `end_job` finds them all (the Ray driver
               # runs in a process group of its own)
               FLEXFLOOR_TEST_JOB=f"{tmp}-{time.monotonic_ns()}")
    return env, log


@pytest.fixture
def fake_srun(tmp_path):
    return stand_in_env(tmp_path)


def node_stage(srun_args: list[str], env: dict, capsys) -> list:
    """Run the per-node stage srun would start (its args after `python -m ...slurm`), dry."""
    stage = srun_args[srun_args.index("flexfloor.launch.slurm") + 1:]
    old = dict(os.environ)
    os.environ.update(env)
    try:
        assert slurm_main(stage + ["--dry-run"]) == 0
    finally:
        os.environ.clear()
        os.environ.update(old)
    return json.loads(capsys.readouterr().out)


def sbatch(script: str, env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = ["bash", os.path.join(REPO, "examples", "slurm", script), *args]
    popen = subprocess.Popen(cmd, env=env, cwd="/", stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = popen.communicate(timeout=timeout)
    finally:  # a real torchrun leaves nothing behind, even when the test fails
        end_job(popen)
    return subprocess.CompletedProcess(cmd, popen.returncode, out, "")


def test_torchrun_sbatch_on_four_nodes(fake_srun, capsys):
    env, log = fake_srun
    nodes = ["gpu01", "gpu02", "gpu03", "gpu07"]
    batch = dict(env, **slurm_env("gpu[01-03,07]", 4, "gpu01", 0, SLURM_GPUS_ON_NODE="8",
                                  SLURM_NTASKS_PER_NODE="1", SLURM_CPUS_PER_TASK="32"))
    proc = sbatch("grpo_moe.sbatch", batch, "trainer.steps=3")
    assert proc.returncode == 0, proc.stdout
    (srun,) = [json.loads(line) for line in log.read_text().splitlines()]
    # --cpus-per-task passed on: srun (Slurm >= 22.05) does not inherit it from sbatch
    assert srun[:6] == ["--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--cpus-per-task=32",
                        "--kill-on-bad-exit=1", sys.executable]
    port = 29500 + 734512 % 2000
    for rank, node in enumerate(nodes):
        # inside the step Slurm sets the node's own name and id; GPUs per node stay visible
        cmd = node_stage(srun, dict(env, **slurm_env("gpu[01-03,07]", 4, node, rank,
                                                     SLURM_GPUS_ON_NODE="8")), capsys)
        assert cmd[:3] == [sys.executable, "-m", "flexfloor.launch.local"]
        assert cmd[3:9] == ["--nnodes=4", f"--node-rank={rank}", "--nproc-per-node=8",
                            "--rdzv-backend=static", f"--rdzv-endpoint=gpu01:{port}",
                            "--rdzv-id=734512"]
        assert cmd[9:] == ["-m", "flexfloor.train", "--config", "examples/configs/grpo_tiny.yaml",
                           "trainer.steps=3", "parallel.world_size=32"]


def test_torchrun_sbatch_max_restarts_on_four_nodes(fake_srun, capsys):
    """MAX_RESTARTS=0 builds the commands of a job without it, exactly (static rendezvous, node
    rank = place in the node list); MAX_RESTARTS=2 gives every node's torchrun the c10d
    rendezvous at the first node (no fixed node rank: c10d numbers the nodes) and the restarts."""
    env, log = fake_srun
    nodes = ["gpu01", "gpu02", "gpu03", "gpu07"]
    batch = dict(env, **slurm_env("gpu[01-03,07]", 4, "gpu01", 0, SLURM_GPUS_ON_NODE="8",
                                  SLURM_NTASKS_PER_NODE="1", SLURM_CPUS_PER_TASK="32"))
    plans = {}
    for value in (None, "0", "2"):
        log.unlink(missing_ok=True)
        extra = {} if value is None else {"MAX_RESTARTS": value}
        proc = sbatch("grpo_moe.sbatch", dict(batch, **extra), "trainer.steps=3")
        assert proc.returncode == 0, proc.stdout
        (srun,) = [json.loads(line) for line in log.read_text().splitlines()]
        plans[value] = (srun, [node_stage(srun, dict(env, **slurm_env(
            "gpu[01-03,07]", 4, node, rank, SLURM_GPUS_ON_NODE="8")), capsys)
            for rank, node in enumerate(nodes)])
    assert plans["0"] == plans[None]  # 0: nothing changes
    assert "--rdzv-backend=static" in plans["0"][1][0]
    srun, cmds = plans["2"]
    stage = srun[srun.index("flexfloor.launch.slurm") + 1:]
    assert stage[:3] == ["torchrun-node", "--nproc-per-node=8", "--max-restarts=2"]
    port = 29500 + 734512 % 2000
    for rank, (node, cmd) in enumerate(zip(nodes, cmds)):
        assert cmd == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.executable, "-m",
                       "flexfloor.launch.local", "--nnodes=4", "--nproc-per-node=8",
                       "--rdzv-backend=c10d", f"--rdzv-endpoint=gpu01:{port}", "--rdzv-id=734512",
                       f"--rdzv-conf=is_host={int(rank == 0)},read_timeout=600",
                       f"--local-addr={node}",
                       "--max-restarts=2", "-m", "flexfloor.train", "--config",
                       "examples/configs/grpo_tiny.yaml", "trainer.steps=3",
                       "parallel.world_size=32"]


@pytest.mark.parametrize("how", ["sbatch", "stage", "node"])
def test_slurm_refuses_a_negative_max_restarts(how, fake_srun):
    env, log = fake_srun
    env = dict(env, **slurm_env("gpu[01-02]", 2, "gpu01", 0, SLURM_GPUS_ON_NODE="8"))
    if how == "sbatch":
        proc = sbatch("grpo_moe.sbatch", dict(env, MAX_RESTARTS="-1"), timeout=60)
        err = proc.stdout
    else:
        stage = "torchrun" if how == "stage" else "torchrun-node"
        proc = subprocess.run([sys.executable, "-m", "flexfloor.launch.slurm", stage,
                               "--max-restarts", "-1", "--config", CONFIG], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        err = proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert err.strip().splitlines() == (
        ["grpo_moe.sbatch: MAX_RESTARTS=-1: must be a whole number, 0 or more"] if how == "sbatch"
        else ["slurm: --max-restarts -1: must be a whole number, 0 or more (0: a failed worker "
              "ends the job)"])
    assert not log.exists()  # nothing started


def test_slurm_refuses_bad_numbers_and_a_bad_config_before_srun(fake_srun):
    """Each stage's numbers, and the sbatch scripts' variables (named as the user set them),
    are refused in one line with exit 2; the batch-step stages check the config once before
    srun starts anything on the nodes (under torchrun each node's launcher would say it again,
    after the allocation's nodes started; under Ray after the Ray nodes started)."""
    env, log = fake_srun
    env = dict(env, **slurm_env("gpu[01-02]", 2, "gpu01", 0, SLURM_GPUS_ON_NODE="8"))
    for flag, value, says in (("--nproc-per-node", "0", "must be a whole number, 1 or more"),
                              ("--port", "99999", "must be a whole number, 1-65535 (a TCP port)"),
                              ("--head-timeout-s", "nan", "must be a finite number above 0"),
                              ("--max-restarts", "two", "must be a whole number, 0 or more")):
        for stage in ("torchrun", "ray-node"):
            proc = subprocess.run([sys.executable, "-m", "flexfloor.launch.slurm", stage, flag,
                                   value, "--dry-run", "--config", CONFIG], env=env, cwd=REPO,
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == 2, (flag, stage, proc.stdout + proc.stderr)
            assert proc.stderr.strip().splitlines() == [f"slurm: {flag} {value}: {says}"
                                                        + proc.stderr.split(says)[1].rstrip()]
    for script, var, value, says in (
            ("grpo_moe.sbatch", "NPROC", "abc", "must be a whole number, 1 or more"),
            ("grpo_moe_ray.sbatch", "PORT", "0", "must be a whole number, 1-65535"),
            ("grpo_moe.sbatch", "CONFIG", "nope.yaml", "config error: --config: nope.yaml does "
             "not exist; give the path of a YAML file"),
            ("grpo_moe_ray.sbatch", "CONFIG", "nope.yaml", "config error: --config: nope.yaml "
             "does not exist; give the path of a YAML file")):
        proc = sbatch(script, dict(env, **{var: value}), timeout=60)
        line = f"{script}: {var}={value}: {says}" if var != "CONFIG" else says
        assert proc.returncode == 2 and proc.stdout.strip().startswith(line), proc.stdout
        assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    for script in ("grpo_moe.sbatch", "grpo_moe_ray.sbatch"):  # an override the config refuses
        proc = sbatch(script, env, "trainer.stesp=3", timeout=60)
        assert proc.returncode == 2, proc.stdout
        assert proc.stdout.startswith("config error: trainer.stesp: unknown key; did you mean "
                                      "'steps'?"), proc.stdout
    assert not log.exists()  # srun never ran


def test_ray_stage_passes_max_restarts_to_the_driver(fake_srun):
    env, _ = fake_srun
    env = dict(env, **slurm_env("gpu[01-02]", 2, "gpu01", 0, SLURM_GPUS_ON_NODE="8"))
    proc = subprocess.run([sys.executable, "-m", "flexfloor.launch.slurm", "ray", "--dry-run",
                           "--max-restarts", "2", "--config", "my.yaml", "trainer.steps=3"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    driver = json.loads(proc.stdout)["driver"]
    assert driver[4:] == ["--num-workers=16", "--max-restarts=2", "--config", "my.yaml",
                          "trainer.steps=3", "parallel.world_size=16"]


def test_ray_sbatch_on_four_nodes(fake_srun, capsys):
    env, _ = fake_srun
    batch = dict(env, **slurm_env("gpu[01-03,07]", 4, "gpu01", 0, SLURM_GPUS_ON_NODE="8",
                                  SLURM_CPUS_ON_NODE="64", SLURM_CPUS_PER_TASK="64"))
    # the batch stage's plan (it would start the nodes with srun, then the driver)
    proc = subprocess.run([sys.executable, "-m", "flexfloor.launch.slurm", "ray", "--dry-run",
                           "--config", "my.yaml", "--cpus-per-worker", "4", "trainer.steps=3"],
                          env=batch, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    port = 6379 + 734512 % 2000
    assert plan["nodes"][:6] == ["srun", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1",
                                 "--cpus-per-task=64", "--kill-on-bad-exit=1"]
    assert plan["driver"] == [sys.executable, "-m", "flexfloor.launch.ray", f"--address=gpu01:{port}",
                              "--num-workers=32", "--config", "my.yaml", "--cpus-per-worker", "4",
                              "trainer.steps=3", "parallel.world_size=32"]
    for rank, node in enumerate(["gpu01", "gpu02", "gpu03", "gpu07"]):
        cmd = node_stage(plan["nodes"][1:], dict(env, **slurm_env(
            "gpu[01-03,07]", 4, node, rank, SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="64")), capsys)
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        tail = ["--num-cpus=64", "--num-gpus=8", "--block"]
        if rank == 0:
            assert cmd == [ray_bin, "start", "--head", "--node-ip-address=gpu01", f"--port={port}",
                           "--include-dashboard=false", "--disable-usage-stats", *tail]
        else:
            assert cmd == [ray_bin, "start", f"--address=gpu01:{port}", *tail]


def test_ray_auth_env_is_one_fresh_token_in_the_environment_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    a, b = ray_auth_env({}), ray_auth_env({})
    assert a["RAY_AUTH_MODE"] == "token" and re.fullmatch(r"[0-9a-f]{64}", a["RAY_AUTH_TOKEN"])
    assert a["RAY_AUTH_TOKEN"] != b["RAY_AUTH_TOKEN"]  # made per job, never read from a file
    assert list(tmp_path.iterdir()) == []  # nothing written to the home directory
    # the user's choice wins: disabled (or another mode) as is, their own token kept
    assert ray_auth_env({"RAY_AUTH_MODE": "disabled"}) == {}
    assert ray_auth_env({"RAY_AUTH_MODE": "DISABLED", "RAY_AUTH_TOKEN": "x"}) == {}
    assert ray_auth_env({"RAY_AUTH_TOKEN": "mine"}) == {"RAY_AUTH_MODE": "token"}
    assert ray_auth_env({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/shared/t"}) == {
        "RAY_AUTH_MODE": "token"}


@pytest.mark.parametrize("script", ["grpo_moe.sbatch", "grpo_moe_ray.sbatch"])
def test_sbatch_outside_the_repository_root_says_so(script, fake_srun, tmp_path):
    env, log = fake_srun
    proc = sbatch(script, dict(env, **slurm_env("localhost", 1, "localhost", 0,
                                                SLURM_SUBMIT_DIR=str(tmp_path))), timeout=60)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == [
        f"{script}: no flexfloor/ in {tmp_path}: submit the job from the FlexFloor repository root"]
    assert not log.exists()  # nothing started


def test_ray_stage_stops_when_the_ray_nodes_srun_ends(fake_srun):
    """The srun of the Ray nodes exits at once (the stand-in starts no task): the batch stage
    stops waiting for the head and ends with one line, exit 1, long before --head-timeout-s."""
    env, log = fake_srun
    # 4 workers: the config's EP group (the stage checks the config before srun)
    env = dict(env, **slurm_env("localhost", 1, "localhost", 0, SLURM_NTASKS_PER_NODE="4"))
    # timeout 120 < --head-timeout-s 300: a stage that waited for the head would be killed
    proc = subprocess.run([sys.executable, "-m", "flexfloor.launch.slurm", "ray",
                           f"--port={free_port()}", "--head-timeout-s=300", "--config", CONFIG],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert re.fullmatch(r"\[flexfloor.launch.slurm\] error: the Ray nodes' srun ended \(exit "
                        r"status 0\) before the head answered at 127\.0\.0\.1:\d+; see its "
                        r"output above", line), line
    (srun,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert srun[srun.index("flexfloor.launch.slurm") + 1] == "ray-node"


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """The tiny job through grpo_moe.sbatch on one node (4 CPU workers), for real."""
    tmp = tmp_path_factory.mktemp("sbatch")
    env, log = stand_in_env(tmp)
    env.update(SRUN_RUN="1", PORT=str(free_port()),
               **slurm_env("localhost", 1, "localhost", 0, SLURM_NTASKS_PER_NODE="4",
                           SLURM_CPUS_ON_NODE="2"))
    t0 = time.perf_counter()
    proc = sbatch("grpo_moe.sbatch", env, *TINY, f"logging.run_dir={tmp}/run")
    assert proc.returncode == 0, proc.stdout[-6000:]
    with open(tmp / "run" / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    return {"metrics": metrics, "stdout": proc.stdout, "seconds": time.perf_counter() - t0,
            "srun": [json.loads(x) for x in log.read_text().splitlines()]}


def test_torchrun_sbatch_runs_on_one_node(torchrun_run):
    (srun,) = torchrun_run["srun"]
    assert srun[:2] == ["--nodes=1", "--ntasks=1"]
    assert "--nproc-per-node=4" in srun  # from SLURM_NTASKS_PER_NODE
    assert [m["step"] for m in torchrun_run["metrics"]] == [1, 2]
    assert "--rdzv-endpoint=localhost:" in torchrun_run["stdout"]  # the command it printed


def test_torchrun_nodes_restart_together_after_a_worker_dies(tmp_path):
    """Two nodes on this machine (each `torchrun-node --max-restarts 1` for real, c10d at
    127.0.0.1, one worker each): rank 1, on the second node, is killed in step 2 (SIGKILL,
    FLEXFLOOR_FAULT) as it waits, released, at resync; both nodes' agents start their workers
    again, which resume from step 1's checkpoint, and the job ends well on both nodes with every
    step logged once. The first node's healthy worker, still decoding, never takes its agent's
    SIGTERM for a preemption (its agent marks the restart): it would otherwise finish its
    rollout and wait at resync for the dead peer until the agent killed it 30 s later. (A kill
    in the update's collectives: tests/test_faults.py, on one node.)"""
    fault = "resync:1:2"
    port, marker = free_port(), f"c10d-{os.getpid()}-{time.monotonic_ns()}"
    args = [*TINY, "parallel.expert_parallel_size=2", f"logging.run_dir={tmp_path}/run",
            f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.save_interval=1"]
    jobs, t0 = [], time.perf_counter()
    try:
        for rank, node in enumerate(["127.0.0.1", "localhost"]):  # both name this machine
            env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                       FLEXFLOOR_FAULT=fault, FLEXFLOOR_TEST_JOB=marker,
                       **slurm_env("127.0.0.1,localhost", 2, node, rank,
                                   SLURM_NTASKS_PER_NODE="1"))
            out = open(tmp_path / f"node{rank}.log", "w")
            jobs.append(subprocess.Popen(
                [sys.executable, "-m", "flexfloor.launch.slurm", "torchrun-node",
                 f"--port={port}", "--max-restarts=1", "--config", CONFIG, *args],
                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            out.close()
        codes = [job.wait(timeout=180) for job in jobs]
    finally:
        for job in jobs:
            end_job(job, marker)
    seconds = time.perf_counter() - t0
    logs = [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-4000:] for log in logs)
    assert all("--rdzv-backend=c10d" in log for log in logs)
    # c10d ranked the nodes by sorted --local-addr: rank 1 is the second node's
    phase = fault.split(":")[0]
    assert f"fault injection: SIGKILL rank 1 in phase '{phase}', step 2" in logs[1]
    assert logs[0].count("resumed from iter_0000001") == 1, logs[0][-4000:]
    assert "finishing the step in progress" not in logs[0], logs[0][-4000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == [1, 2]
    assert wait_gone(job_processes(marker), 10) == []
    print(f"2 nodes, a worker killed in phase {phase}, both restarted: {seconds:.1f} s")
    print("\n".join(x for x in logs[0].splitlines() if "SIGTERM" in x or "error:" in x))


def wait_gone(pids: list[int], timeout_s: float = 60) -> list[int]:
    """The pids still alive after waiting up to `timeout_s` for them to exit."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if _alive(p)]
    return alive


# ------------------------------------------------------------------------------ resource pool


def test_resource_pool_lends_until_rejoin():
    async def scenario():
        pool = ResourcePool()
        entry = {"rank": 3, "step": 1, "node_id": "n1", "node_ip": "10.0.0.2", "gpu_ids": ["5"],
                 "cpus": 1.0, "engine_step": 0, "release_s": 0.01}
        claim = asyncio.create_task(pool.claim("eval"))   # waits: nothing is free yet
        await asyncio.sleep(0)
        assert not claim.done()
        lease = await pool.released(entry)
        lent = await claim
        assert (lent["rank"], lent["lease"], lent["claimed_by"]) == (3, lease, "eval")
        assert await pool.claim("other", timeout_s=0.01) is None  # one borrower per release
        back = asyncio.create_task(pool.wait_rejoined(lease))
        await asyncio.sleep(0)
        assert not back.done() and [e["rank"] for e in await pool.free()] == [3]
        await pool.rejoined(3, 1)
        assert await back is True and await pool.free() == []
        return [(e["event"], e["rank"], e["step"], e["claimed_by"]) for e in await pool.events()]

    assert asyncio.run(scenario()) == [("released", 3, 1, None), ("claimed", 3, 1, "eval"),
                                       ("rejoined", 3, 1, "eval")]


def test_resource_pool_withdraw_ends_every_lease():
    """A restart of every worker ends the leases of the lost attempt: a borrower's
    `wait_rejoined` returns, nothing stays free, and the record says why."""
    async def scenario():
        pool = ResourcePool()
        entry = {"step": 2, "node_id": "n1", "node_ip": "10.0.0.2", "gpu_ids": [], "cpus": 1.0,
                 "engine_step": 0, "release_s": 0.01}
        for rank in (2, 3):
            await pool.released(dict(entry, rank=rank))
        lent = await pool.claim("eval")
        back = asyncio.create_task(pool.wait_rejoined(lent["lease"]))
        await asyncio.sleep(0)
        assert not back.done()
        assert await pool.withdraw("restart 1") == 2
        assert await back is True and await pool.free() == []
        assert await pool.withdraw("restart 2") == 0
        return [(e["event"], e["rank"], e.get("reason")) for e in await pool.events()
                if e["event"] == "withdrawn"]

    assert asyncio.run(scenario()) == [("withdrawn", 2, "restart 1"), ("withdrawn", 3, "restart 1")]


# -------------------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def ray_cluster():
    """A real Ray cluster of two CPU nodes (2 logical CPUs each) on this machine; always shut
    down, and no worker process may outlive it."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray
    from ray.cluster_utils import Cluster

    # a crashed node is found dead after 3 missed health checks, 1 s apart (Ray's default
    # takes about 15 s)
    checks = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "_system_config": checks})
    pids = []
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster, pids
    finally:
        ray.shutdown()
        cluster.shutdown()
    alive = wait_gone(pids)
    assert not alive, f"worker processes left after the cluster shut down: {alive}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def assert_same_steps(ours: list[dict], ref: list[dict]) -> None:
    """Steps 1 and 2 of two runs of the tiny job: the same tokens, rewards, losses."""
    assert [m["step"] for m in ours] == [m["step"] for m in ref] == [1, 2]
    for a, b in zip(ours, ref):
        a, b = deterministic(a), deterministic(b)
        assert a.keys() == b.keys() and len(a) >= 10
        assert all(same_numbers(a[k], b[k]) for k in a), {k: (a[k], b[k]) for k in a
                                                          if a[k] != b[k]}


def test_ray_job_equals_torchrun_and_lends_released_workers(ray_cluster, torchrun_run, tmp_path):
    import ray

    from flexfloor.config import load_config
    from flexfloor.launch.pool import NAMESPACE
    from flexfloor.launch.ray import launch

    cluster, pids = ray_cluster
    ray.init(address=cluster.address, namespace=NAMESPACE)

    @ray.remote(num_cpus=0)
    def borrow(pool_name):
        """Other Ray work: find the pool by name, wait for a released worker, hold it until it
        rejoins."""
        from flexfloor.launch.pool import get_pool

        while True:
            try:
                pool = get_pool(pool_name)
                break
            except ValueError:  # the job has not created it yet
                time.sleep(0.2)
        lent = ray.get(pool.claim.remote("test-borrower", timeout_s=300))
        back = ray.get(pool.wait_rejoined.remote(lent["lease"], timeout_s=300))
        return lent, back

    borrower = borrow.remote("test-pool")
    cfg = load_config(CONFIG, TINY + [f"logging.run_dir={tmp_path}/run"]).resolve_world(4)
    try:
        result = launch(cfg, num_workers=4, timeout_s=300, pool_name="test-pool")
        lent, back = ray.get(borrower, timeout=60)
    finally:
        pids += [w["pid"] for w in result.workers] if "result" in locals() else []
        ray.shutdown()

    # placement: PACK fills a node before the next; ranks follow the nodes
    nodes = [w["node_id"] for w in result.workers]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert [w["local_rank"] for w in result.workers] == [0, 1, 0, 1]
    assert all(w["cpus"] == 1.0 and w["gpu_ids"] == [] for w in result.workers)

    # the same job under torchrun: the same tokens, rewards, losses, step for step
    ref = torchrun_run["metrics"]
    assert_same_steps(result.metrics, ref)

    # the pool saw the ranks that left early (fewer engine steps than the last one, in the
    # torchrun run of the same tokens) released in both steps, each back at its step's resync
    events = [(e["event"], e["rank"], e["step"]) for e in result.pool_events if e["event"] != "claimed"]
    early_all = set()
    for step, m in zip((1, 2), ref):
        early = {r for r, n in enumerate(m["rollout/steps"]) if n < max(m["rollout/steps"])}
        assert early, m["rollout/steps"]  # the test needs a release to lend
        released = {r for ev, r, s in events if ev == "released" and s == step}
        rejoined = {r for ev, r, s in events if ev == "rejoined" and s == step}
        assert released == rejoined == early, (events, m["rollout/steps"])
        early_all |= early
    for ev, rank, step in events:  # a rank rejoins only after it was released, per step
        if ev == "rejoined":
            assert events.index(("released", rank, step)) < events.index((ev, rank, step))
    released = [e for e in result.pool_events if e["event"] == "released"]
    assert {e["rank"] for e in released} == early_all

    # the borrower got one of them and held it until that rank rejoined
    assert lent["rank"] in early_all and (lent["claimed_by"], back) == ("test-borrower", True)
    assert lent["node_id"] == result.workers[lent["rank"]]["node_id"]
    assert lent["cpus"] == 1.0 and lent["step"] in (1, 2)
    claimed = [e for e in result.pool_events if e["event"] == "claimed"]
    assert [(e["rank"], e["lease"]) for e in claimed] == [(lent["rank"], lent["lease"])]


# case -> (checkpoint.dir set, where rank 1 dies, its step, the step lines the driver prints)
RESTARTS = {
    # after step 1 returned, the node of ranks 2 and 3 (or 0 and 1) is lost: the restart waits
    # until a new node takes their bundles, and the new Jobs resume from step 1's checkpoint
    "node_lost": (True, "node", 2, ["1/2", "2/2"]),
    # with nothing to resume from, both steps again: the lost attempt's metrics are replaced
    "no_checkpoint_dir": (False, "step", 2, ["1/2", "1/2", "2/2"]),
    # killed once step 1's checkpoint is complete, before the step returned: its metrics come
    # from metrics.jsonl (flexfloor.faults, phase `saved`)
    "after_its_checkpoint": (True, "saved", 1, ["2/2"]),
}


@pytest.mark.parametrize("case", list(RESTARTS))
def test_ray_job_restarts_after_a_worker_dies_and_equals_torchrun(ray_cluster, torchrun_run,
                                                                 tmp_path, case, monkeypatch):
    """`max_restarts` under Ray: rank 1's process is killed, or the other node is lost
    (`RESTARTS`). Every worker is started again, the new Jobs resume from checkpoint.dir (or
    start again at step 0), and the run's metrics equal the uninterrupted torchrun run's, step
    for step."""
    import ray

    from flexfloor.config import load_config
    from flexfloor.launch.pool import NAMESPACE
    from flexfloor.launch.ray import launch

    cluster, pids = ray_cluster
    ray.init(address=cluster.address, namespace=NAMESPACE)
    lines: list[str] = []
    started: list[tuple[int, int]] = []  # (rank, pid) of every attempt's workers, in order
    victim = []
    nodes: dict[int, str] = {}  # rank -> node id (its first 8 hex digits), the last attempt's
    (other,) = cluster.worker_nodes  # the node that is not the head
    added = []

    def say(text: str) -> None:
        lines.append(text)
        m = re.match(r"rank (\d+): node \S+ \((\w+)\) pid (\d+) ", text)
        if m:
            started.append((int(m[1]), int(m[3])))
            nodes[int(m[1])] = m[2]
        if when == "step" and text.startswith("step 1/") and not victim:
            victim.append(dict(started)[1])  # the first attempt's
            os.kill(victim[0], signal.SIGKILL)
        if when == "node" and text.startswith("step 1/") and not victim:
            lost = sorted(r for r, n in nodes.items() if other.node_id.startswith(n))
            victim.append({r: dict(started)[r] for r in lost})  # one of them is named
            victim.append(lost)
            cluster.remove_node(other, allow_graceful=False)  # a crash: SIGKILL to its raylet
        if when == "node" and re.match(r"restart 1: waiting up to \d+ s for Ray", text) and not added:
            added.append(cluster.add_node(num_cpus=2))  # a new node, as an autoscaler adds

    resume, when, died_in, steps = RESTARTS[case]
    if when == "saved":  # the driver passes the fault plan on to the workers
        monkeypatch.setenv("FLEXFLOOR_FAULT", "saved:1:1")
    saving = [f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.save_interval=1"] if resume else []
    cfg = load_config(CONFIG, TINY + [f"logging.run_dir={tmp_path}/run", *saving]
                      ).resolve_world(4)
    try:
        result = launch(cfg, num_workers=4, timeout_s=300, pool_name=f"restart-pool-{case}",
                        max_restarts=1, say=say)
    finally:
        pids += [pid for _, pid in started]
        ray.shutdown()

    if when == "saved":
        victim.append(started[1][1])  # rank 1 of the first attempt
    assert result.restarts == 1 and victim, lines
    (restart,) = [x for x in lines if "restart 1 of 1" in x]
    named = victim[0] if when == "node" else {1: victim[0]}  # rank -> pid
    assert any(re.match(rf"rank {r} \(node [0-9.]+, pid {pid}\) died during step {died_in}",
                        restart) for r, pid in named.items()), restart
    placing = [x for x in lines if x.startswith("restart 1: ")]
    if when == "node":  # the restart waited for the lost bundles, then placed them on the new node
        assert len(victim[1]) == 2 and added, lines
        assert re.fullmatch(r"restart 1: waiting up to \d+ s for Ray to place 2 of 4 workers "
                            r"\(\{'CPU': 1\.0\} each; bundles \[\d, \d\], ranks "
                            + re.escape(f"{victim[1]} before: their node is gone); the cluster "
                                        "has 1 node alive, 0 CPU, 0 GPU free"), placing[0]), placing
        assert re.fullmatch(r"restart 1: every worker's bundle is placed again after \d+ s",
                            placing[1]), placing
        assert {nodes[r] for r in victim[1]} == {added[0].node_id[:8]}
    else:  # the node is there: nothing to wait for
        assert not placing, placing
    assert restart.endswith(f"resumes from the newest checkpoint in checkpoint.dir ({tmp_path}/ckpt)"
                            if resume else "starts at step 0 (no checkpoint.dir to resume from)")
    first, second = started[:4], started[4:]
    assert [r for r, _ in first] == [r for r, _ in second] == [0, 1, 2, 3]
    assert not {p for _, p in first} & {p for _, p in second}  # new processes
    assert [x.split()[1] for x in lines if x.startswith("step ")] == steps
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == [1, 2]
    assert_same_steps(result.metrics, torchrun_run["metrics"])
    # every lease ended: at its rank's rejoin, or withdrawn at the restart
    leases = {e["lease"]: e["event"] for e in result.pool_events if e["event"] != "claimed"}
    released = {e["lease"] for e in result.pool_events if e["event"] == "released"}
    ended = [e["lease"] for e in result.pool_events if e["event"] in ("rejoined", "withdrawn")]
    assert released and sorted(ended) == sorted(released), leases


def test_ray_placement_that_never_comes_names_the_bundles_and_the_free_resources(ray_cluster):
    """More workers than the cluster has CPUs: the wait says what it waits for, again while it
    waits, and ends past its timeout naming the bundles, the free resources and the fix."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from flexfloor.launch.pool import NAMESPACE
    from flexfloor.launch.ray import LaunchError, _wait_placed

    cluster, _ = ray_cluster
    ray.init(address=cluster.address, namespace=NAMESPACE)
    lines: list[str] = []
    cpus = int(ray.cluster_resources()["CPU"])
    nodes = sum(n["Alive"] for n in ray.nodes())
    pg = placement_group([{"CPU": 1.0}] * (cpus + 1), strategy="PACK")  # one CPU too many
    try:
        with pytest.raises(LaunchError) as e:
            _wait_placed(pg, {"CPU": 1.0}, time.monotonic() + 4, 4, lines.append, "placement",
                         quiet_s=1, every_s=1)
    finally:
        remove_placement_group(pg)
    try:  # a group removed (by another driver): said at once, not waited for
        with pytest.raises(LaunchError, match=rf"^restart 1: the placement group of the {cpus + 1} "
                           r"workers was removed \(by another driver or `ray` command\?\); run again$"):
            _wait_placed(pg, {"CPU": 1.0}, time.monotonic() + 60, 60, print, "restart 1")
    finally:
        ray.shutdown()
    n, free = cpus + 1, f"the cluster has {nodes} nodes alive, {cpus} CPU, 0 GPU free"
    assert re.fullmatch(rf"placement: waiting up to [23] s for Ray to place {n} of {n} workers "
                        rf"\(\{{'CPU': 1\.0\}} each\); {free}", lines[0]), lines
    assert all(re.fullmatch(rf"placement: still waiting for {n} bundles \(\d s\); {free}", x)
               for x in lines[1:]) and len(lines) >= 2, lines
    assert str(e.value) == (
        f"placement: Ray could not place {n} of {n} workers ({{'CPU': 1.0}} each, bundles "
        f"{list(range(n))}) within 4 s; {free}: add a node (or let the autoscaler add one), or "
        "run again with fewer --num-workers / --cpus-per-worker / --gpus-per-worker")
    assert not e.value.worker_lost


def test_ray_launcher_refuses_a_negative_max_restarts():
    proc = subprocess.run([sys.executable, "-m", "flexfloor.launch.ray", "--config", CONFIG,
                           "--num-workers", "2", "--max-restarts", "-1"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert "--max-restarts -1: must be 0 or more" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flag, values, rule", [pytest.param(*p, id=p[0][2:]) for p in [
    ("--num-workers", ["0", "-2"], "1 or more"),
    ("--cpus-per-worker", ["-1", "0", "0.00001", "nan"], "0.0001 or more"),
    ("--gpus-per-worker", ["-1", "0.00001", "inf"], "0 or at least 0.0001"),
    ("--timeout-s", ["0", "-5", "nan", "inf"], "more than 0"),
]])
def test_ray_launcher_refuses_bad_numbers_before_ray_starts(flag, values, rule):
    """Each bad number: exit status 2 with one line naming the flag and the value, before Ray
    starts (Ray would raise a traceback, or wait --timeout-s for nothing)."""
    for value in values:
        workers = [] if flag == "--num-workers" else ["--num-workers", "4"]
        proc = subprocess.run([sys.executable, "-m", "flexfloor.launch.ray", "--config", CONFIG,
                               *workers, flag, value, *TINY], capture_output=True, text=True,
                              cwd=REPO, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert not proc.stdout, proc.stdout  # nothing started: not even the Ray auth line
        shown = f"{float(value):g}" if flag != "--num-workers" else value
        assert re.fullmatch(rf"python -m flexfloor\.launch\.ray: error: {flag} {shown}: must be "
                            rf"(a finite number, )?{re.escape(rule)} \(.+\)",
                            proc.stderr.strip().splitlines()[-1]), proc.stderr


def test_ray_driver_refuses_more_gpus_than_its_own_local_cluster_has(tmp_path):
    """No --address, no RAY_ADDRESS: the driver starts its own cluster, which no node can join;
    GPUs it lacks (this machine has none; a machine with fewer than 4 as well) are refused at
    once, not waited for (--timeout-s)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flexfloor.launch.ray", "--config", CONFIG,
                           "--num-workers", "4", "--gpus-per-worker", "1", *TINY,
                           f"logging.run_dir={tmp_path}/run"], capture_output=True, text=True,
                          cwd=REPO, env=dict(env, RAY_USAGE_STATS_ENABLED="0"), timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert took < 60, took
    line = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"\[flexfloor\.launch\.ray\] error: the workers ask for 4 GPU \(--num-workers 4 x "
        r"--gpus-per-worker 1\), but the local Ray cluster started here has \d+ CPU and [0-3] GPU, "
        r"and no other node can join it: run with fewer --num-workers, --gpus-per-worker 0 "
        r"\(CPU workers\), or --address of a cluster that has them", line), proc.stderr
    assert "placement" not in proc.stdout + proc.stderr  # no placement was waited for


def test_ray_driver_refuses_an_address_where_nothing_answers():
    port = free_port()  # bound and closed: nothing listens there
    for how in (["--address", f"127.0.0.1:{port}"], []):
        env = dict(os.environ, RAY_ADDRESS=f"127.0.0.1:{port}") if not how else None
        proc = subprocess.run([sys.executable, "-m", "flexfloor.launch.ray", "--config", CONFIG,
                               "--num-workers", "4", *how], capture_output=True, text=True,
                              cwd=REPO, env=env, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(
            f"[flexfloor.launch.ray] error: nothing answers at 127.0.0.1:{port} ("), proc.stderr
    # one Ray cannot read: its own words, one line, no traceback
    proc = subprocess.run([sys.executable, "-m", "flexfloor.launch.ray", "--config", CONFIG,
                           "--num-workers", "4", "--address", f"127.0.0.1:{port}/"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"[flexfloor.launch.ray] error: Ray cannot use the address '127.0.0.1:{port}/': "), proc.stderr


def test_ray_driver_stopped_while_it_starts_exits_75_without_a_traceback(tmp_path):
    """A SIGTERM before any worker started (while the driver imports, or Ray starts): exit 75
    with one line, no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "flexfloor.launch.ray", "--config", CONFIG,
                             "--num-workers", "4", *TINY, f"logging.run_dir={tmp_path}/run"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    first = proc.stdout.readline()  # said once the config is read, just before Ray starts
    assert "[flexfloor.launch.ray] Ray auth: " in first, first
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    out = first + out
    assert proc.returncode == 75, out[-3000:]
    assert "Traceback" not in out
    assert re.search(r"\[flexfloor\.launch\.ray\] (preempted by SIGTERM before a step ran|SIGTERM "
                     r"while Ray started): nothing saved \(no worker had started\)", out), out[-3000:]


class RaySbatchJob:
    """grpo_moe_ray.sbatch for real on one node (the stand-in srun: `ray start --head`, then the
    driver with 2 workers), its merged output read line by line while it runs."""

    def __init__(self, tmp_path, *overrides: str):
        self.env, self.log = stand_in_env(tmp_path)
        self.port = free_port()
        self.env.update(SRUN_RUN="1", PORT=str(self.port),
                        **slurm_env("localhost", 1, "localhost", 0, SLURM_NTASKS_PER_NODE="2",
                                    SLURM_CPUS_ON_NODE="2"))
        cmd = ["bash", os.path.join(REPO, "examples", "slurm", "grpo_moe_ray.sbatch"), *TINY,
               "trainer.steps=1000", "parallel.expert_parallel_size=2",
               f"logging.run_dir={tmp_path}/run", *overrides]
        self.proc = subprocess.Popen(cmd, env=self.env, cwd="/", stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.out: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.out.append(line)
            self._lines.put(line)

    def until_step_1(self, timeout: float = 240) -> dict[int, int]:
        """Read until the driver says step 1 is done; returns the ranks' pids."""
        return self.until("[flexfloor.launch.ray] step 1/", timeout)

    def until(self, marker: str, timeout: float = 240) -> dict[int, int]:
        """Read until a line holds `marker`; returns the ranks' pids."""
        pids, deadline = {}, time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:  # fail fast when the job has ended (its output all read)
                tail = self.text[-4000:]
                assert self._reader.is_alive() or self.proc.poll() is None, \
                    f"the job ended (exit status {self.proc.poll()}) before {marker!r}:\n{tail}"
                assert time.monotonic() < deadline, f"no {marker!r} within {timeout:.0f} s:\n{tail}"
                continue
            # Ray prints a worker's line and its newline in two writes from its own thread, so the
            # driver's line may follow a worker's text on one line: look for it anywhere
            rank = re.search(r"\[flexfloor\.launch\.ray\] rank (\d+): .* pid (\d+) ", line)
            if rank:
                pids[int(rank[1])] = int(rank[2])
            if marker in line:
                return pids

    def end(self) -> None:
        """Whatever is left of the job ended (every process with its marker), its output read."""
        if self.proc.poll() is None:
            end_job(self.proc, self.env["FLEXFLOOR_TEST_JOB"])
        self._reader.join(timeout=30)

    @property
    def text(self) -> str:
        return "".join(self.out)


def test_ray_sbatch_worker_death_ends_the_job_naming_the_rank(tmp_path):
    """grpo_moe_ray.sbatch for real on one node (`ray start --head` through srun, the driver, 2
    workers); rank 1's process is killed after step 1: the job exits non-zero with an error
    naming rank 1, and neither the Ray node nor any worker outlives it."""
    job = RaySbatchJob(tmp_path)
    try:
        pids = job.until_step_1()
        victim = pids[1]
        os.kill(victim, signal.SIGKILL)
        rc = job.proc.wait(timeout=180)
    finally:
        job.end()
    text, log, port = job.text, job.log, job.port
    assert rc == 1, text[-4000:]
    assert re.search(rf"error: rank 1 \(node [0-9.]+, pid {victim}\) died during step \d+", text), \
        text[-4000:]
    (srun,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert srun[srun.index("flexfloor.launch.slurm") + 1] == "ray-node"
    assert f"ray start --head --node-ip-address=127.0.0.1 --port={port}" in text
    # a fresh token for the job, in the environment only: the driver names the mode, not the
    # token, and nothing lands in the (test's) home directory
    assert "[flexfloor.launch.ray] Ray auth: RAY_AUTH_MODE=token, token from RAY_AUTH_TOKEN" in text
    assert not (tmp_path / "home" / ".ray" / "auth_token").exists()
    assert len(pids) == 2 and wait_gone(list(pids.values())) == []
    # the Ray node's own processes (ray start, GCS, raylet, ...) name its port: none may be left
    assert wait_gone(processes_matching(rf"(:|port=){port}\b")) == []


def test_ray_sbatch_sigterm_saves_the_step_and_exits_75(tmp_path):
    """A preemption of grpo_moe_ray.sbatch (Slurm's SIGTERM to the batch step, --signal=B:TERM):
    the driver has every worker finish the step in progress and save it, the job exits 75 with
    one line saying how to resume, and neither the Ray node nor any worker outlives it."""
    from flexfloor import preemption
    from flexfloor.launch import ray as ray_launcher, slurm

    assert slurm.PREEMPTED_EXIT_CODE == ray_launcher.PREEMPTED_EXIT_CODE == \
        preemption.PREEMPTED_EXIT_CODE
    ckpt = tmp_path / "ckpt"
    job = RaySbatchJob(tmp_path, f"checkpoint.dir={ckpt}",
                       "checkpoint.save_interval=1000")  # only the stop's save
    try:
        pids = job.until_step_1()
        os.kill(job.proc.pid, signal.SIGTERM)  # the batch step: the stage, which passes it on
        rc = job.proc.wait(timeout=180)
    finally:
        job.end()
    text = job.text
    assert rc == 75, text[-4000:]
    assert ("[flexfloor.launch.ray] SIGTERM: finishing the step in progress on every worker, "
            "then saving a checkpoint (checkpoint.preempt_grace_s=60; a second Ctrl-C stops at "
            "once)") in text
    done = re.search(r"\[flexfloor\.launch\.ray\] preempted by SIGTERM after step (\d+): "
                     rf"checkpoint iter_(\d+) in {re.escape(str(ckpt))}, [\d.]+ s after the "
                     r"signal; run the same command again to resume \(exit code 75\)", text)
    assert done and int(done[1]) == int(done[2]) >= 1, text[-4000:]
    step = int(done[1])  # the step in progress when the signal came, or the one before
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [f"iter_{step:07d}"]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == list(range(1, step + 1))
    assert len(pids) == 2 and wait_gone(list(pids.values())) == []
    assert wait_gone(processes_matching(rf"(:|port=){job.port}\b")) == []


def test_ray_sbatch_sigterm_in_the_warm_start_ends_it_at_once_and_exits_75(tmp_path):
    """A preemption during the supervised warm start (minutes in the main job): the driver tells
    the workers, which end it after the supervised step in progress, nothing cached; the job
    exits 75 with one line saying the same command starts it again. Before, the driver waited
    for the whole warm start, and past checkpoint.preempt_grace_s ended it unsaved (143)."""
    ckpt = tmp_path / "ckpt"
    job = RaySbatchJob(tmp_path, f"checkpoint.dir={ckpt}", "trainer.sft_warmup_steps=400",
                       "checkpoint.preempt_grace_s=120")
    try:
        pids = job.until("warm start (supervised)")
        os.kill(job.proc.pid, signal.SIGTERM)
        rc = job.proc.wait(timeout=180)
    finally:
        job.end()
    text = job.text
    assert rc == 75, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    # (the workers' own "warm start: stopped after k of 400" line may not be forwarded by Ray
    # before the job ends: the cache below, written only by a warm start that ran to its end,
    # tells that it ended early)
    assert re.search(r"\[flexfloor\.launch\.ray\] preempted by SIGTERM before step 1: no step "
                     r"finished yet, nothing to save, [\d.]+ s after the signal; run the same "
                     r"command again to start it again \(nothing to resume from\) \(exit code "
                     r"75\)", text), text[-4000:]
    assert not list(ckpt.glob("iter_*")) and not (ckpt / "flexfloor.lock").exists()
    assert not list(tmp_path.glob("sft_cache/*/latest")) and "step 1/" not in text
    assert len(pids) == 2 and wait_gone(list(pids.values())) == []
    assert wait_gone(processes_matching(rf"(:|port=){job.port}\b")) == []


def test_ray_sbatch_sigterm_past_the_grace_ends_unsaved_with_128_plus_the_signal(tmp_path):
    """The same preemption, where the step in progress and its save take longer than
    checkpoint.preempt_grace_s: the driver ends the workers at the grace instead of waiting to
    be killed mid-save, says so in one line naming the setting, and exits 143 (128 + SIGTERM,
    as the local launcher does for workers that did not save); no checkpoint, no process
    left."""
    ckpt = tmp_path / "ckpt"
    job = RaySbatchJob(tmp_path, f"checkpoint.dir={ckpt}", "checkpoint.save_interval=1000",
                       "checkpoint.preempt_grace_s=0.01")  # far shorter than a step or a save
    try:
        pids = job.until_step_1()
        os.kill(job.proc.pid, signal.SIGTERM)
        rc = job.proc.wait(timeout=180)
    finally:
        job.end()
    text = job.text
    assert rc == 128 + signal.SIGTERM, text[-4000:]
    assert ("then saving a checkpoint (checkpoint.preempt_grace_s=0.01; a second Ctrl-C stops "
            "at once)") in text
    assert re.search(r"\[flexfloor\.launch\.ray\] error: SIGTERM: no checkpoint within "
                     r"checkpoint\.preempt_grace_s=0\.01 s \((step \d+|the stop's save) still "
                     r"running on rank \d.*\); the run resumes from its newest complete checkpoint; "
                     r"raise checkpoint\.preempt_grace_s .* \(exit code 143\)", text), text[-4000:]
    assert "preempted by" not in text and "Traceback" not in text
    assert [p.name for p in ckpt.glob("iter_*") if not p.name.endswith(".tmp")] == []
    assert len(pids) == 2 and wait_gone(list(pids.values())) == []
    assert wait_gone(processes_matching(rf"(:|port=){job.port}\b")) == []


def processes_matching(pattern: str) -> list[int]:
    """Processes (other than this one) whose command line matches `pattern`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if re.search(pattern, f.read().replace(b"\0", b" ").decode(errors="replace")):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids
