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
from tools import heldout, make_synthetic_data, plot_timeline, train_tokenizer

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
])
def test_heldout_refuses_bad_arguments(capsys, argv, message):
    assert message in refused(heldout.main, argv, capsys)


REPORT = {"per_epoch": [{"epoch": 1, "static": {
    "per_rank": [{"rank": 0, "local_finish_s": 1.0, "release_s": 2.0},
                 {"rank": 1, "local_finish_s": 2.0, "release_s": 2.0}],
    "occupied_worker_seconds": 4.0, "tail_fraction": 0.25}}]}


def test_plot_timeline_names_the_bad_report_or_the_bad_out(tmp_path, capsys):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    err = refused(plot_timeline.main, [str(listed), "--out", str(tmp_path / "t.png")], capsys)
    assert err.startswith(f"plot_timeline: {listed}: ")
    assert "not a simulate.py or bench_rollout.py report" in err
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
])
def test_train_moe_sh_checks_nproc_and_steps(env, message):
    """Checked before the environment is set up: one line, status 2."""
    base = {k: v for k, v in os.environ.items() if k not in ("NPROC", "STEPS")}
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
