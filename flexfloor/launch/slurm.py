"""Slurm: the command lines of a multi-node job, built from the variables Slurm sets.

The sbatch scripts (examples/slurm/) only call this module; each stage builds its command here
and execs it, so what runs on a cluster is what the tests check:

    python -m flexfloor.launch.slurm torchrun [--nproc-per-node P] [--port N] [--max-restarts R]
            TRAIN_ARGS...
        batch step: `srun` one task per node, each running the `torchrun-node` stage;
    python -m flexfloor.launch.slurm torchrun-node --nproc-per-node P --port N [--max-restarts R]
            TRAIN_ARGS...
        on each node: `torchrun` with the first node as rendezvous endpoint: static rendezvous
        with this node's rank, or (R > 0) the c10d rendezvous, which restarts every node's
        workers together up to R times;
    python -m flexfloor.launch.slurm ray [--nproc-per-node P] [--port N] LAUNCH_ARGS...
        batch step: `srun` the `ray-node` stage on every node (in the background), wait for the
        head, then the Ray driver (`python -m flexfloor.launch.ray --address HEAD:PORT ...`);
    python -m flexfloor.launch.slurm ray-node --nproc-per-node P --port N
        on each node: `ray start --head` on the first node, `ray start --address HEAD:PORT` on the
        others (after the head answers).

`--dry-run` prints the command (JSON list) instead of running it. TRAIN_ARGS / LAUNCH_ARGS are
passed through (`--config FILE section.field=value ...`; for `ray` also `--cpus-per-worker` etc.).
Workers per node: `--nproc-per-node`, else SLURM_GPUS_ON_NODE, else SLURM_NTASKS_PER_NODE
(one Slurm task slot per CPU worker), else 1. A stage that cannot go on (the Ray nodes' srun
ended, no head answers) ends with a one-line error and exit status 1. `--max-restarts` of the
`ray` stage goes to the Ray driver.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from flexfloor.launch.local import PREEMPTED as PREEMPTED_EXIT_CODE
from flexfloor.launch.local import check_config


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order.

    `gpu[01-03,07],cpu5` -> gpu01 gpu02 gpu03 gpu07 cpu5; zero padding is kept; several bracket
    groups in one name expand as a product (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2).
    """
    hosts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if text[start:i].strip():
                hosts += _expand_name(text[start:i].strip())
            start = i + 1
        if depth < 0 or depth > 1:
            raise ValueError(f"host list {text!r}: unbalanced or nested brackets")
    if depth:
        raise ValueError(f"host list {text!r}: unbalanced brackets")
    return hosts


def _expand_name(name: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if not m:
        return [name]
    head, tail = name[: m.start()], name[m.end():]
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"host list range {part!r} in {name!r}: expected N or N-M")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out += [head + str(n).zfill(width) + rest for rest in _expand_name(tail)]
    return out


@dataclass(frozen=True)
class Allocation:
    """The job's nodes and this node's place among them (from Slurm's variables)."""

    job_id: int
    nodes: tuple[str, ...]
    node_rank: int
    procs_per_node: int
    cpus_on_node: int
    gpus_on_node: int
    cpus_per_task: int = 0  # SLURM_CPUS_PER_TASK (sbatch --cpus-per-task); 0: not set

    @classmethod
    def from_env(cls, env=None, *, procs_per_node: int | None = None) -> Allocation:
        env = os.environ if env is None else env
        missing = [k for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST") if not env.get(k)]
        if missing:
            raise ValueError(f"{', '.join(missing)} not set: run inside a Slurm job (sbatch or "
                             "salloc), or set them as Slurm would")
        nodes = tuple(expand_hostlist(env["SLURM_JOB_NODELIST"]))
        if env.get("SLURM_NNODES") and int(env["SLURM_NNODES"]) != len(nodes):
            raise ValueError(f"SLURM_NNODES={env['SLURM_NNODES']} but SLURM_JOB_NODELIST "
                             f"names {len(nodes)} nodes: {','.join(nodes)}")
        # this node: by name where Slurm says it (SLURMD_NODENAME), else its node id
        name = env.get("SLURMD_NODENAME")
        node_rank = nodes.index(name) if name in nodes else int(env.get("SLURM_NODEID", 0))
        gpus = _count(env.get("SLURM_GPUS_ON_NODE"))
        procs = procs_per_node or gpus or _count(env.get("SLURM_NTASKS_PER_NODE")) or 1
        return cls(job_id=int(env["SLURM_JOB_ID"]), nodes=nodes, node_rank=node_rank,
                   procs_per_node=procs, cpus_on_node=_count(env.get("SLURM_CPUS_ON_NODE")) or 1,
                   gpus_on_node=gpus, cpus_per_task=_count(env.get("SLURM_CPUS_PER_TASK")))

    @property
    def head(self) -> str:
        return self.nodes[0]

    @property
    def num_workers(self) -> int:
        return len(self.nodes) * self.procs_per_node

    def port(self, base: int) -> int:
        """A port every node derives alike from the job id (jobs sharing a node differ)."""
        return base + self.job_id % 2000


def _count(value) -> int:
    """SLURM_NTASKS_PER_NODE may read `4(x2)` and SLURM_GPUS_ON_NODE may be empty."""
    m = re.match(r"\d+", value or "")
    return int(m.group()) if m else 0


TORCHRUN_PORT_BASE = 29500  # torchrun's default port and the 2000 above it
# how long a node's agent waits for the first node's c10d store (torch's default, 60 s, would
# end the job where the first node starts a minute late; the static rendezvous waits 600 s)
C10D_READ_TIMEOUT_S = 600
RAY_PORT_BASE = 6379        # Ray's default GCS port and the 2000 above it


def srun_command(alloc: Allocation, stage_args: list[str], python: str) -> list[str]:
    """One task per node running a stage of this module; the job fails if any task fails.

    `--cpus-per-task` is passed on: since Slurm 22.05 srun no longer inherits sbatch's, and each
    node's torchrun or `ray start` would get one CPU."""
    n = len(alloc.nodes)
    cpus = [f"--cpus-per-task={alloc.cpus_per_task}"] if alloc.cpus_per_task else []
    return ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", *cpus,
            "--kill-on-bad-exit=1", python, "-m", "flexfloor.launch.slurm", *stage_args]


