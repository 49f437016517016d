"""The small tools refuse bad input before their work: exit status 2 and one line naming the flag
and the fix, no traceback, nothing written; what they do write appears whole (renamed over the
target, never written into it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece

from flexfloor.data import read_examples
from tools import (
    convert_checkpoint, heldout, make_synthetic_data, plot_timeline, simulate, train_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]


def refused(main, argv, capsys) -> str:
    """The error line `main(argv)` ends with, once it has exited with status 2."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("where, message", [
    ("{tmp}", "--out {tmp}: is a folder; give the file to write"),
    ("{tmp}/missing/d.parquet", "--out {tmp}/missing/d.parquet: folder {tmp}/missing does not "
                                "exist"),
])
def test_make_synthetic_data_checks_out_first(tmp_path, capsys, where, message):
    fill = {"tmp": str(tmp_path)}
    err = refused(make_synthetic_data.main,
                  ["--num-prompts", "4", "--seed", "0", "--out", where.format(**fill)], capsys)
    assert message.format(**fill) in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tool, argv, message", [
    (make_synthetic_data, ["--num-prompts", "4", "--seed", "0", "--out", "a.csv"],
     "--out a.csv: the file is written as Parquet; name it a.parquet"),
    (train_tokenizer, ["--out", "x.txt"],
     "--out x.txt: the file is written as a SentencePiece model; name it x.model"),
    (train_tokenizer, ["--out", "tok"], "--out tok: the file is written as a SentencePiece "
                                        "model; name it tok.model"),
])
def test_a_file_named_for_another_format_is_refused(tmp_path, monkeypatch, capsys, tool, argv,
                                                    message):
    """The data tool always writes Parquet and the tokenizer tool a SentencePiece model: a
    name of another kind is refused with the one that fits, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    assert message in refused(tool.main, argv, capsys)
    assert list(tmp_path.iterdir()) == []


def test_make_synthetic_data_replaces_the_file_whole(tmp_path):
    out = tmp_path / "d.parquet"
    out.write_text("the last run's file")
    inode = out.stat().st_ino
    make_synthetic_data.main(["--num-prompts", "5", "--seed", "1", "--out", str(out)])
    # a new file renamed over the old one (a write into the target would keep its inode)
    assert out.stat().st_ino != inode
    assert len(read_examples(out)) == 5
    assert [p.name for p in tmp_path.iterdir()] == ["d.parquet"]  # no temporary file left


def test_train_tokenizer_refuses_a_vocabulary_too_small_for_the_corpus(tmp_path, capsys):
    least = train_tokenizer.min_vocab_size(train_tokenizer.corpus())
    out = tmp_path / "t.model"
    for size in (0, 10, least - 1):
        err = refused(train_tokenizer.main, ["--max-vocab-size", str(size), "--out", str(out)],
                      capsys)
        assert f"--max-vocab-size {size}: " in err and f"give at least {least}" in err
    assert list(tmp_path.iterdir()) == []
    err = refused(train_tokenizer.main, ["--out", str(tmp_path / "no" / "t.model")], capsys)
    assert f"--out {tmp_path}/no/t.model: folder" in err
    # the minimum itself is lossless: every character of the corpus round-trips, none unknown
    out.write_text("the last run's model")
    inode = out.stat().st_ino
    train_tokenizer.main(["--max-vocab-size", str(least), "--out", str(out)])
    assert f"vocab_size {least}," in capsys.readouterr().out
    assert out.stat().st_ino != inode and [p.name for p in tmp_path.iterdir()] == ["t.model"]
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out))
    text = "".join(train_tokenizer.corpus()) + "\n\t"
    ids = sp.encode(text)
    assert sp.unk_id() not in ids and sp.decode(ids) == text


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "--seeds 0: must be at least 1"),
    (["--seeds", "-3"], "--seeds -3: must be at least 1"),
    (["--only", ""], "--only '': an empty workload name"),
    (["--only", "small,"], "--only 'small,': an empty workload name"),
    (["--only", "nope"], "--only: unknown workload ['nope']; choose from ['corr0.8'"),
    (["--min-active-ranks", "0"], "--min-active-ranks 0: must be 1 to 4"),
])
def test_heldout_refuses_bad_arguments(capsys, argv, message):
    assert message in refused(heldout.main, argv, capsys)


REPORT = {"per_epoch": [{"epoch": 1, "static": {  # a benchmark's shape: no `unit`
    "per_rank": [{"rank": 0, "local_finish_step": 1, "release_step": 2},
                 {"rank": 1, "local_finish_step": 2, "release_step": 2}],
    "occupied_worker_steps": 4, "tail_fraction": 0.25}}]}


def test_plot_timeline_names_the_bad_report_or_the_bad_out(tmp_path, capsys):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    err = refused(plot_timeline.main, [str(listed), "--out", str(tmp_path / "t.png")], capsys)
    assert err.startswith(f"plot_timeline: {listed}: ")
    assert "not a simulate.py or bench_rollout.py report" in err
    # an empty file and one that is not JSON say so, not "Expecting value: line 1 ..."
    for name, text, says in (("empty.json", "", "is empty; give the JSON report "
                              "tools/simulate.py or tools/bench_rollout.py wrote"),
                             ("torn.json", "{bad", "is not JSON (Expecting property name")):
        (tmp_path / name).write_text(text)
        err = refused(plot_timeline.main, [str(tmp_path / name), "--out",
                                           str(tmp_path / "t.png")], capsys)
        assert err.startswith(f"plot_timeline: {tmp_path / name}: {says}"), err
        (tmp_path / name).unlink()
    report = tmp_path / "r.json"
    report.write_text(json.dumps(REPORT))
    err = refused(plot_timeline.main, [str(report), "--out", str(tmp_path / "t.xyz")], capsys)
    assert f"--out {tmp_path}/t.xyz: cannot write a .xyz image" in err and ".png" in err
    assert str(report) not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.json", "r.json"]
    # a format matplotlib writes, in any case, is taken
    for name in ("t.svg", "t.PNG"):
        assert plot_timeline.main([str(report), "--out", str(tmp_path / name)]) == 0
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("env, message", [
    ({"NPROC": "abc"}, "train_moe.sh: NPROC=abc: must be a whole number >= 1"),
    ({"NPROC": "0"}, "train_moe.sh: NPROC=0: must be"),
    ({"NPROC": "2", "STEPS": "1.5"}, "train_moe.sh: STEPS=1.5: must be a whole number >= 1"),
    ({"NPROC": "2", "STEPS": "-1"}, "train_moe.sh: STEPS=-1: must be"),
    ({"NPROC": "2", "MASTER_PORT": "65536"},
     "train_moe.sh: MASTER_PORT=65536: must be a TCP port, 1-65535 (or leave it unset"),
    ({"NPROC": "2", "MASTER_PORT": "http"}, "train_moe.sh: MASTER_PORT=http: must be a TCP port"),
])
def test_train_moe_sh_checks_its_environment(env, message):
    """Checked before the environment is set up: one line, status 2."""
    base = {k: v for k, v in os.environ.items() if k not in ("NPROC", "STEPS", "MASTER_PORT")}
    proc = subprocess.run(["bash", "examples/train_moe.sh"], cwd=REPO, capture_output=True,
                          text=True, timeout=60,
                          env={**base, "CONFIG": "examples/configs/grpo_tiny.yaml", **env})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message) and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stdout == ""


def test_a_refused_argument_prints_no_traceback():
    """The same refusals from the command line: one usage block and the error, status 2."""
    proc = subprocess.run([sys.executable, "tools/heldout.py", "--seeds", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("--seeds 0: must be at least 1 "
                                                         "(seeds 0..N-1)")


@pytest.mark.parametrize("main, argv, flag", [
    (make_synthetic_data.main, ["--num-prompts", "4", "--out", ""], "--out"),
    (heldout.main, ["--out", " "], "--out"),
    (plot_timeline.main, ["r.json", "--out", ""], "--out"),
    (simulate.main, ["--scenario", "tiny-cpu", "--out", ""], "--out"),
    (simulate.main, ["--scenario", "tiny-cpu", "--out", "s.json", "--plot", ""], "--plot"),
    (simulate.main, ["--scenario", "tiny-cpu", "--out", "s.json", "--length-file", ""],
     "--length-file"),
    (convert_checkpoint.main, ["hf-to-flexfloor", "--hf", "h", "--out", ""], "--out"),
    (convert_checkpoint.main, ["flexfloor-to-hf", "--ckpt", "", "--out", "o"], "--ckpt"),
])
def test_an_empty_path_is_refused_not_taken_as_not_given(tmp_path, monkeypatch, capsys, main,
                                                         argv, flag):
    """`--out ''` would otherwise read as no --out (no report written, a run thrown away) or as
    the current folder; it is refused by argparse naming the flag, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    err = refused(main, argv, capsys)
    assert f"argument {flag}: an empty path; give a file or folder name" in err
    assert list(tmp_path.iterdir()) == []


