"""Result files: every command that writes a report refuses a path it cannot write before its
work starts (naming the flag and the fix), and writes strict JSON whole or not at all."""

import json

import pytest

from flexfloor.outputs import writable, writable_folder, write_json


def test_writable_names_the_flag_and_the_fix(tmp_path):
    assert writable(str(tmp_path / "r.json"), "--out") == str(tmp_path / "r.json")
    with pytest.raises(ValueError, match=r"--out .*: folder .*missing does not exist; create it"):
        writable(str(tmp_path / "missing" / "r.json"), "--out")
    with pytest.raises(ValueError, match=r"--plot .*: is a folder; give the file to write"):
        writable(str(tmp_path), "--plot")
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_writable_folder_takes_a_folder_there_or_one_to_make(tmp_path):
    (tmp_path / "file").write_text("x")
    assert writable_folder(str(tmp_path), "--out") == str(tmp_path)  # there already
    assert writable_folder(str(tmp_path / "new"), "--out") == str(tmp_path / "new")
    with pytest.raises(ValueError, match=r"--out .*file: is a file; give a folder"):
        writable_folder(str(tmp_path / "file"), "--out")
    with pytest.raises(ValueError, match=r"--out .*file/new: .*file is not a folder"):
        writable_folder(str(tmp_path / "file" / "new"), "--out")
    with pytest.raises(ValueError, match=r"--out .*: folder .*missing does not exist; create it"):
        writable_folder(str(tmp_path / "missing" / "new"), "--out")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # nothing created


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


def test_bench_vs_hf_names_a_folder_it_cannot_read(tmp_path, capsys):
    from tools.bench_vs_hf import main

    (tmp_path / "config.json").write_text('{"model_type": "olmoe"}')
    (tmp_path / "model.safetensors").write_text("not safetensors")
    assert _exit_code(main, ["--hf", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--hf {tmp_path}: {tmp_path}/model.safetensors is not a readable safetensors" in err
    from safetensors.torch import save_file
    import torch

    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert _exit_code(main, ["--hf", str(tmp_path)]) == 2
    assert "model_type 'llama' is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("command, argv, message", [
    ("simulate", ["--scenario", "tiny-cpu", "--out", "{missing}/s.json"],
     "--out {missing}/s.json: folder {missing} does not exist"),
    ("simulate", ["--scenario", "tiny-cpu", "--out", "{tmp}"], "is a folder"),
    ("simulate", ["--scenario", "tiny-cpu", "--out", "{tmp}/s.json", "--plot", "{missing}/p.png"],
     "--plot {missing}/p.png: folder"),
    ("simulate", ["--scenario", "tiny-cpu", "--out", "{tmp}/s.json", "--gather", "2"],
     "argument --gather: expected 0 (off) or 1 (on), got '2'"),
    ("simulate", ["--scenario", "paper-like", "--out", "{tmp}/s.json", "--gpus", "0"],
     "--gpus 0: must be at least 1"),
    ("heldout", ["--only", "small", "--out", "{missing}/h.json"], "--out {missing}/h.json"),
    ("bench_vs_hf", ["--out", "{missing}/b.json"], "--out {missing}/b.json"),
    ("bench_vs_hf", ["--batch", "0"], "--batch 0: must be at least 1"),
    ("bench_vs_hf", ["--new-tokens", "1"], "--new-tokens 1: must be at least 2"),
    # a local folder only: a missing one is not looked up on the Hub
    ("bench_vs_hf", ["--hf", "{missing}"],
     "--hf {missing}: {missing} is not a Hugging Face model folder (no config.json)"),
    ("bench_vs_hf", ["--hf", "{missing}", "--family", "olmoe"], "with --hf the folder's config"),
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
