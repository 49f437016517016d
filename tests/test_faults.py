"""Faults: no hang, and a lost worker costs time, never data.

1. Released ranks wait at resync for as long as the survivors make progress (longer than
   parallel.timeout_s), and fail with an error naming the rank, the phase and the step when a
   survivor hangs (3 gloo workers, one launch).
2. kill -9 of one worker (a) mid-rollout before its release, (b) after its release, while it
   waits at resync, (c) mid-training, (d) during a checkpoint save, once its shards are written,
   (f) while its checkpoint writer processes (forked copies of it) still write, then (e) SIGTERM
   to one worker mid-rollout (a preemption): one real `torchrun --max-restarts 6 -m
   flexfloor.train` job meets the six faults on its first six attempts (FLEXFLOOR_FAULT,
   flexfloor/faults.py)
   and resumes each time from the newest complete checkpoint (checkpoint.resume=auto); after
   (e) from the step the preemption finished and saved. Its metrics, weights and optimizer
   state at the last step equal an uninterrupted run's bit for bit. Detection and recovery
   times are printed (docs/reliability.md), not asserted. Once torchrun exits, no process of
   the job is left and its output pipe closes (the dead workers' helpers are reaped).
3. `bash examples/train_moe.sh` signalled with SIGTERM after step 1 saves that step and exits 75
   with no traceback (flexfloor.launch.local), and the launcher's exit code follows the codes
   its workers report.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from distributed import REPO, end_job, job_processes, run_worker

PY = sys.executable


# ------------------------------------------------------------------------------------ resync


def test_released_ranks_wait_for_progress_not_for_a_fixed_timeout(tmp_path):
    run = run_worker("fault_resync.py", 3, tmp_path, check=False, timeout=240)
    assert run.proc.returncode != 0  # the hung second rollout fails the job
    for rank in (1, 2):
        assert (tmp_path / f"rank{rank}.json").exists(), run.proc.stderr[-4000:]
        res = run.load(f"rank{rank}.json")
        # 1. released at once, then waited through rank 0's ~4 s of decoding (timeout: 3 s)
        assert res["long"]["release_step"] == 2 and res["long"]["tokens"] == 2
        assert res["long"]["resync_wait_s"] > 3.0
        # 2. a survivor that stops: an error that names the rank, the phase and the step
        msg = res["hung"]["error"]
        assert msg.startswith(f"rank {rank}, phase 'resync', step 2 (released at engine step 2)")
        assert "no progress for 3 s" in msg and "2 of 3 ranks are back" in msg
        print(f"rank {rank}: waited {res['long']['resync_wait_s']:.1f} s for a live survivor; "
              f"hung survivor detected after {res['hung']['after_s']:.1f} s")


class _Stopped(Exception):
    pass


def test_a_rank_waiting_at_resync_runs_a_signal_handler_at_once():
    """A released rank waits at resync by looking at the job's store, not in one blocking
    store.wait: a signal's handler (the launcher's SIGTERM to the survivors of a dead peer, a
    preemption) runs while it waits, not only once the last rank is back (which, with a dead
    peer, is never: the launcher then kills it after its grace period)."""
    import torch.distributed as dist

    from flexfloor.rollout.elastic import _wait_for_every_rank

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # a free port
    peer = dist.TCPStore("127.0.0.1", store.port, is_master=False)  # its own connection
    seen = []

    def handler(signum, frame):
        seen.append(store.check(["resync/all"]))  # the last rank is back already?
        raise _Stopped

    old = signal.signal(signal.SIGUSR1, handler)
    signal_it = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    last_back = threading.Timer(10, peer.set, ("resync/all", "1"))  # the peer, much later
    try:
        last_back.start()
        with pytest.raises(_Stopped):  # timeout 120 s: progress is looked for every 30 s
            signal_it.start()  # the last thing before the wait: the signal lands in it
            _wait_for_every_rank(store, "resync", "heartbeat", 2, 120.0, "rank 0, phase 'resync'")
    finally:
        signal_it.cancel()
        last_back.cancel()
        signal.signal(signal.SIGUSR1, old)
    assert seen == [False]


# ------------------------------------------------------------------------------ worker loss


BLOCKED_WORKER = """
import datetime, os, sys
import torch.distributed as dist
from flexfloor.preemption import Preemption

def stop(line):
    print(line, file=sys.stderr, flush=True)
    os._exit(1)