def test_the_converter_names_only_what_its_run_may_write(tmp_path, monkeypatch):
    """What a refused, failed, stopped (or SIGKILLed) conversion removes (`Output.partial`,
    absolute): OUT.tmp where the run makes OUT (renamed to OUT once complete, so a complete
    output is never among them); in a checkpoint root that exists, its unfinished files;
    nothing where the run's checks refuse an HF folder that exists (`--out /` among them:
    never the current folder)."""
    import types

    from flexfloor.checkpoint import iter_name

    monkeypatch.chdir(tmp_path)

    def part(direction, out, step=0):
        args = types.SimpleNamespace(direction=direction, out=out, step=step)
        return list(convert_checkpoint.Output.of(args).partial)

    assert part("flexfloor-to-hf", "new/") == [str(tmp_path / "new.tmp")]
    assert part("flexfloor-to-hf", "/") == []
    (tmp_path / "there").mkdir()
    assert part("flexfloor-to-hf", "there") == []
    assert part("hf-to-flexfloor", "ckpt") == [str(tmp_path / "ckpt.tmp")]
    assert part("hf-to-flexfloor", "there", 5) == [
        str(tmp_path / "there" / (iter_name(5) + ".tmp")), str(tmp_path / "there" / "latest.tmp"),
        str(tmp_path / "there" / "model.yaml.tmp")]