def torchrun_command(alloc: Allocation, port: int, train_args: list[str], python: str,
                     max_restarts: int = 0) -> list[str]:
    """This node's torchrun (through `flexfloor.launch.local`: a preempted node exits 75, as its
    workers do), rendezvous at the first node.

    `max_restarts` 0: static rendezvous, node rank = its place in the node list, so ranks follow
    the nodes (rank 0 on the first) as in every run of the job. A static agent cannot make the
    other nodes' agents restart with it, so `max_restarts` > 0 takes the c10d rendezvous, served
    by the first node's agent (`is_host` from the node list, not from matching host names):
    a failed worker makes every node's agent stop its workers and join a new round. c10d ranks
    the nodes by sorted `--local-addr` (the Slurm node name), alike in every round of the job.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each round's workers a store of their own (rank
    0's): in the agents' shared store they would name their keys by TORCHELASTIC_RESTART_COUNT
    (flexfloor.parallel), which differs between nodes after a restart (an agent restarting its
    healthy workers for another node's failure does not count it): the new round's workers
    would not find each other.
    """
    nnodes = f"--nnodes={len(alloc.nodes)}"
    rest = ["-m", "flexfloor.train", *train_args, f"parallel.world_size={alloc.num_workers}"]
    if max_restarts == 0:
        return [python, "-m", "flexfloor.launch.local", nnodes, f"--node-rank={alloc.node_rank}",
                f"--nproc-per-node={alloc.procs_per_node}", "--rdzv-backend=static",
                f"--rdzv-endpoint={alloc.head}:{port}", f"--rdzv-id={alloc.job_id}", *rest]
    return ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", python, "-m", "flexfloor.launch.local",
            nnodes, f"--nproc-per-node={alloc.procs_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={alloc.head}:{port}", f"--rdzv-id={alloc.job_id}",
            f"--rdzv-conf=is_host={int(alloc.node_rank == 0)},read_timeout={C10D_READ_TIMEOUT_S}",
            f"--local-addr={alloc.nodes[alloc.node_rank]}", f"--max-restarts={max_restarts}",
            *rest]


def ray_node_command(alloc: Allocation, port: int, head_ip: str, ray_bin: str) -> list[str]:
    """This node's `ray start`: the head on the first node, a worker node elsewhere."""
    common = [f"--num-cpus={alloc.cpus_on_node}", f"--num-gpus={alloc.gpus_on_node}", "--block"]
    if alloc.node_rank == 0:
        return [ray_bin, "start", "--head", f"--node-ip-address={head_ip}", f"--port={port}",
                "--include-dashboard=false", "--disable-usage-stats", *common]
    return [ray_bin, "start", f"--address={head_ip}:{port}", *common]


def ray_driver_command(alloc: Allocation, address: str, launch_args: list[str],
                       python: str) -> list[str]:
    return [python, "-m", "flexfloor.launch.ray", f"--address={address}",
            f"--num-workers={alloc.num_workers}", *launch_args,
            f"parallel.world_size={alloc.num_workers}"]


