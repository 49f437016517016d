"""Result files: every command that writes a report refuses a path it cannot write before its
work starts (naming the flag and the fix), and writes strict JSON whole or not at all."""

import json

import pytest

from flexfloor.outputs import writable, write_json


def test_writable_names_the_flag_and_the_fix(tmp_path):
    assert writable(str(tmp_path / "r.json"), "--out") == str(tmp_path / "r.json")
    with pytest.raises(ValueError, match=r"--out .*: folder .*missing does not exist; create it"):
        writable(str(tmp_path / "missing" / "r.json"), "--out")
    with pytest.raises(ValueError, match=r"--plot .*: is a folder; give the file to write"):
        writable(str(tmp_path), "--plot")
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_write_json_is_strict_and_whole(tmp_path):
    path = tmp_path / "r.json"
    write_json(str(path), {"a": float("nan"), "b": [1.5, float("inf")], 3: "x"})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.5, None], "3": "x"}
    # a report that cannot be written leaves the last one as it was, and no temporary file
    with pytest.raises(TypeError):
        write_json(str(path), {"a": object()})
    assert json.loads(path.read_text())["b"] == [1.5, None]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def _exit_code(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's refusals
        return e.code


@pytest.mark.parametrize("command, argv, message", [
    ("simulate", ["--scenario", "tiny-cpu", "--out", "{missing}/s.json"],
     "--out {missing}/s.json: folder {missing} does not exist"),
    ("simulate", ["--scenario", "tiny-cpu", "--out", "{tmp}"], "is a folder"),
    ("simulate", ["--scenario", "tiny-cpu", "--out", "{tmp}/s.json", "--plot", "{missing}/p.png"],
     "--plot {missing}/p.png: folder"),
    ("simulate", ["--scenario", "tiny-cpu", "--out", "{tmp}/s.json", "--gather", "2"],
     "argument --gather: expected 0 (off) or 1 (on), got '2'"),
    ("simulate", ["--scenario", "paper-like", "--out", "{tmp}/s.json", "--gpus", "0"],
     "gpus=0: must be at least 1"),
    ("heldout", ["--only", "small", "--out", "{missing}/h.json"], "--out {missing}/h.json"),
    ("bench_vs_hf", ["--out", "{missing}/b.json"], "--out {missing}/b.json"),
    ("bench_vs_hf", ["--batch", "0"], "--batch 0: must be at least 1"),
    ("bench_vs_hf", ["--new-tokens", "1"], "--new-tokens 1: must be at least 2"),
    ("bench_rollout", ["--out", "{missing}/b.json"], "--out {missing}/b.json: folder"),
    ("bench_rollout", ["--out", "{tmp}/b.json", "--plot", "{tmp}"], "--plot {tmp}: is a folder"),
    ("plot_timeline", ["{tmp}/r.json", "--out", "{missing}/t.png"], "--out {missing}/t.png"),
])
def test_a_command_refuses_a_path_it_cannot_write_before_its_work(tmp_path, capsys, command,
                                                                  argv, message):
    import importlib

    main = importlib.import_module(f"tools.{command}").main
    fill = {"tmp": str(tmp_path), "missing": str(tmp_path / "missing")}
    assert _exit_code(main, [a.format(**fill) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert message.format(**fill) in err, err
    assert "took" not in out  # refused before the work, not after it
    assert list(tmp_path.iterdir()) == []  # nothing written
