"""HF <-> FlexFloor conversion of Mixtral, Qwen3-MoE and OLMoE, checked against `transformers`.

tests/workers/convert.py at two world sizes, each in the session's launch of that size (1 worker:
EP=1 plus the error cases; 2 workers: EP=2),
each running every family: logits of FlexFloor's trainer path vs transformers, greedy tokens of
FlexFloor's engine vs transformers' generate, and the HF -> FlexFloor -> HF round trip bit for
bit (reloaded by transformers). The pure family rules are checked without processes.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from flexfloor.config import ModelConfig, QKNorm
from flexfloor.convert.families import FAMILIES, ConversionError, family_of
from distributed import REPO, Worker

FAMILY_NAMES = sorted(FAMILIES)
TOL = 1e-5  # fp32 logits, max |FlexFloor - transformers|
WORKERS = (Worker("convert.py", 1, timeout=300), Worker("convert.py", 2, timeout=300))


@pytest.fixture(scope="module")
def launch(shared):
    """Results of the worker on n processes (EP = n), run once per n."""
    done = {}

    def get(n):
        if n not in done:
            (worker,) = [w for w in WORKERS if w.nproc == n]
            run = shared.run(worker)
            done[n] = {**run.results, "_ep": n, "_out": str(run.out)}
        return done[n]

    return get


@pytest.fixture(scope="module", params=[1, 2], ids=["ep1", "ep2"])
def results(request, launch):
    return launch(request.param)


@pytest.fixture(scope="module")
def errors(launch):
    return launch(1)["errors"]  # the error cases run in the EP=1 launch


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_logits_match_transformers(results, family):
    r = results[family]
    print(f"{family} EP={results['_ep']}: max|diff| {r['logits_max_abs_diff']:.3g} "
          f"(logits up to {r['logits_max_abs']:.3g})")
    assert r["logits_max_abs"] > 0.1  # the comparison is not of near-zero numbers
    assert r["logits_max_abs_diff"] <= TOL


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_engine_greedy_equals_transformers_generate(results, family):
    r = results[family]
    assert len(r["greedy_hf"]) == 6 and all(len(t) == 16 for t in r["greedy_hf"])
    assert len({tuple(t) for t in r["greedy_hf"]}) > 1  # prompts lead to different answers
    assert r["greedy_flexfloor"] == r["greedy_hf"]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_round_trip_is_bit_exact_and_loads_in_transformers(results, family):
    rt = results[family]["round_trip"]
    assert rt["tensors"] > 0
    assert rt["missing"] == [] and rt["unexpected"] == [] and rt["differ"] == []
    assert rt["config_equal"], rt["config_diff"]
    if results["_ep"] == 2:  # one shard per EP rank, with the index transformers reads
        assert "model.safetensors.index.json" in rt["files"]
        assert sum(f.endswith(".safetensors") for f in rt["files"]) == 2
        # the EP=2 checkpoint written back by 2 workers at EP=1: one file, same bits
        rt1 = results[family]["round_trip_ep1"]
        assert rt1["files"] == ["config.json", "model.safetensors"]
        assert rt1["differ"] == [] and rt1["missing"] == [] and rt1["unexpected"] == []
    assert results[family]["reloaded_logits_equal"]


def test_features_of_each_family(results):
    assert results["qwen3_moe"]["qk_norm"] == "per_head" and results["qwen3_moe"]["norm_topk"]
    assert results["olmoe"]["qk_norm"] == "full_width" and not results["olmoe"]["norm_topk"]
    assert results["mixtral"]["qk_norm"] == "none" and results["mixtral"]["norm_topk"]


def test_bad_checkpoints_fail_naming_the_tensor_and_write_nothing(errors):
    e = errors
    assert e["shape"]["type"] == "ConversionError"
    assert "model.layers.1.block_sparse_moe.experts.5.w3.weight" in e["shape"]["error"]
    assert "[47, 64]" in e["shape"]["error"] and "[48, 64]" in e["shape"]["error"]
    assert "model.embed_tokens.weight" in e["vocab"]["error"]
    assert "vocabulary" in e["vocab"]["error"] and "100" in e["vocab"]["error"]
    assert "model.layers.0.self_attn.v_proj.weight" in e["missing"]["error"]
    assert "model.vocab_size" in e["to_hf_vocab"]["error"]
    assert "exists already" in e["to_hf_exists"]["error"] and e["to_hf_exists"]["unchanged"]
    for name in ("shape", "vocab", "missing", "to_hf_vocab", "to_hf_exists"):
        assert not e[name]["written"]
    assert e["cli_exit"] == 2 and not e["cli_written"]


def test_rerun_over_a_crashed_conversions_leftover_tmp_succeeds_and_loads(errors):
    r = errors["rerun"]
    assert r["error"] is None  # not "iter_0000000 exists already"
    assert not r["leftover"] and r["params"] > 0 and r["equal"]


def _cli(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"),
                           *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def _assert_refused(proc, reason):
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[convert] error:")]
    assert len(errors) == 1 and reason in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


def test_cli_ep2_refusals_exit_2_with_one_line_and_no_traceback(launch, training_ckpt):
    d = os.path.join(launch(1)["_out"], "mixtral")
    ckpt, hf = os.path.join(d, "flexfloor"), os.path.join(d, "hf")
    before = sorted(os.listdir(ckpt))
    # refused by the launching process before any worker starts: outputs that exist already
    _assert_refused(_cli("hf-to-flexfloor", "--hf", hf, "--out", ckpt, "--ep", "2"),
                    "iter_0000000 exists already")
    _assert_refused(_cli("flexfloor-to-hf", "--ckpt", ckpt, "--out", hf, "--ep", "2"),
                    f"{hf} exists already")
    assert sorted(os.listdir(ckpt)) == before
    # refused inside the 2 workers (loading a training checkpoint, which records no model, with
    # a config of another vocabulary)
    out = os.path.join(d, "hf_cli_bad_vocab")
    _assert_refused(_cli("flexfloor-to-hf", "--ckpt", training_ckpt, "--out", out, "--ep", "2",
                         "--config", GRPO_TINY, "--family", "mixtral", "model.vocab_size=256"),
                    "model.vocab_size: checkpoint 128 vs config 256")
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny Mixtral HF folder (8 experts), saved by transformers."""
    from flexfloor.convert.hf_reference import tiny_hf_model

    path = str(tmp_path_factory.mktemp("tiny") / "hf")
    tiny_hf_model("mixtral").save_pretrained(path, safe_serialization=True)
    return path