def test_simulate_prints_each_step_as_it_is_done(tmp_path, capsys):
    """A line per simulated step, before the summary table, with the step's ratios as the
    report holds them; the first step (no history) is said to be outside the summary."""
    out = tmp_path / "s.json"
    assert simulate.main(["--scenario", "paper-like", "--gpus", "8", "--num-prompts", "8",
                          "--samples-per-prompt", "2", "--epochs", "2", "--max-len", "64",
                          "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ") and " done (" in line]
    rep = json.loads(out.read_text())
    assert len(steps) == 2 and lines.index(steps[1]) < next(
        i for i, line in enumerate(lines) if "static_chunks" in line)
    for line, entry in zip(steps, rep["per_epoch"]):
        r = entry["ratios"]
        assert line.startswith(f"step {entry['epoch']}/2 done (")
        assert (f"elastic x{r['tokens_per_occupied_worker_second']:.3f} tokens per occupied "
                f"GPU-s, makespan x{r['rollout_wall_seconds']:.3f}, against static") in line
    assert steps[0].endswith("not in the summary (no length history yet)")
    assert not steps[1].endswith(")")


def test_simulate_says_when_the_pace_rule_cannot_act(tmp_path, capsys):
    """A shrink inside a replica on an accelerator with one replica (or without consolidation)
    has no estimates for the pace rule: simulate says so, and says nothing where it acts.
    Under UnitCost it says the rule never refuses a shrink."""
    small = ["--scenario", "paper-like", "--gpus", "8", "--num-prompts", "8",
             "--samples-per-prompt", "2", "--epochs", "1", "--max-len", "64",
             "--min-active-ranks", "1"]
    note = "note: the pace rule (--shrink-pace, on by default) does not act here"
    for extra, said in ((["--replicas", "1"], True), (["--replicas", "2"], False),
                        (["--replicas", "2", "--consolidate", "0"], True),
                        (["--replicas", "1", "--shrink-pace", "0"], False)):
        out = tmp_path / "s.json"
        assert simulate.main([*small, *extra, "--out", str(out)]) == 0
        assert (note in capsys.readouterr().out) == said, extra
        assert json.loads(out.read_text())["scenario"]["replicas"] == int(extra[1])
    # one replica with a floor of 8: no shrink inside at 8 GPUs, but a sweep to 16 shrinks
    # inside its one replica, where the rule cannot act: said, naming the GPU count
    out = tmp_path / "s.json"
    assert simulate.main([*small[:-1], "8", "--replicas", "1", "--sweep", "--sweep-gpus", "16",
                          "--sweep-sigmas", "0.6", "--out", str(out)]) == 0
    assert "note: the pace rule (--shrink-pace, on by default) does not act here at 16 GPUs" in (
        capsys.readouterr().out)
    # under UnitCost the rule acts but never refuses: said there only
    moot = "note: the pace rule (--shrink-pace) never refuses a shrink here: under UnitCost"
    tiny = ["--scenario", "tiny-cpu", "--num-prompts", "4", "--samples-per-prompt", "2",
            "--epochs", "1", "--max-len", "16", "--out", str(out)]
    for extra, said in (([], True), (["--shrink-pace", "0"], False),
                        (["--min-active-ranks", "4"], False)):
        assert simulate.main([*tiny, *extra]) == 0
        assert (moot in capsys.readouterr().out) == said, extra
    assert simulate.main([*small, "--replicas", "1", "--out", str(out)]) == 0
    assert moot not in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--max-batch-size", "-5"], "--max-batch-size -5: must be at least 1"),
    (["--epochs", "0"], "--epochs 0: must be at least 1"),
    (["--seed", "-1"], "--seed -1: must be at least 0"),
    (["--pace-margin", "0"], "--pace-margin 0.0: must be a positive number"),
    (["--load-cap", "nan"], "--load-cap nan: must be a positive number"),
    (["--taker-hedge", "0.5"], "--taker-hedge 0.5: must be at least 1.0"),
    (["--taker-hedge", "inf"], "--taker-hedge inf: must be at least 1.0"),
    (["--length-median", "-5"], "--length-median -5.0: must be a finite number above 0"),
    (["--length-sigma", "nan"], "--length-sigma nan: must be a finite number above 0"),
    (["--length-sigma", "0"], "--length-sigma 0.0: must be a finite number above 0"),
    (["--dataset-prompts", "1"],
     "--dataset-prompts 1: must be at least num_prompts (32), the prompts each step draws"),
    (["--cap-fraction", "1.5"], "--cap-fraction 1.5: must be in [0, 1]"),
    (["--zipf-s", "-2"], "--zipf-s -2.0: must be a number at least 0"),
    (["--group-create-s", "inf"], "--group-create-s inf: must be a number at least 0"),
    # a floor given above the replica's size is refused, where it was capped silently
    (["--min-active-ranks", "5"],
     "--min-active-ranks 5: must be 1 to 4 (a replica's ranks: 4 GPUs / 1 replica)"),
    (["--gpus", "8", "--replicas", "2", "--min-active-ranks", "9"],
     "--min-active-ranks 9: must be 1 to 4 (a replica's ranks: 8 GPUs / 2 replicas)"),
])
def test_simulate_refuses_out_of_range_values_naming_the_flag(tmp_path, capsys, argv, message):
    """Checked with the scenario, before the simulation: one line, status 2, no report."""
    out = tmp_path / "s.json"
    err = refused(simulate.main, ["--scenario", "tiny-cpu", "--out", str(out), *argv], capsys)
    assert err == f"simulate: {message}"
    assert not out.exists()