Preemption(60, on_stop=stop).install()
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print("waiting", flush=True)
try:  # as a rendezvous waits for a peer that died in set-up
    store.wait(["the dead peer's address"], datetime.timedelta(seconds=120))
except dist.DistError:
    pass
print("the wait ended", flush=True)
"""


def test_launcher_sigterm_stops_a_worker_blocked_in_a_wait_for_a_dead_peer():
    """torchrun SIGTERMs the survivors of a dead worker; one whose main thread is blocked in a
    C++ wait (Python runs no handler there) stops at once all the same, with its line, instead
    of after the wait or torchrun's SIGKILL 30 s later."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore", RANK="1",
               TORCHELASTIC_RUN_ID="test", TORCHELASTIC_RESTART_COUNT="0",
               LOCAL_WORLD_SIZE="1000")  # as under torchrun, and a local peer is gone
    proc = subprocess.Popen([PY, "-c", BLOCKED_WORKER], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "waiting\n", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)  # the wait lasts 120 s
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1 and "the wait ended" not in out
    assert err.strip().splitlines()[-1] == (
        "[flexfloor] error: rank 1: SIGTERM from the launcher after a worker of this node "
        "exited: stopping now (no checkpoint)")

KILLED_WORKER_WITH_HELPERS = """
import multiprocessing, os, signal, subprocess, sys, time
from flexfloor.launch.reaper import forget, remove_if_killed, start_reaper

def writer():  # as dist-checkpointing's writers: a forked copy, which forks once more
    if os.fork() == 0:
        time.sleep(120)
        os._exit(0)
    time.sleep(120)

start_reaper()
for folder in ("scratch", "kept", "single", "s"):
    os.makedirs(os.path.join(folder, "inner"))
remove_if_killed(["scratch", "kept", "never-made"])
remove_if_killed("single")  # one path, not its letters ("s" stays)
forget(["kept"])
try:
    remove_if_killed([""])
except ValueError as e:
    print("refused:", e, flush=True)
forked = multiprocessing.get_context("fork").Process(target=writer)
forked.start()
execd = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
time.sleep(1)  # the nested fork exists
print("helpers", forked.pid, execd.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_killed_with_sigkill_leaves_no_helper_forked_or_execd(tmp_path):
    """Forked copies (dist-checkpointing's writers, and a fork of a fork) carry no token in
    their environment as Linux reports it; they announce themselves to the reaper. With the
    worker killed, its reaper ends them and the exec'd helper: the output pipe closes at once,
    not when they would have ended (120 s), and no process is left. Then it removes the folders
    the worker named (`remove_if_killed`; one path given alone is that path, not its letters),
    not the one it took back (`forget`); an empty path (the current folder) is refused."""
    marker = f"reaper-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore", FLEXFLOOR_TEST_JOB=marker)
    proc = subprocess.Popen([PY, "-c", KILLED_WORKER_WITH_HELPERS], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                            start_new_session=True)
    out = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=60)
        reader.join(timeout=30)  # EOF once nothing holds the pipe
        pipe_closed = not reader.is_alive()
        deadline = time.monotonic() + 10  # the reaper ends right after the helpers it kills
        while job_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = job_processes(marker)
    finally:
        for pid in job_processes(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and len(out) == 2, (out, proc.stderr.read())
    assert out[0] == "refused: an empty path: name the file or folder to remove\n"
    assert out[1].startswith("helpers")
    assert {"pipe_closed": pipe_closed, "left": left} == {"pipe_closed": True, "left": []}
    assert sorted(os.listdir(tmp_path)) == ["kept", "s"]
    assert os.listdir(tmp_path / "kept") == ["inner"]


REAPER_GONE = """
import os, signal, psutil
from flexfloor.launch.reaper import forget, remove_if_killed, start_reaper

start_reaper()
reaper, = psutil.Process().children()
reaper.kill()
reaper.wait(30)
remove_if_killed(["made"])
forget(["made"])
print("said nothing", flush=True)
"""


def test_with_its_reaper_gone_a_process_names_paths_without_an_error(tmp_path):
    """A broken pipe to a dead reaper is not the caller's failure: `remove_if_killed` and
    `forget` return (nobody is there to remove anything), the process carries on."""
    proc = subprocess.run([PY, "-c", REAPER_GONE], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore"),
                          cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (0, "said nothing\n"), proc.stderr


DROPPED_STOP = """
import os, signal, time
from flexfloor.launch import stop as stop_module
from flexfloor.launch.stop import StopSignals

stop_module.AGAIN_AFTER_S = 0.5  # raised again once the work is surely asleep

def poke(sig):
    os.kill(os.getpid(), sig)
    sum(range(100))  # the handler has run by here

class Dropped:
    def __del__(self):
        poke(signal.SIGTERM)  # the handler runs in here: Python drops what it raises

def dropped():
    Dropped()
    time.sleep(600)  # the stop, delivered again, ends this (past the test's timeout if not)
    return "went-on"

def twice():
    try:
        poke(signal.SIGHUP)
        return "not-stopped"
    finally:  # a second signal while the first unwinds the work: kept, not raised
        poke(signal.SIGTERM)
        print("unwound", flush=True)

def never():
    print("ran", flush=True)

def fails():
    raise ValueError("its own")

for name, work, before in (("dropped", dropped, None), ("twice", twice, None),
                           ("before", never, signal.SIGHUP), ("fails", fails, None)):
    with StopSignals((signal.SIGTERM, signal.SIGHUP)) as stop:
        if before:  # a signal before the work: kept, and the work never starts
            poke(before)
        try:
            result = stop.run(work)
        except ValueError as e:
            result = e
        poke(signal.SIGTERM)  # after the work: ignored
        print(name, result, stop.got, stop.signum, flush=True)
print("restored", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
"""


def test_a_stop_signal_whose_exception_python_drops_is_still_kept():
    """A stop signal's handler runs wherever the main thread is, also inside a `__del__` (or an
    import's clean-up, as CI saw in the converter), where Python prints the exception as
    "ignored" and drops it. `StopSignals` delivers that stop again, as a real signal, so it
    still ends the work (here a ten-minute sleep, which a simulated signal left to run to its end,
    past the two-minute timeout), and keeps each signal for the caller to read; the first one stops
    `run`'s work, also one that came before it; a second one while the first unwinds it, and
    any after it, cut nothing short; the work's own failure propagates."""
    proc = subprocess.run([PY, "-c", DROPPED_STOP], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr
    assert "Exception ignored" in proc.stderr and "Stopped: 15" in proc.stderr, proc.stderr
    term, hup = int(signal.SIGTERM), int(signal.SIGHUP)
    assert proc.stdout.splitlines() == [
        f"dropped None [{term}] {term}",
        "unwound",
        f"twice None [{hup}, {term}] {hup}",
        f"before None [{hup}] {hup}",
        "fails its own [] 0",
        "restored True"]


NPROC = 2
STEPS = 5
JOB = [
    "--config", os.path.join(REPO, "examples", "configs", "grpo_tiny.yaml"),
    f"parallel.world_size={NPROC}", f"parallel.expert_parallel_size={NPROC}",
    "parallel.timeout_s=60", f"trainer.steps={STEPS}", "trainer.prompts_per_step=4",
    "trainer.micro_batch_size=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=40",
    "rollout.progress=false", "data.synthetic_num_prompts=16", "data.val_size=16",
    # a short supervised warm start (cached, shared by both runs) so rewards carry a signal
    "trainer.sft_warmup_steps=100", "trainer.sft_lr=3e-3",
    "scheduler.placement=baseline", "checkpoint.save_interval=1", "logging.tensorboard=false",
    "logging.timeline_plot=false",
    # one EP group: a rank leaves by a shrink, at a step the tokens decide (a replica leaving
    # whole is released only if another is still decoding: the wall clock's call)
    "rollout.replicas=1",
]
# metrics that depend only on the computation (not on the clock)
EXACT = ("reward/mean", "reward/solved", "response_length/mean", "response_length/max",
         "rollout/occupied_worker_steps", "actor/loss",
         "actor/grad_norm", "actor/lr", "data/epoch", "data/position", "scheduler/mae",
         "rollout/steps")


def launch(base, name, *, fault="", max_restarts=0, timeout=420, during=None):
    """`torchrun -m flexfloor.train ... | cat` as a user runs it, in base/NAME_run and
    base/NAME_ckpt; every output line with its arrival time, whether the pipe closed once the
    launcher exited (nothing left holding it) and the job's processes left after that."""
    marker = f"{name}-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONUNBUFFERED="1", FLEXFLOOR_FAULT=fault, FLEXFLOOR_TEST_JOB=marker)
    cmd = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={NPROC}",
           f"--max-restarts={max_restarts}", "--standalone", "-m", "flexfloor.train", *JOB,
           f"logging.run_dir={base}/{name}_run", f"checkpoint.dir={base}/{name}_ckpt"]
    lines = []
    popen = subprocess.Popen(cmd, env=env, cwd=str(base), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def read():
        for line in popen.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if during is not None:  # e.g. a killer of random workers at random times
        threading.Thread(target=during, args=(popen, lines), daemon=True).start()
    try:
        popen.wait(timeout=timeout)
        reader.join(timeout=30)  # EOF once no process of the job holds the pipe
        pipe_closed = not reader.is_alive()
        deadline = time.monotonic() + 10  # reapers end right after the helpers they kill
        while job_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = job_processes(marker)
    finally:
        end_job(popen, marker)  # whatever is left: the whole session and the leftovers
        reader.join(timeout=10)
    with open(os.path.join(base, f"{name}.log"), "w") as f:
        f.write("\n".join(text for _, text in lines))
    launch.leftovers[name] = {"pipe_closed": pipe_closed, "left": left}
    return popen.returncode, lines


launch.leftovers = {}


def metrics(base, name):
    with open(os.path.join(base, f"{name}_run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    t0 = time.monotonic()
    rc, ref_lines = launch(base, "reference")
    ref_wall = time.monotonic() - t0
    assert rc == 0, "\n".join(t for _, t in ref_lines[-60:])
    ref_metrics = metrics(base, "reference")
    # Each attempt redoes the step its predecessor lost before it meets its own fault, so each
    # fault's recovery can be timed. (b) needs a rank that leaves a rollout before its end: the
    # first such step of the uninterrupted run (deterministic: the faulted run releases the same
    # ranks); (a) kills the rank that stays longest in the next step; (c), (d) the step after.
    early = [m for m in ref_metrics[1:3] if len(set(m["rollout/steps"])) > 1]
    assert early, "no rank left steps 2-3 early: change the workload of this test"
    step_b = early[0]["step"]
    steps = {m["step"]: m["rollout/steps"] for m in ref_metrics}
    longest = steps[step_b + 2].index(max(steps[step_b + 2]))
    faults = {  # one per launch attempt, in this order
        "b": f"resync:{steps[step_b].index(min(steps[step_b]))}:{step_b}",
        "a": f"rollout:{steps[step_b + 1].index(max(steps[step_b + 1]))}:{step_b + 1}:2",
        "c": f"train:0:{step_b + 2}",
        "d": f"save:1:{step_b + 2}",
        # (f) while dist-checkpointing's writer processes run: they are forked copies, reaped too
        "f": f"write:0:{step_b + 2}",
        # (e) a preemption: SIGTERM to one rank mid-rollout; the step ends and is saved
        "e": f"sigterm:{longest}:{step_b + 2}:2",
    }
    t0 = time.monotonic()
    rc, lines = launch(base, "faulted", fault=",".join(faults.values()), max_restarts=len(faults))
    wall = time.monotonic() - t0
    assert rc == 0, "\n".join(t for _, t in lines[-80:])
    return {"base": base, "ref_metrics": ref_metrics, "lines": lines, "faults": faults,
            "wall_s": wall, "reference_wall_s": ref_wall}


def test_every_fault_was_injected_once_in_order(runs):
    kills = [t for _, t in runs["lines"] if "fault injection: SIG" in t]
    phases = [re.search(r"(SIG\w+) .* phase '(\w+)'", t).groups() for t in kills]
    assert phases == [("SIGKILL", "resync"), ("SIGKILL", "rollout"), ("SIGKILL", "train"),
                      ("SIGKILL", "save"), ("SIGKILL", "write"), ("SIGTERM", "rollout")], kills
    # each restart resumed from the newest complete checkpoint: after a kill the one before the
    # step of the fault; after (d), killed while saving, the one before too (the half-written
    # one never); after the preemption (e) the step it interrupted, finished and saved
    resumed = [int(re.search(r"resumed from iter_(\d+)", t).group(1)) for _, t in runs["lines"]
               if "resumed from iter_" in t]
    step = {k: int(f.split(":")[2]) for k, f in runs["faults"].items()}
    assert resumed == [step["b"] - 1, step["a"] - 1, step["c"] - 1, step["d"] - 1,
                       step["f"] - 1, step["e"]]


def test_resumed_run_equals_an_uninterrupted_run(runs):
    got, want = metrics(runs["base"], "faulted"), runs["ref_metrics"]
    # every step exactly once (a crashed attempt's unsaved steps were dropped), same numbers
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert {k: g.get(k) for k in EXACT} == {k: w.get(k) for k in EXACT}, g["step"]
    assert any(m["actor/grad_norm"] > 0 for m in want)  # the weights really moved


def test_final_weights_and_optimizer_state_bit_identical(runs):
    it = f"iter_{STEPS:07d}"
    proc = subprocess.run([PY, os.path.join(REPO, "tests", "workers", "fault_compare.py"),
                           str(runs["base"] / "reference_ckpt" / it),
                           str(runs["base"] / "faulted_ckpt" / it)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore"),
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "differ: []" in proc.stdout


def test_half_written_checkpoint_was_never_loaded(runs):
    lines = [t for _, t in runs["lines"]]
    kill_d = next(i for i, t in enumerate(lines) if "phase 'save'" in t and "SIGKILL" in t)
    step = int(runs["faults"]["d"].split(":")[2])
    # the attempt after the save fault resumed from the step before, not the half-written one
    resumed = next(t for t in lines[kill_d:] if "resumed from iter_" in t)
    assert f"resumed from iter_{step - 1:07d}" in resumed
    ckpt = runs["base"] / "faulted_ckpt"
    assert not [d for d in os.listdir(ckpt) if d.endswith(".tmp")]  # cleared by the next save


def test_record_detection_and_recovery_times(runs):
    """kill -> first sign of it (a survivor's error line or the launcher's), kill -> the
    interrupted step done again after the restart. Printed for docs/reliability.md."""
    lines = runs["lines"]
    table = {}
    kills = [(i, t) for i, (t, text) in enumerate(lines) if "fault injection: SIGKILL" in text]
    faults = {k: f for k, f in runs["faults"].items() if not f.startswith("sigterm")}
    for (case, spec), (i, t_kill) in zip(faults.items(), kills):
        step = int(spec.split(":")[2])
        later = lines[i + 1:]
        detect = next(t for t, text in later if "[flexfloor] error:" in text
                      or "failed (exitcode" in text or "Worker group FAILED" in text)
        who = next(text for t, text in later if t == detect)
        done = next(t for t, text in later if re.match(rf"step\s+{step} \|", text))
        # the restarted attempt redid the step before any other kill (a preemption lets it end)
        assert not [x for t, x in later if t < done and "fault injection: SIGKILL" in x], case
        table[case] = {"fault": spec, "detection_s": round(detect - t_kill, 2),
                       "recovery_s": round(done - t_kill, 2),
                       # a survivor's own error, or its line on the launcher's SIGTERM
                       "detected_by": "survivor" if "[flexfloor] error:" in who
                       and "SIGTERM from the launcher" not in who else "launcher"}
        assert detect <= done
    print(json.dumps({"faults": table, "job_wall_s": round(runs["wall_s"], 1),
                      "uninterrupted_wall_s (incl. the warm start)":
                      round(runs["reference_wall_s"], 1)}, indent=1))
    assert len(table) == 5


def test_sigterm_mid_rollout_finishes_the_step_saves_and_exits_75(runs):
    """(e): the signalled rank and its peer finish the step, save it and exit 75 (both: the
    ranks agree after the step); the restart resumes from that step (checked above) and the
    run ends equal to an uninterrupted one (checked above)."""
    lines = [t for _, t in runs["lines"]]
    step = int(runs["faults"]["e"].split(":")[2])
    term = next(i for i, t in enumerate(lines) if "fault injection: SIGTERM" in t)
    after = lines[term:]
    assert any("SIGTERM: finishing the step in progress, then saving a checkpoint "
               "(checkpoint.preempt_grace_s=60)" in t for t in after)
    # rank 0 logs it: "(a peer's)" when the signalled rank is another one (the longest, which
    # with tail consolidation on may be any rank)
    done = next(t for t in after
                if re.search(r"preempted by SIGTERM( \(a peer's\))? after step", t))
    assert f"after step {step}: checkpoint iter_{step:07d} in " in done
    assert "run the same command again to resume (exit code 75)" in done
    assert any("failed (exitcode: 75)" in t for t in after)  # torchrun reports the attempt
    # the SIGTERMs torchrun sends the survivors of a kill are no preemption: they stop at once
    # (waiting would only make torchrun kill them 30 s later)
    assert sum("finishing the step in progress" in t for t in lines) == 1
    assert not any("[flexfloor] error:" in t for t in after[:after.index(done)])


def test_no_process_of_the_job_outlives_it(runs):
    """After each kill -9 the dead worker's helpers (dist-checkpointing's writer processes, the
    resource_tracker) are ended too: once torchrun exits, the output pipe (`... | cat`) closes
    and no process of the job is left, for the faulted run as for the uninterrupted one."""
    assert launch.leftovers["faulted"] == {"pipe_closed": True, "left": []}
    assert launch.leftovers["reference"] == {"pipe_closed": True, "left": []}
    # the stale lock of a killed rank 0 was taken over by the restarted job, with a log line
    assert any("checkpoint.dir: took over the stale lock of pid" in t for _, t in runs["lines"])


def sigterm_after_step_1(tmp_path, *overrides: str, at=None) -> tuple[int, list[str]]:
    """`bash examples/train_moe.sh` as a user runs it, SIGTERM to the launcher after step 1 (or
    at the first line `at` finds, a regex) as Slurm or a terminal's Ctrl-C signals torchrun.
    Returns its exit code and output lines, once nothing of the job is left (checked)."""
    marker = f"script-{os.getpid()}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k not in ("STEPS", "MASTER_PORT")}
    env.update(CONFIG=JOB[1], NPROC=str(NPROC), PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               FLEXFLOOR_TEST_JOB=marker)
    popen = subprocess.Popen(
        ["bash", os.path.join(REPO, "examples", "train_moe.sh"), *JOB[2:], "trainer.steps=50",
         f"logging.run_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt", *overrides],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    lines = []
    try:
        for line in popen.stdout:
            lines.append(line.rstrip("\n"))
            if (at or STEP_LINE).search(line):
                popen.send_signal(signal.SIGTERM)  # the launcher: bash exec'd it
                break
        lines += popen.stdout.read().splitlines()
        popen.wait(timeout=120)
    finally:
        end_job(popen)
    deadline = time.monotonic() + 10
    while job_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_processes(marker) == []
    return popen.returncode, lines


def test_the_launch_script_exits_75_on_a_stop_signal_without_a_traceback(runs, tmp_path):
    """The workers finish the step and save it, and the script exits 75 (torchrun itself
    would exit 1 with its own traceback); nothing of the job is left. After `runs`: its warm
    start is cached."""
    rc, lines = sigterm_after_step_1(tmp_path)
    out = "\n".join(lines)
    assert rc == 75, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    (done,) = [t for t in lines if "preempted by SIGTERM" in t]
    step = int(re.search(r"after step (\d+):", done).group(1))
    assert os.path.isdir(tmp_path / "ckpt" / f"iter_{step:07d}")


def test_the_launch_script_stopped_in_the_warm_start_exits_75_at_once(runs, tmp_path):
    """A stop signal during the supervised warm start (minutes in the main job, where a user
    is most likely to press Ctrl-C) ends it after the supervised step in progress: nothing is
    cached or saved, the line says the same command starts the run again, the lock of
    checkpoint.dir is released, exit 75, no traceback. Before, the warm start ran on until
    torchrun killed the workers 30 s later."""
    rc, lines = sigterm_after_step_1(tmp_path, "trainer.sft_warmup_steps=400",
                                     at=re.compile(r"warm start \(supervised\)"))
    out = "\n".join(lines)
    assert rc == 75, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    stopped = [t for t in lines if re.search(r"warm start: stopped after \d+ of 400 supervised "
                                             r"steps \(nothing cached", t)]
    assert len(stopped) == 1, out[-4000:]
    assert any("preempted by SIGTERM before step 1: no step finished yet, nothing to save" in t
               and "run the same command again to start it again (nothing to resume from) "
               "(exit code 75)" in t for t in lines), out[-4000:]
    assert not os.path.exists(tmp_path / "ckpt" / "flexfloor.lock")
    assert not [d for d in os.listdir(tmp_path / "ckpt") if d.startswith("iter_")]
    # the run folder's line names only what is there (no step logged, no plot)
    (folder,) = [t for t in lines if "run folder: " in t]
    assert "metrics.jsonl" not in folder and "timeline.png" not in folder, folder
    assert not os.path.exists(tmp_path / "sft_cache") or not any(
        os.path.exists(os.path.join(tmp_path, "sft_cache", k, "latest"))
        for k in os.listdir(tmp_path / "sft_cache"))


def test_the_launch_script_past_the_grace_exits_143_unsaved(runs, tmp_path):
    """The same stop where the step in progress and its save take longer than
    checkpoint.preempt_grace_s: each worker stops at the grace with one line naming the
    setting (a preemption never becomes a hang until the scheduler's SIGKILL), the script
    exits 143 (128 + SIGTERM) with the launcher's line, no checkpoint is written and nothing
    of the job is left."""
    rc, lines = sigterm_after_step_1(tmp_path, "checkpoint.save_interval=1000",
                                     "checkpoint.preempt_grace_s=0.01")
    out = "\n".join(lines)
    assert rc == 128 + signal.SIGTERM, out[-4000:]
    assert "Traceback" not in out and "preempted by" not in out, out[-4000:]
    grace = [t for t in lines if re.search(
        r"\[flexfloor\] error: rank \d: SIGTERM: no checkpoint within checkpoint\.preempt_grace_s="
        r"0\.01 s \(the step in progress or the save took longer\); the job resumes from its "
        r"previous checkpoint; raise checkpoint\.preempt_grace_s", t)]
    # the rank that reaches its grace first exits; a peer still in its 1 s look for an exited
    # worker takes that exit for torchrun's stop of a failed group (flexfloor.preemption), and
    # one in a collective with it fails there: one line each, no save, no traceback
    gone = [t for t in lines if re.search(r"\[flexfloor\] error: rank \d: SIGTERM from the "
                                          r"launcher after a worker of this node exited", t)]
    failed = [t for t in lines if re.search(r"\[flexfloor\] error: rank \d, phase .*\(while "
                                            r"stopping for SIGTERM: no checkpoint saved\)$", t)]
    assert grace and len(grace) + len(gone) + len(failed) == NPROC, out[-4000:]
    assert ("[flexfloor] stopped by SIGTERM before every worker had saved its step: run the "
            "same command again to resume from the newest checkpoint") in out
    assert [d for d in os.listdir(tmp_path / "ckpt") if d.startswith("iter_")
            and not d.endswith(".tmp")] == []


def test_the_launchers_exit_code_follows_the_last_attempts_workers(tmp_path):
    """flexfloor.launch.local's decision, from the codes the workers report."""
    from flexfloor.launch import local
    from flexfloor.preemption import PREEMPTED_EXIT_CODE

    assert local.PREEMPTED == PREEMPTED_EXIT_CODE  # kept apart: the launcher's import is light

    folder = tmp_path / "status"
    folder.mkdir()
    env = dict(os.environ)
    try:
        os.environ[local.STATUS_ENV] = str(folder)
        for attempt, rank, code in ((0, 0, 1), (0, 1, 75), (1, 0, 75), (1, 1, 75)):
            os.environ.update(TORCHELASTIC_RESTART_COUNT=str(attempt), RANK=str(rank))
            local.report_exit(code)
    finally:
        os.environ.clear()
        os.environ.update(env)
    (folder / "attempt_9.rank_0.tmp").write_text("0")  # a report cut short is not read
    codes = local.last_attempt_codes(str(folder))
    assert codes == {0: 75, 1: 75}
    # a worker of a later round with the same count (c10d, restarted for another node's
    # failure) clears its predecessor's report as it starts: killed before it reports, it
    # leaves none, not the 75
    try:
        os.environ.update({local.STATUS_ENV: str(folder), "TORCHELASTIC_RESTART_COUNT": "1",
                           "RANK": "1"})
        local.clear_report()
        local.clear_report()  # nothing left to clear: no error
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert local.last_attempt_codes(str(folder)) == {0: 75}
    assert local.outcome({0: 75}, 2, 1, None) == 1  # not every worker saved: not preempted
    assert local.outcome(codes, 2, 1, 15) == 75  # preempted and saved: 75, whoever signalled
    assert local.outcome(codes, 2, 1, None) == 75  # a worker signalled, torchrun reported 1
    assert local.outcome({0: 75}, 2, 1, 15) == 128 + 15  # one worker did not save
    assert local.outcome({0: 0, 1: 0}, 2, 1, 2) == 0  # signalled after the last step
    assert local.outcome({}, 2, 1, None) == 1  # torchrun's own outcome
    assert local.outcome({0: 1, 1: 75}, 2, 1, None) == 1
    assert local.outcome({}, 2, 0, None) == 0


# ------------------------------------------------------------------- random-kill soak

RANDOM_KILLS = 3


def workers_of(popen) -> list[int]:
    """The flexfloor.train workers torchrun runs now (its children)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == popen.pid and b"flexfloor.train" in cmd:
                pids.append(int(entry))
    return pids


STEP_LINE = re.compile(r"step\s+\d+ \|")  # a training step's line in the job's output


def random_killer(seed: int, record: list, within_s: float):
    """SIGKILL a random worker at a random time of each of the first RANDOM_KILLS attempts:
    set-up, rollout, training or a save, wherever the clock falls (fewer kills when the job
    ends first). The first falls within 0.2 s after a random step line of the first attempt
    (step 1 to STEPS - 1: a step is still to come), so one lands however fast the machine (the
    uninterrupted run's wall counts the warm start, which the later runs take from its cache);
    each later one 1 s to 15 s after the attempt's workers exist, and within 0.4 of `within_s`
    (the uninterrupted run's wall on this machine)."""
    rng = random.Random(seed)
    latest = max(1.5, min(15.0, 0.4 * within_s))
    first_after = rng.randint(1, STEPS - 1)
    seen = [0, 0]  # the first attempt's lines read, step lines among them

    def steps_seen(lines) -> int:
        for _, t in lines[seen[0]:]:
            seen[0] += 1
            seen[1] += bool(STEP_LINE.match(t))
        return seen[1]

    def run(popen, lines):
        dead = set()
        for attempt in range(RANDOM_KILLS):
            workers = []
            while popen.poll() is None and len(workers) < NPROC:
                workers = [p for p in workers_of(popen) if p not in dead]
                time.sleep(0.1)
            if attempt == 0:
                t0 = time.monotonic()
                while popen.poll() is None and steps_seen(lines) < first_after:
                    time.sleep(0.01)
                time.sleep(rng.uniform(0.0, 0.2))
                delay = time.monotonic() - t0
            else:
                delay = rng.uniform(1.0, latest)
                time.sleep(delay)
            if popen.poll() is not None or not workers:
                break  # the job finished before this kill: the run is shorter than the clock
            victim = rng.choice(workers)
            last = next((t for _, t in reversed(lines) if STEP_LINE.match(t)), None)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
            dead.update(workers)
            record.append({"after_s": round(delay, 1), "rank": workers.index(victim),
                           "last_step_line": (last or "")[:9]})
    return run


@pytest.fixture(scope="module")
def soak(runs):
    seed = int(os.environ.get("FLEXFLOOR_SOAK_SEED", time.time_ns() % 10_000))
    record = []
    rc, lines = launch(runs["base"], "random_kills", max_restarts=RANDOM_KILLS,
                       during=random_killer(seed, record, runs["reference_wall_s"]))
    print(json.dumps({"seed (FLEXFLOOR_SOAK_SEED)": seed, "kills": record}))
    assert rc == 0, f"seed {seed}, kills {record}\n" + "\n".join(t for _, t in lines[-80:])
    return {"seed": seed, "kills": record, "lines": lines}


def test_random_kills_resume_to_an_uninterrupted_run(runs, soak):
    """A few kill -9s at random times (a random worker; the first just after a random step of
    the first attempt, the others 1-15 s into the next attempts and within 0.4 of the
    uninterrupted run's wall), each resumed by torchrun: metrics and final weights and
    optimizer state equal the uninterrupted run's; no process is left."""
    # how many kills land depends on how long the run lasts on this machine (the job may end
    # before the last ones): the first always, each resumed
    assert 1 <= len(soak["kills"]) <= RANDOM_KILLS, soak["kills"]
    got, want = metrics(runs["base"], "random_kills"), runs["ref_metrics"]
    assert [m["step"] for m in got] == list(range(1, STEPS + 1)), soak["seed"]
    for g, w in zip(got, want):
        assert {k: g.get(k) for k in EXACT} == {k: w.get(k) for k in EXACT}, (g["step"], soak)
    it = f"iter_{STEPS:07d}"
    proc = subprocess.run([PY, os.path.join(REPO, "tests", "workers", "fault_compare.py"),
                           str(runs["base"] / "reference_ckpt" / it),
                           str(runs["base"] / "random_kills_ckpt" / it)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=REPO,
                                              PYTHONWARNINGS="ignore"), timeout=120)
    assert proc.returncode == 0 and "differ: []" in proc.stdout, (proc.stdout, soak)
    assert launch.leftovers["random_kills"] == {"pipe_closed": True, "left": []}, soak