def test_cli_bad_arguments_exit_2_naming_the_flag_before_any_work(tmp_path):
    (tmp_path / "file").write_text("x")
    hf, ckpt, file = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "file")
    cases = [  # refused by the argument parser: nothing is read, so the inputs need not exist
        (["hf-to-flexfloor", "--hf", hf, "--out", ckpt, "--ep", "0"], "--ep 0 must be at least 1"),
        (["flexfloor-to-hf", "--ckpt", ckpt, "--out", hf, "--ep", "-2"],
         "--ep -2 must be at least 1"),
        (["hf-to-flexfloor", "--hf", hf, "--out", ckpt, "--step", "-1"],
         "--step -1 must be at least 0"),
        (["flexfloor-to-hf", "--ckpt", ckpt, "--out", hf, "model.vocab_size=256"],
         "overrides model.vocab_size=256 change --config, which is not given; pass --config"),
        (["hf-to-flexfloor", "--hf", hf, "--out", str(tmp_path / "no" / "ckpt")],
         f"--out {tmp_path / 'no' / 'ckpt'}: folder {tmp_path / 'no'} does not exist"),
        (["flexfloor-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "no" / "hf")],
         f"--out {tmp_path / 'no' / 'hf'}: folder {tmp_path / 'no'} does not exist"),
        (["hf-to-flexfloor", "--hf", hf, "--out", os.path.join(file, "ckpt")],
         f"--out {file}/ckpt: {file} is not a folder"),
        (["flexfloor-to-hf", "--ckpt", ckpt, "--out", os.path.join(file, "hf")],
         f"--out {file}/hf: {file} is not a folder"),
        (["flexfloor-to-hf", "--ckpt", ckpt, "--out", file], f"--out {file}: is a file"),
    ]
    for argv, reason in cases:
        proc = _cli(*argv)
        assert proc.returncode == 2, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert "error: " + reason in last, proc.stderr
        assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing created


def test_cli_ep_that_does_not_divide_the_experts_is_refused_before_workers(tiny_hf, tmp_path):
    out = str(tmp_path / "ckpt")
    _assert_refused(_cli("hf-to-flexfloor", "--hf", tiny_hf, "--out", out, "--ep", "3"),
                    "--ep 3 does not divide the model's 8 experts (each worker holds the same "
                    "number); use one of [1, 2, 4, 8]")
    assert not os.path.exists(out)


def test_cli_missing_checkpoint_names_the_ckpt_flag(tmp_path):
    proc = _cli("flexfloor-to-hf", "--ckpt", str(tmp_path / "missing"),
                "--out", str(tmp_path / "hf"))
    _assert_refused(proc, f"checkpoint path {tmp_path / 'missing'} does not exist (--ckpt)")
    assert "checkpoint.load" not in proc.stderr


GRPO_TINY = os.path.join(REPO, "examples", "configs", "grpo_tiny.yaml")


@pytest.fixture(scope="module")
def training_ckpt(tmp_path_factory):
    """A FlexFloor checkpoint as training saves it (grpo_tiny's model section, no HF config
    recorded), saved in this process's one-rank gloo world: seconds, no torchrun run."""
    from distributed import one_rank_world
    from flexfloor.checkpoint import save_checkpoint
    from flexfloor.config import load_config
    from flexfloor.model import build_model

    cfg = load_config(GRPO_TINY).model
    root = str(tmp_path_factory.mktemp("train") / "ckpt")
    with one_rank_world() as par:
        save_checkpoint(root, 3, model=build_model(cfg, par), model_cfg=cfg,
                        extra_state={"step": 3})
    return root


@pytest.mark.parametrize("flags, reason", [
    ([], "CKPT does not record its HF family (only a checkpoint this converter made from an HF "
         "folder does); pass --family {mixtral,qwen3_moe,olmoe}, the HF family of its model "
         "(its layout fits mixtral)"),
    (["--family", "qwen3_moe"], "model.qk_norm=none but qwen3_moe has per_head q/k norms: this "
     "model was not built as qwen3_moe; the family without q/k norms is mixtral "
     "(--family mixtral)"),
])
def test_cli_training_checkpoint_without_its_family_says_which_to_pass(training_ckpt, tmp_path,
                                                                       flags, reason):
    """A training checkpoint records no HF model_type: the refusal names --family and its
    choices (not `model_type None is not supported`), and a family that does not match the
    model's layout names the one that does. One line, status 2, nothing written."""
    out = tmp_path / "hf"
    proc = _cli("flexfloor-to-hf", "--ckpt", training_ckpt, "--out", str(out), "--config",
                GRPO_TINY, *flags)
    reason = reason.replace("CKPT", training_ckpt)
    _assert_refused(proc, reason)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[convert] error:")]
    assert errors == ["[convert] error: " + reason], proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_family_names_the_choices(training_ckpt, tmp_path):
    from flexfloor.config import load_config
    from flexfloor.convert import check_flexfloor_to_hf

    cfg = load_config(GRPO_TINY).model
    with pytest.raises(ConversionError) as e:
        check_flexfloor_to_hf(training_ckpt, str(tmp_path / "hf"), model_cfg=cfg, family="llama")
    assert str(e.value) == ("--family llama: not a supported family; pass --family "
                            "{mixtral,qwen3_moe,olmoe}")
    # the family the message names is one the model converts to
    assert check_flexfloor_to_hf(training_ckpt, str(tmp_path / "hf"), model_cfg=cfg,
                                 family="mixtral")[1].model_type == "mixtral"


def _processes_naming(text: str) -> list[str]:
    """Command lines of the live processes (this one aside) whose arguments contain `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if int(pid) != os.getpid() and text in cmd:
            found.append(cmd)
    return found


def _convert_proc(tmp_path, *argv):
    """The tool started on `argv`, its temporary files in tmp_path/tmp."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp, subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"), *argv],
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp)})