def test_a_plot_without_an_extension_is_written_and_named_as_png(tmp_path, capsys):
    """matplotlib writes `t` as `t.png`: the path printed is the file that is there."""
    report = tmp_path / "r.json"
    report.write_text(json.dumps(REPORT))
    assert plot_timeline.main([str(report), "--out", str(tmp_path / "t")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "t.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "t.png"]
    for folder in (str(tmp_path), f"{tmp_path}/sub/"):  # a folder is not given a .png
        err = refused(plot_timeline.main, [str(report), "--out", folder], capsys)
        assert err == f"plot_timeline: --out {folder}: is a folder; give the file to write"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "t.png"]


def test_a_bench_report_is_drawn_in_engine_steps(bench, tmp_path):
    """The benchmark's seconds are CPU seconds, which flatter FlexFloor (a released worker
    frees a core): its timeline, from plot_timeline.py or its own --plot, is drawn in engine
    steps, each panel ending at its mode's rollout steps, and the axis and titles say so. The
    run is the one tests/test_bench.py and tests/test_sim.py read."""
    import matplotlib

    from distributed import BENCH_TWO_REPLICAS
    from flexfloor.rollout.timeline import clock
    from tools.bench_rollout import plot_timeline as bench_plot

    report = bench.run("--nproc", "4", "--epochs", "3", "--repeats", "1",
                       *BENCH_TWO_REPLICAS).report
    modes, names, _, unit = plot_timeline.timeline_panels(report)
    assert unit == "steps" and set(modes) == {"static", "elastic"}
    last = report["per_epoch"][-1]
    for mode, rows in modes.items():
        assert max(clock(r, unit)[2] for r in rows) == last[mode]["rollout_wall_steps"]
        assert f": {last[mode]['occupied_worker_steps']:,} occupied worker-steps (" in names[mode]
        assert "worker-s," not in names[mode]
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as text, to read it back
        for draw in (lambda p: plot_timeline.plot_report(report, p),
                     lambda p: bench_plot(report, p)):
            svg = tmp_path / "t.svg"
            draw(str(svg))
            text = svg.read_text()
            assert "time from rollout start (engine steps)" in text
            assert "occupied worker-steps" in text and "worker-s," not in text


def test_plot_timeline_names_a_report_of_the_wrong_shape(tmp_path, capsys):
    cases = ({"per_epoch": [{"epoch": 1, "static": {"per_rank": 3}}]},
             {"per_epoch": [{"epoch": 1, "static": {"per_rank": [{"rank": 0}]}}]})
    for case in cases:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(case))
        err = refused(plot_timeline.main, [str(bad), "--out", str(tmp_path / "t.png")], capsys)
        assert err.startswith(f"plot_timeline: {bad}: ") and "not a simulate.py or " in err, err
    assert not (tmp_path / "t.png").exists()