def ray_auth_env(env=None) -> dict:
    """The Ray authentication variables for every node and the driver of this job.

    One token for the whole job, made here and passed only in the environment (srun hands the
    batch step's environment to every node; Ray's processes inherit it): nothing is written to
    ~/.ray, where a token file would turn token authentication on for every later `ray start` of
    the user, and a home directory need not be shared. Setting the mode on every process also
    keeps them alike: Ray >= 2.52 turns token authentication on for `ray start` by itself when it
    finds a token file, but not for a driver given an address. Ray versions without token
    authentication ignore both variables.

    The user's choice wins: RAY_AUTH_MODE=disabled (or any mode other than token) is passed on as
    it is; a token of the user's own (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, e.g. to let borrowers
    outside the job connect) is used instead of a new one.
    """
    env = os.environ if env is None else env
    mode = env.get("RAY_AUTH_MODE", "").lower()
    if mode and mode != "token":
        return {}
    if env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH"):
        return {"RAY_AUTH_MODE": "token"}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


class StageError(RuntimeError):
    """A stage cannot go on; main prints it as one line and exits 1."""


def wait_for_port(host: str, port: int, timeout_s: float, nodes=None,
                  stopped=lambda: False) -> None:
    """Wait until something answers at host:port, or `stopped()`. `nodes`: the Popen of the srun
    that starts the Ray nodes; when it has ended, nothing will answer: stop at once."""
    deadline = time.monotonic() + timeout_s
    while not stopped():
        try:
            with socket.create_connection((host, port), timeout=5):
                return
        except OSError:
            if nodes is not None and nodes.poll() is not None:
                raise StageError(f"the Ray nodes' srun ended (exit status {nodes.returncode}) "
                                 f"before the head answered at {host}:{port}; see its output "
                                 "above") from None
            if time.monotonic() > deadline:
                raise StageError(f"nothing answers at {host}:{port} after {timeout_s:.0f} s "
                                 "(did the Ray head start? see the ray-node output)") from None
            time.sleep(0.2)  # a refused connect is cheap; the head answers within seconds


# the stages' numeric flags: (type, least, most, what the flag means)
_NUMBERS = {"nproc_per_node": (int, 1, None, "workers per node"),
            "port": (int, 1, 65535, "a TCP port"),
            "head_timeout_s": (float, 0.0, None, "seconds to wait for the Ray head"),
            "max_restarts": (int, 0, None, "0: a failed worker ends the job")}


def _numbers(args) -> str | None:
    """The numeric flags read into `args` (given as text), or the first bad one's error line."""
    for name, (kind, least, most, means) in _NUMBERS.items():
        text = getattr(args, name)
        if text is None or not isinstance(text, str):
            continue
        try:
            value = kind(text)
        except ValueError:
            value = None
        ok = value is not None and math.isfinite(value) and (
            value > least if kind is float else value >= least) and (most is None or value <= most)
        if not ok:
            rule = (f"a whole number, {least}-{most}" if most is not None else
                    f"a whole number, {least} or more" if kind is int else
                    f"a finite number above {least:g}")
            return f"--{name.replace('_', '-')} {text}: must be {rule} ({means})"
        setattr(args, name, value)
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flexfloor.launch.slurm", description=__doc__.split("\n\n")[0],
        epilog="Every other argument goes on to flexfloor.train (torchrun stages) or to the Ray "
        "driver (ray): --config FILE and section.field=value overrides, and for ray the "
        "driver's own flags (python -m flexfloor.launch.ray --help). The batch-step stages "
        "(torchrun, ray) check the config once before srun starts anything.")
    parser.add_argument("stage", choices=["torchrun", "torchrun-node", "ray", "ray-node"])
    parser.add_argument("--nproc-per-node", default=None,
                        help="workers per node (default: SLURM_GPUS_ON_NODE, "
                        "SLURM_NTASKS_PER_NODE, 1)")
    parser.add_argument("--port", default=None,
                        help="rendezvous / Ray head port (default: derived from SLURM_JOB_ID)")
    parser.add_argument("--head-timeout-s", default=300.0,
                        help="how long nodes and the driver wait for the Ray head (default 300)")
    parser.add_argument("--max-restarts", default=None,
                        help="torchrun: when a worker fails, restart every node's workers up to N "
                        "times, resuming from checkpoint.dir (default 0: the job ends); ray: "
                        "passed to the driver")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    args, rest = parser.parse_known_args(argv)
    bad = _numbers(args)
    if bad:
        print(f"slurm: {bad}", file=sys.stderr)
        return 2
    try:
        alloc = Allocation.from_env(procs_per_node=args.nproc_per_node)
    except ValueError as e:
        print(f"slurm: {e}", file=sys.stderr)
        return 2
    try:
        return _stage(args, rest, alloc)
    except StageError as e:
        print(f"[flexfloor.launch.slurm] error: {e}", file=sys.stderr, flush=True)
        return 1