def _wait_for(what, proc, ok):
    deadline = time.monotonic() + 120
    while not ok() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None and ok(), f"{what}: never happened while the tool ran"


def _cmdline(p) -> list[str]:
    """A process's command line; [] once it has ended."""
    import psutil

    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _signal_mask(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith(field + ":"))


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler of its own for `sig` (/proc's SigCgt mask)."""
    return bool(_signal_mask(pid, "SigCgt") >> (sig - 1) & 1)


def _stopping(pid: int, sigs) -> bool:
    """Whether one of `sigs` was sent to process `pid` and waits to be delivered (it is
    paused), or the process has ended."""
    try:
        mask = _signal_mask(pid, "ShdPnd")
    except FileNotFoundError:
        return True
    return any(mask >> (s - 1) & 1 for s in sigs)


# (SIGHUP goes through the same handlers as SIGTERM and SIGINT: STOP_SIGNALS; at --ep 2 the
# SIGINT case, which the workers ignore until torchrun's SIGTERM, covers SIGTERM's path too)
@pytest.mark.parametrize("sig, ep", [(signal.SIGTERM, "1"), (signal.SIGINT, "1"),
                                     (signal.SIGINT, "2")],
                         ids=["sigterm-one_process", "sigint-one_process", "sigint-ep2"])
def test_cli_signal_stops_the_workers_and_leaves_nothing(tiny_hf, tmp_path, sig, ep):
    """A signal to the tool mid-conversion (ckpt.tmp/iter_0000000.tmp being written: by the 2
    workers at --ep 2, by the tool's own process at --ep 1) stops torchrun and the workers, and removes the
    output and the temporary files. The writers are paused the moment the output appears (the
    tool at --ep 1; the workers at --ep 2 until the tool's signal reaches them), so the signal
    lands mid-write however loaded the machine is."""
    import psutil

    out = str(tmp_path / "ckpt")
    tmp, proc = _convert_proc(tmp_path, "hf-to-flexfloor", "--hf", tiny_hf, "--out", out,
                              "--ep", ep)
    try:
        _wait_for("the output folder", proc, lambda: os.path.exists(out + ".tmp"))
        if ep == "1":
            writers = [psutil.Process(proc.pid)]
        else:  # torchrun's own children: the checkpoint writers the workers fork are theirs
            writers = [w for p in psutil.Process(proc.pid).children()
                       if "torch.distributed.run" in _cmdline(p) for w in p.children()]
            assert len(writers) == 2
        for p in writers:
            p.suspend()
        proc.send_signal(sig)
        # the tool passes `sig` to torchrun's group; a worker that ignores it (SIGINT) gets
        # torchrun's SIGTERM
        _wait_for(f"{sig.name} forwarded to the workers", proc, lambda: ep == "1" or all(
            _stopping(p.pid, (sig, signal.SIGTERM)) for p in writers))
        for p in writers:
            try:
                p.resume()
            except psutil.NoSuchProcess:  # ended meanwhile
                pass
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert f"[convert] stopped by {sig.name}" in err
    assert _processes_naming(out) == []  # torchrun and both workers have ended
    assert sorted(os.listdir(tmp_path)) == ["tmp"] and os.listdir(tmp) == []


def test_cli_signal_keeps_an_output_folder_that_was_there(tmp_path):
    """Stopped before its checks (here: as it imports), the tool removes only what it made:
    an --out that was there stays with what it holds (its check would refuse it later)."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    _, proc = _convert_proc(tmp_path, "flexfloor-to-hf", "--ckpt", str(tmp_path / "ckpt"),
                            "--out", str(out))
    try:
        _wait_for("the tool's SIGTERM handler", proc, lambda: _catches(proc.pid, signal.SIGTERM))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert os.listdir(out) == ["mine.txt"]


@pytest.mark.parametrize("ep", ["1", "2"])
def test_cli_sigkill_to_the_tool_ends_its_processes_and_leaves_nothing(tiny_hf, tmp_path, ep):
    """SIGKILL cannot be forwarded: the reaper the tool starts ends torchrun and the workers
    (--ep 2), then removes the output this run left half done and the tool's scratch folder. The
    workers are paused first (SIGSTOP), so they can neither finish nor stop on their own: only
    the reaper's SIGKILL ends them. With --ep 1 the tool is the writer."""
    import psutil

    out = str(tmp_path / "ckpt")
    tmp, proc = _convert_proc(tmp_path, "hf-to-flexfloor", "--hf", tiny_hf, "--out", out,
                              "--ep", ep)
    helpers = []
    try:
        _wait_for("the output folder", proc, lambda: os.path.exists(out + ".tmp"))
        helpers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if out in " ".join(_cmdline(p))]  # not the reaper
        for p in helpers:
            try:
                p.suspend()
            except psutil.Error:  # a checkpoint writer's fork that has ended
                pass
        proc.kill()
        proc.wait(timeout=120)  # not communicate(): the paused helpers hold its stderr open
        _, alive = psutil.wait_procs(helpers, timeout=120)
        deadline = time.monotonic() + 60  # the reaper removes them once its kills are done
        while (os.path.exists(out + ".tmp") or os.listdir(tmp)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.kill()
        for p in helpers:
            try:
                p.kill()
            except psutil.Error:
                pass
    assert len(helpers) >= (3 if ep == "2" else 0)  # torchrun and its two workers
    assert alive == [] and _processes_naming(out) == []
    assert {"out": sorted(os.listdir(tmp_path)), "tmp": os.listdir(tmp)} == {"out": ["tmp"],
                                                                               "tmp": []}


def _refusal_in_process(capsys, *argv) -> str:
    """The one `[convert] error:` line of the CLI refusing `argv` in this process: --ep 2 runs
    every check that needs no workers here, before any worker starts."""
    from tools.convert_checkpoint import main

    assert main([*argv, "--ep", "2"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("[convert] error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0].removeprefix("[convert] error: ")


@pytest.fixture
def converted(launch, tmp_path):
    """Copies of the converted Mixtral checkpoint root and of its HF folder, and the Qwen3-MoE
    HF folder (the EP=1 launch's)."""
    import shutil

    d = launch(1)["_out"]
    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    shutil.copytree(os.path.join(d, "mixtral", "flexfloor"), ckpt)
    shutil.copytree(os.path.join(d, "mixtral", "hf"), hf)
    return ckpt, hf, os.path.join(d, "qwen3_moe", "hf")


def _tree(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path)
                  for f in files)


def test_cli_refuses_an_out_root_of_another_model_a_step_not_above_latest_or_inside_hf(
        converted, capsys):
    """An --out root takes only a later step of the model it records (never two models in one
    root, never `latest` moved back), and never the --hf folder or a folder inside it."""
    ckpt, hf, qwen = converted
    os.rename(os.path.join(ckpt, "iter_0000000"), os.path.join(ckpt, "iter_0000005"))
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("iter_0000005\n")
    before = {p: _tree(p) for p in (ckpt, hf)}
    assert _refusal_in_process(capsys, "hf-to-flexfloor", "--hf", qwen, "--out", ckpt,
                               "--step", "9") == (
        f"--out {ckpt} holds checkpoints of another model than --hf {qwen} (model.preset: "
        "recorded mixtral-8x7b vs --hf qwen3-30b-a3b, model.ffn_hidden_size: recorded 48 vs "
        "--hf 96, model.kv_channels: recorded 16 vs --hf 32, model.rotary_base: recorded "
        f"1000000 vs --hf 10000 and 1 more; recorded in {ckpt}/model.yaml); one root holds one "
        "model: give another --out")
    assert _refusal_in_process(capsys, "hf-to-flexfloor", "--hf", hf, "--out", ckpt,
                               "--step", "3") == (
        f"--step 3 is not above step 5, which {ckpt}/latest holds, and a conversion never "
        "moves it back: give --step 6 or more, or another --out")
    assert _refusal_in_process(capsys, "hf-to-flexfloor", "--hf", hf, "--out", hf + "/") == (
        f"--out {hf}/ is the --hf folder: the checkpoint would be written among the model's "
        "files; give an --out outside it")
    assert _refusal_in_process(capsys, "hf-to-flexfloor", "--hf", hf, "--out",
                               os.path.join(hf, "ckpt")).startswith(
        f"--out {hf}/ckpt is inside the --hf folder {hf}: ")
    assert {p: _tree(p) for p in (ckpt, hf)} == before


def test_cli_names_the_input_that_is_wrong(converted, capsys, training_ckpt):
    """A path of the wrong kind is named as such (not as an unfinished save), and a --config
    that a converted checkpoint does not need, when it differs from the recorded model, is the
    input named."""
    import shutil

    ckpt, hf, _ = converted
    out = os.path.join(os.path.dirname(ckpt), "out")
    assert _refusal_in_process(capsys, "flexfloor-to-hf", "--ckpt", hf, "--out", out) == (
        f"--ckpt {hf}: this is a Hugging Face model folder (config.json), not a FlexFloor "
        "checkpoint: use hf-to-flexfloor")
    assert _refusal_in_process(capsys, "flexfloor-to-hf", "--ckpt", f"{ckpt}/latest",
                               "--out", out) == (
        f"{ckpt}/latest is a file, give the folder: a checkpoint root or one of its iter_N "
        "folders (--ckpt)")
    assert _refusal_in_process(capsys, "hf-to-flexfloor", "--hf", f"{hf}/config.json",
                               "--out", out).startswith(
        f"{hf}/config.json is a file, give the folder that holds it")
    refusal = _refusal_in_process(capsys, "flexfloor-to-hf", "--ckpt", ckpt, "--out", out,
                                  "--config", GRPO_TINY)
    assert refusal.startswith(f"--config describes another model than --ckpt {ckpt} records ("
                              "model.preset: checkpoint mixtral-8x7b vs config tiny, "), refusal
    assert refusal.endswith("; a checkpoint this converter made records its model: drop "
                            "--config"), refusal
    # the same model section (its own model.yaml) is no mistake
    from tools.convert_checkpoint import main

    assert main(["flexfloor-to-hf", "--ckpt", ckpt, "--out", out, "--config",
                 os.path.join(ckpt, "model.yaml"), "--ep", "2"]) == 0
    os.remove(os.path.join(ckpt, "latest"))
    assert _refusal_in_process(capsys, "flexfloor-to-hf", "--ckpt", ckpt, "--out", out + "2") == (
        f"{ckpt} has no `latest` file in it and is no iter_N folder: give an iter_N folder in "
        "it (iter_0000000) (--ckpt)")
    # a sharded HF folder whose index names a shard that is not there
    assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors",
                                       "model.safetensors.index.json"]
    os.remove(os.path.join(out, "model-00002-of-00002.safetensors"))
    assert _refusal_in_process(capsys, "hf-to-flexfloor", "--hf", out, "--out", out + "3") == (
        f"the index {out}/model.safetensors.index.json names model-00002-of-00002.safetensors, "
        "which is missing; copy every shard of the model into the folder or re-save it with "
        "save_pretrained")
    shutil.rmtree(out)


def _cli_file_size_limit(*args):
    """The CLI with no file it writes allowed past 100 kB (a full disk, as a write sees it:
    each checkpoint shard is larger), EFBIG instead of SIGXFSZ."""
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"),
                           *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=limit, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_cli_a_failed_write_exits_2_naming_the_cause_and_leaves_nothing(converted, tmp_path):
    """A write that fails (the disk full): one `[convert] error:` line naming the cause and
    the fix, status 2, and what the run wrote removed: iter_N.tmp in a checkpoint root that was
    there (one process), or the new output folder (2 workers, the failing rank named). (The
    other two pairings take the same paths: `_alone`'s and `_launch`'s clean-up, `write_hf`'s
    and the checkpoint writer's errors.)"""
    ckpt, hf, _ = converted
    before = _tree(ckpt)
    cases = [  # (argv, the error line's start, what it also says)
        (["hf-to-flexfloor", "--hf", hf, "--out", ckpt, "--step", "1"],
         f"saving {ckpt}/iter_0000001.tmp failed", "free space or fix the permissions of --out"),
        (["flexfloor-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "hf2"), "--ep", "2"],
         f"writing {tmp_path}/hf2 failed: rank 0: Error while serializing: I/O error: File too "
         "large", "; free space there or give another --out"),
    ]
    for argv, start, also in cases:
        proc = _cli_file_size_limit(*argv)
        _assert_refused(proc, start)
        line = next(x for x in proc.stderr.splitlines() if x.startswith("[convert] error:"))
        assert line.startswith("[convert] error: " + start) and also in line, line
        assert "encountered an error" not in proc.stderr
    assert _tree(ckpt) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]


# (a SIGTERM at --ep 2 takes `_launch`'s path as the SIGINT in one process takes `_alone`'s:
# both end in `_stopped`, which keeps a complete output)
@pytest.mark.parametrize("sig, ep", [(signal.SIGINT, "1"), (signal.SIGKILL, "2")],
                         ids=["sigint-one_process", "sigkill-ep2"])
def test_cli_a_stop_after_the_output_is_complete_keeps_it(tiny_hf, tmp_path, sig, ep):
    """A stop that comes once the new root is complete (renamed into place with its `latest`):
    the checkpoint stays, and the tool exits 0; killed outright, its reaper removes only its
    scratch. At --ep 1 the tool is paused the moment `latest` appears, so the signal lands
    after it however loaded the machine is."""
    import psutil

    out = str(tmp_path / "ckpt")
    tmp, proc = _convert_proc(tmp_path, "hf-to-flexfloor", "--hf", tiny_hf, "--out", out,
                              "--ep", ep)
    helpers = []
    try:
        _wait_for("the checkpoint's latest", proc,
                  lambda: os.path.exists(os.path.join(out, "latest")))
        tool = psutil.Process(proc.pid)
        if ep == "1":
            tool.suspend()
        helpers = tool.children(recursive=True)  # the reaper, torchrun and its workers
        proc.send_signal(sig)
        if ep == "1":
            tool.resume()
        _, err = proc.communicate(timeout=120)
        psutil.wait_procs(helpers, timeout=60)  # the reaper has done its removals
    finally:
        proc.kill()
    assert proc.returncode == (-9 if sig == signal.SIGKILL else 0), err[-3000:]
    assert "stopped by" not in err and "removed" not in err
    assert sorted(os.listdir(out)) == ["iter_0000000", "latest", "model.yaml"]
    assert os.path.isfile(os.path.join(out, "iter_0000000", "flexfloor.json"))
    assert os.listdir(tmp) == [] and sorted(os.listdir(tmp_path)) == ["ckpt", "tmp"]


def test_cli_ctrl_c_as_it_starts_prints_one_line(tiny_hf, tmp_path):
    """Ctrl-C while the tool imports torch (before any conversion): one `[convert] stopped by
    SIGINT` line, not an import's traceback, status 130, nothing written. The tool is paused
    once torch's library is loaded, so the signal lands among torch's imports."""
    import psutil

    out = str(tmp_path / "ckpt")
    tmp, proc = _convert_proc(tmp_path, "hf-to-flexfloor", "--hf", tiny_hf, "--out", out)

    def importing_torch():
        with open(f"/proc/{proc.pid}/maps") as f:
            return "libtorch_cpu" in f.read()

    try:
        _wait_for("torch's import", proc, importing_torch)
        tool = psutil.Process(proc.pid)
        tool.suspend()
        proc.send_signal(signal.SIGINT)
        tool.resume()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[convert] stopped by SIGINT"), err[-3000:]
    assert not os.path.exists(out) and os.listdir(tmp) == []


def test_bfloat16_round_trip_keeps_dtype_and_bits(errors):
    rt = errors["bf16"]
    assert rt["params_dtype"] == "bfloat16"
    assert rt["tensors"] > 0 and rt["differ"] == [] and rt["missing"] == [] and rt["config_equal"]


# ------------------------------------------------------------------ pure rules, no processes


def _cfg(family):
    return dict(
        mixtral=ModelConfig(num_layers=2, hidden_size=32, moe_ffn_hidden_size=24,
                            ffn_hidden_size=24, num_attention_heads=4, num_query_groups=2,
                            num_experts=4, vocab_size=40),
        qwen3_moe=ModelConfig(num_layers=2, hidden_size=32, moe_ffn_hidden_size=24,
                              num_attention_heads=4, num_query_groups=1, kv_channels=16,
                              num_experts=4, vocab_size=40, qk_norm=QKNorm.PER_HEAD),
        olmoe=ModelConfig(num_layers=2, hidden_size=32, moe_ffn_hidden_size=24,
                          ffn_hidden_size=24, num_attention_heads=4, num_query_groups=4,
                          num_experts=4, vocab_size=40, qk_norm=QKNorm.FULL_WIDTH,
                          moe_router_norm_topk=False),
    )[family]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_from_hf_then_to_hf_is_identity_and_qkv_is_grouped(family):
    fam, cfg = family_of(family), _cfg(family)
    g = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(s, generator=g) for r in fam.rules(cfg, range(cfg.num_experts))
          for k, s in zip(r.hf, r.hf_shapes)}
    fam.check_hf_shapes({k: t.shape for k, t in hf.items()}, cfg)
    state = fam.from_hf(hf.__getitem__, cfg, range(cfg.num_experts))
    back = fam.to_hf(state, cfg, range(cfg.num_experts))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    # Megatron's fused QKV: group 0's query heads, then its key, then its value
    qkv = state["decoder.layers.0.self_attention.linear_qkv.weight"]
    hd, rep = cfg.kv_channels or 8, cfg.num_attention_heads // cfg.num_query_groups
    a = "model.layers.0.self_attn."
    assert torch.equal(qkv[: rep * hd], hf[a + "q_proj.weight"][: rep * hd])
    assert torch.equal(qkv[rep * hd: (rep + 1) * hd], hf[a + "k_proj.weight"][:hd])
    assert torch.equal(qkv[(rep + 1) * hd: (rep + 2) * hd], hf[a + "v_proj.weight"][:hd])


def test_expert_subset_and_config_round_trip():
    fam, cfg = family_of("olmoe"), _cfg("olmoe")
    names = {r.megatron for r in fam.rules(cfg, [2, 3], dense=False)}
    assert names == {f"decoder.layers.{i}.mlp.experts.experts_global.{e}.linear_fc{j}.weight"
                     for i in range(2) for e in (2, 3) for j in (1, 2)}
    hf_cfg = fam.hf_config(cfg)
    assert fam.model_config(hf_cfg) == ModelConfig(**{**cfg.__dict__, "preset": "olmoe-1b-7b",
                                                      "kv_channels": 8})


def test_unsupported_features_are_refused_by_name():
    fam = family_of("mixtral")
    hf = fam.hf_config(_cfg("mixtral"))
    with pytest.raises(ConversionError, match="sliding_window=4096"):
        fam.model_config({**hf, "sliding_window": 4096})
    with pytest.raises(ConversionError, match="tie_word_embeddings=True"):
        fam.model_config({**hf, "tie_word_embeddings": True})
    with pytest.raises(ConversionError, match="'llama' is not supported"):
        family_of({"model_type": "llama"})
    with pytest.raises(ConversionError, match="qk_norm"):
        family_of("olmoe").hf_config(_cfg("mixtral"))


@pytest.mark.parametrize("built, asked", [(b, a) for b in FAMILY_NAMES for a in FAMILY_NAMES
                                           if a != b])
def test_a_family_that_does_not_match_the_model_names_the_one_that_does(built, asked):
    with pytest.raises(ConversionError) as e:
        family_of(asked).hf_config(_cfg(built))
    assert f"this model was not built as {asked}; the family " in str(e.value)
    assert str(e.value).endswith(f" is {built} (--family {built})"), str(e.value)


# config.json of the published checkpoints (transformers 4.x layout, structural keys)
PUBLISHED = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", attention_bias=False, decoder_sparse_step=1, head_dim=128,
        hidden_act="silu", hidden_size=2048, intermediate_size=6144, max_position_embeddings=40960,
        mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32,
        num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4,
        rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000.0, sliding_window=None,
        tie_word_embeddings=False, torch_dtype="bfloat16", use_sliding_window=False,
        vocab_size=151936),
    "mixtral-8x7b": dict(
        model_type="mixtral", hidden_act="silu", hidden_size=4096, intermediate_size=14336,
        max_position_embeddings=32768, num_attention_heads=32, num_experts_per_tok=2,
        num_hidden_layers=32, num_key_value_heads=8, num_local_experts=8, rms_norm_eps=1e-05,
        rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False,
        torch_dtype="bfloat16", vocab_size=32000),
    "olmoe-1b-7b": dict(
        model_type="olmoe", attention_bias=False, clip_qkv=None, hidden_act="silu",
        hidden_size=2048, intermediate_size=1024, max_position_embeddings=4096,
        norm_topk_prob=False, num_attention_heads=16, num_experts=64, num_experts_per_tok=8,
        num_hidden_layers=16, num_key_value_heads=16, rms_norm_eps=1e-05, rope_scaling=None,
        rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32", vocab_size=50304),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_match_the_published_configs(preset):
    from flexfloor.config import MODEL_PRESETS
    from flexfloor.convert.families import head_dim_of

    hf = PUBLISHED[preset]
    cfg = family_of(hf["model_type"]).model_config(hf)
    assert cfg.preset == preset
    for key, value in MODEL_PRESETS[preset].items():
        if key == "kv_channels":
            assert head_dim_of(cfg) == (value or cfg.hidden_size // cfg.num_attention_heads)
        else:
            assert getattr(cfg, key) == value, key