def test_an_unwritable_folder_is_found_by_writing_not_by_permission_bits(tmp_path):
    """`os.access` says yes to root where no file can be made (/proc, a read-only mount): the
    check writes (and removes) a probe file, so such a folder is named before the work."""
    from flexfloor.outputs import creatable_folder, writable

    assert writable(str(tmp_path / "a.json"), "--out") == str(tmp_path / "a.json")
    assert creatable_folder(str(tmp_path / "x" / "y"), "logging.run_dir") == str(
        tmp_path / "x" / "y")
    assert list(tmp_path.iterdir()) == []  # the probe is gone, nothing made
    with pytest.raises(ValueError, match="--out /proc/a.json: folder /proc is not writable"):
        writable("/proc/a.json", "--out")
    with pytest.raises(ValueError, match="logging.run_dir /proc/x/y: folder /proc is not "
                                         "writable"):
        creatable_folder("/proc/x/y", "logging.run_dir")


def test_bench_vs_hf_refuses_more_threads_than_cores(capsys):
    from tools import bench_vs_hf

    many = (os.cpu_count() or 1) + 1
    err = refused(bench_vs_hf.parse, ["--threads", str(many)], capsys)
    assert f"--threads {many}: this machine has {os.cpu_count()} CPUs" in err


@pytest.mark.parametrize("config, index, says", [
    ("{bad", None, "config.json is not readable JSON (Expecting property name"),
    ("[1]", None, "config.json holds a JSON list, not an object"),
    ("{}", "{\"metadata\": {}}", "model.safetensors.index.json has no weight_map object"),
    ("{}", "\xff", "model.safetensors.index.json is not readable JSON"),
])
def test_a_malformed_hf_folder_is_named_not_a_traceback(tmp_path, capsys, config, index, says):
    """`convert_checkpoint` (and `bench_vs_hf --hf`) on a folder whose JSON is broken: the file
    and the fix in one line, status 1 for the converter, no output folder."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(config)
    if index is not None:
        (hf / "model.safetensors.index.json").write_bytes(index.encode("latin-1"))
    code = convert_checkpoint.main(["hf-to-flexfloor", "--hf", str(hf),
                                    "--out", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert f"[convert] error: {hf}/{says}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("tool, argv, message", [
    (simulate, ["--scenario", "tiny-cpu", "--out", "same.png", "--plot", "same.png"],
     "--out and --plot name the same file"),
    (simulate, ["--scenario", "tiny-cpu", "--out", "lengths.json", "--length-file",
                "./lengths.json"], "--length-file and --out name the same file"),
    (simulate, ["--scenario", "tiny-cpu", "--out", "s.json", "--plot", "lengths",
                "--length-file", "lengths.png"], "--length-file and --plot name the same file"),
    ("bench_rollout", ["--out", "bs.png", "--plot", "bs.png"], "--out and --plot name the same"),
    ("bench_rollout", ["--length-dist", "file", "--length-file", "lengths.json", "--out",
                       "lengths.json"], "--length-file and --out name the same file"),
])
def test_one_file_for_two_flags_is_refused_before_the_work(tmp_path, monkeypatch, capsys, tool,
                                                           argv, message):
    """A report over its own plot, or over the user's length file, is refused up front (real
    paths compared): the input is left as it was and nothing is written."""
    if tool == "bench_rollout":
        from tools import bench_rollout as tool
    monkeypatch.chdir(tmp_path)
    lengths = '{"lengths": [[[3, 4], [5, 6]]]}'
    for name in ("lengths.json", "lengths.png"):
        (tmp_path / name).write_text(lengths)
    err = refused(tool.main, argv, capsys)
    assert message in err and err.endswith("; give two paths"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lengths.json", "lengths.png"]
    assert all((tmp_path / n).read_text() == lengths for n in ("lengths.json", "lengths.png"))


def _interrupted(argv, tmp_path, ready) -> subprocess.CompletedProcess:
    """`argv` (a tool, from the repository) in a session of its own, given a terminal's Ctrl-C
    (SIGINT to its whole process group) once `ready(process, stdout line)` says so."""
    import signal

    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if ready(proc, line):
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_ctrl_c_ends_simulate_and_heldout_in_one_line(tmp_path):
    """Ctrl-C once the work runs: one line saying what was written, status 130, no traceback.
    simulate writes nothing (an earlier report stays); heldout keeps the workloads it finished
    (its --out holds those, each whole)."""
    out = tmp_path / "s.json"
    out.write_text('{"earlier": true}')
    proc = _interrupted(["tools/simulate.py", "--scenario", "paper-like", "--out", str(out)],
                        tmp_path, lambda p, line: line.startswith("simulate: paper-like"))
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "simulate: stopped by SIGINT; nothing written\n"
    assert out.read_text() == '{"earlier": true}' and os.listdir(tmp_path) == ["s.json"]
    held = tmp_path / "h.json"
    proc = _interrupted(["tools/heldout.py", "--seeds", "1", "--only", "corr0.8,small",
                         "--out", str(held)], tmp_path,
                        lambda p, line: line.startswith("corr0.8 "))
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == (f"heldout: stopped by SIGINT; only {held} (workloads corr0.8 of 2) "
                           "written\n")
    assert list(json.loads(held.read_text())) == ["corr0.8"]


def test_ctrl_c_ends_the_benchmark_and_its_workers_in_one_line(tmp_path):
    """Ctrl-C once the workers run: torchrun and every worker end with the benchmark, which
    says so in one line (no traceback of its own or theirs), status 130; the report an earlier
    run left at --out stays and nothing is left beside it."""
    import time

    import psutil

    def workers(proc):
        found = []
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "--worker" in p.cmdline() and "torch.distributed.run" not in p.cmdline():
                    found.append(p)
            except psutil.Error:
                pass
        return found

    launched = []

    def ready(proc, line):
        while len(launched) < 2 and proc.poll() is None:
            time.sleep(0.1)
            launched[:] = workers(proc)
        return True

    out = tmp_path / "b.json"
    out.write_text('{"earlier": true}')
    proc = _interrupted(["tools/bench_rollout.py", "--nproc", "2", "--epochs", "1",
                         "--modes", "static,elastic", "--out", str(out)], tmp_path, ready)
    assert len(launched) == 2, proc.stderr
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "bench_rollout: stopped by SIGINT; nothing written\n"
    _, alive = psutil.wait_procs(launched, timeout=60)
    assert not alive
    assert out.read_text() == '{"earlier": true}' and os.listdir(tmp_path) == ["b.json"]


def test_bench_reads_a_length_file_without_length_dist(tmp_path, capsys):
    """--length-file alone is --length-dist file, as in simulate.py: the file is read (here
    up to the KV check, which needs its longest length, before any launch); a flag of another
    distribution is named with the fix."""
    from tools import bench_rollout

    lengths = tmp_path / "l.json"
    lengths.write_text(json.dumps({"lengths": [[[3, 4], [5, 60]]] * 4}))
    small = ["--num-prompts", "2", "--samples-per-prompt", "2", "--out", str(tmp_path / "b.json")]
    err = refused(bench_rollout.main, ["--length-file", str(lengths), "--kv-budget-tokens", "9",
                                       *small], capsys)
    assert err.startswith("bench_rollout: --kv-budget-tokens 9 cannot hold the longest request "
                          "alone (68 tokens"), err  # 60 from the file + an 8-token prompt
    err = refused(bench_rollout.main, ["--length-file", str(lengths), "--length-dist",
                                       "lognormal", *small], capsys)
    assert err.endswith("error: --length-file does not apply to --length-dist lognormal; drop "
                        "it, or give --length-dist file")
    err = refused(bench_rollout.main, ["--length-dist", "uniform", "--length-median", "6",
                                       "--length-sigma", "1", *small], capsys)
    assert err.endswith("error: --length-median and --length-sigma do not apply to --length-dist "
                        "uniform; drop them, or give --length-dist lognormal")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.json"]


def test_a_kv_budget_too_small_names_the_given_value_and_the_least(tmp_path, capsys):
    """Under UnitCost the budget is held in whole blocks of the engine's pool: the error names
    the value given, what whole blocks keep of it and the least that holds the longest
    request (in whole blocks); that least runs."""
    out = tmp_path / "s.json"
    tiny = ["--scenario", "tiny-cpu", "--num-prompts", "4", "--samples-per-prompt", "2",
            "--epochs", "1", "--max-len", "40", "--out", str(out)]
    sim = simulate.prepare(simulate.scenario_of(simulate.parse_args(tiny)))
    longest = 8 + int(sim.lengths.max())  # tiny-cpu's prompts: up to 8 tokens
    least = -(-longest // 16) * 16
    err = refused(simulate.main, [*tiny, "--kv-budget-tokens", "10"], capsys)
    assert err == (f"simulate: --kv-budget-tokens 10: 10 tokens per rank, 0 in whole 16-token "
                   f"blocks, cannot hold the longest request ({longest} tokens: a prompt of up "
                   f"to 8 and a response of {longest - 8}); give at least {least}, or shorten "
                   "the responses")
    assert not out.exists()
    for given in (least - 1, least):  # the least passes this check (not said: the run's own)
        try:
            simulate.main([*tiny, "--kv-budget-tokens", str(given)])
        except SystemExit:
            pass
        said = "cannot hold the longest request" in capsys.readouterr().err
        assert said == (given < least), given


def test_simulate_help_explains_every_flag(capsys):
    """Every flag of `simulate.py --help` has its line of help, and a flag left to the scenario
    says so instead of "(default: None)"."""
    with pytest.raises(SystemExit):
        simulate.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: None)" not in text
    lines = text.split("options:", 1)[1].splitlines()
    bare = [line.split()[0] for i, line in enumerate(lines) if line.startswith("  -")
            and len(line.split()) <= 2 and not lines[i + 1].startswith(" " * 8)]
    assert bare == [], bare
    assert "--length-median LENGTH_MEDIAN" in text and "lognormal median" in text


def test_a_unit_cost_sweep_says_worker_steps(tmp_path, capsys):
    """Under UnitCost (tiny-cpu) the sweep's ratios are per occupied worker-step, as the
    report's unit says, not per GPU-second."""
    assert simulate.main(["--scenario", "tiny-cpu", "--epochs", "1", "--num-prompts", "8",
                          "--sweep", "--sweep-gpus", "4", "--sweep-sigmas", "0.6",
                          "--out", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "4 gpus, sigma 0.6: x" in out and "tokens per occupied worker-step (UnitCost)" in out
    assert "GPU-s" not in out and "tok/occ-step x" in out


@pytest.mark.parametrize("argv, message", [
    (["--length-median", "-5"], "bench_rollout: --length-median -5.0: must be a finite number "
     "above 0"),
    (["--length-sigma", "nan"], "bench_rollout: --length-sigma nan: must be a finite number "
     "above 0"),
    (["--length-dist", "bimodal", "--long-frac", "2"],
     "bench_rollout: --long-frac 2.0: must be in [0, 1]"),
    (["--length-dist", "uniform", "--min-len", "500"],
     "bench_rollout: --min-len 500.0: must be in [1, --max-len 200]"),
    (["--prompt-len", "8-4"], "error: --prompt-len 8-4: need 1 <= LO <= HI, e.g. 4-8"),
])
def test_bench_names_the_flag_of_a_bad_workload_value(tmp_path, capsys, argv, message):
    """A workload parameter out of range is told by its flag, as typed, before any launch."""
    from tools import bench_rollout

    err = refused(bench_rollout.main, [*argv, "--out", str(tmp_path / "b.json")], capsys)
    assert err.endswith(message), err
    assert list(tmp_path.iterdir()) == []


def test_simulate_prints_a_dash_where_no_prompt_has_history(tmp_path, capsys):
    """Step 1 has no length history: its history figures are "-", as the benchmark prints
    them, not "nan"."""
    assert simulate.main(["--scenario", "tiny-cpu", "--epochs", "1", "--num-prompts", "8",
                          "--out", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "step 1 prediction: history spearman - mae - (n 0), siblings spearman " in out
    assert "nan" not in out