def _driver_config_checked(driver: list[str]) -> int:
    """The Ray driver's own check (`--check-config`: its flags, the config, the files) of the
    `driver` command, here in the batch step before the Ray nodes start: its exit code."""
    from flexfloor.launch.ray import main as driver_main

    try:
        return driver_main([*driver[3:], "--check-config"])  # after `python -m MODULE`
    except SystemExit as e:  # the driver's own flag errors (argparse: usage and one line)
        return e.code if isinstance(e.code, int) else 2


def _stage(args, rest: list[str], alloc: Allocation) -> int:
    python = sys.executable
    ray_bin = os.path.join(os.path.dirname(python), "ray")
    stage_opts = [f"--nproc-per-node={alloc.procs_per_node}"]
    restarts = args.max_restarts or 0
    if args.stage == "torchrun":
        # the config once here, for the job's world size, before srun starts anything
        code = 0 if args.dry_run else check_config(
            [*rest, f"parallel.world_size={alloc.num_workers}"], alloc.num_workers)
        if code:
            return code
        port = args.port or alloc.port(TORCHRUN_PORT_BASE)
        if restarts:
            stage_opts.append(f"--max-restarts={restarts}")
        return _run(srun_command(alloc, ["torchrun-node", *stage_opts, f"--port={port}", *rest],
                                 python), args.dry_run)
    if args.stage == "torchrun-node":
        port = args.port or alloc.port(TORCHRUN_PORT_BASE)
        return _run(torchrun_command(alloc, port, rest, python, restarts), args.dry_run)
    if args.max_restarts is not None:  # the Ray driver's option (this parser took it)
        rest = [f"--max-restarts={args.max_restarts}", *rest]
    port = args.port or alloc.port(RAY_PORT_BASE)
    if args.stage == "ray-node":
        head_ip = _ip(alloc.head, args.dry_run)
        if alloc.node_rank != 0 and not args.dry_run:
            wait_for_port(head_ip, port, args.head_timeout_s)
        return _run(ray_node_command(alloc, port, head_ip, ray_bin), args.dry_run)
    # stage "ray": the Ray nodes in the background, then the driver here (the batch step)
    nodes = srun_command(alloc, ["ray-node", *stage_opts, f"--port={port}",
                                 f"--head-timeout-s={args.head_timeout_s}"], python)
    if not args.dry_run:  # (the check starts nothing: any address will do)
        code = _driver_config_checked(ray_driver_command(alloc, f"{alloc.head}:{port}", rest,
                                                         python))
        if code:
            return code
    head_ip = _ip(alloc.head, args.dry_run)
    driver = ray_driver_command(alloc, f"{head_ip}:{port}", rest, python)
    if args.dry_run:
        print(json.dumps({"nodes": nodes, "driver": driver}))
        return 0
    env = dict(os.environ, **ray_auth_env())
    # a stop signal (the batch step's, sbatch --signal=B:TERM@120) goes to the driver alone: it
    # has every worker finish the step and save it, then exits 75, and the Ray nodes stop after
    # it (a SIGTERM to the Ray nodes' srun would end their workers before they saved)
    running: dict = {}
    early: list = []  # signals before the driver started

    def forward(signum, frame):
        running.setdefault("signal", signal.Signals(signum).name)
        if "driver" in running:
            running["driver"].send_signal(signum)
        else:
            early.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    cluster = subprocess.Popen(nodes, env=env)
    try:
        wait_for_port(head_ip, port, args.head_timeout_s, nodes=cluster,
                      stopped=lambda: "signal" in running)
        if "signal" in running:  # stopped before the driver started: nothing ran
            print(f"[flexfloor.launch.slurm] {running['signal']} before the driver started: "
                  f"stopping the Ray nodes (exit code {PREEMPTED_EXIT_CODE})", flush=True)
            return PREEMPTED_EXIT_CODE
        # its own process group: a Ctrl-C in the terminal (salloc) reaches it once, through
        # `forward`, not twice (twice stops it at once, without a save)
        running["driver"] = subprocess.Popen(driver, env=env, process_group=0)
        for signum in early[:1]:  # one that came while it started
            running["driver"].send_signal(signum)
        rc = running["driver"].wait()
        return 128 - rc if rc < 0 else rc  # killed by a signal: the shell's 128 + N
    finally:
        cluster.terminate()  # srun passes it on: `ray start --block` stops its node
        try:
            cluster.wait(timeout=60)
        except subprocess.TimeoutExpired:
            cluster.kill()
            cluster.wait()


def _ip(host: str, dry_run: bool) -> str:
    """The head's address for Ray (an IP: Ray binds and advertises it); a dry run away from the
    cluster, where the name does not resolve, shows the name."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        if dry_run:
            return host
        raise


def _run(cmd: list[str], dry_run: bool) -> int:
    if dry_run:
        print(json.dumps(cmd))
        return 0
    print("[flexfloor.launch.slurm] " + " ".join(cmd), flush=True)
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
