"""Atomic saves: a worker killed in the middle of a save leaves the previous checkpoint intact."""

import os

from distributed import Worker, run_worker

WORKER = Worker("reshard.py", 2, timeout=400)  # in the session's 2-worker launch


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    crashed = run_worker("ckpt_crash.py", 2, root, "crash", check=False, timeout=300)
    assert crashed.proc.returncode != 0
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002.tmp", "latest"]
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "iter_0000001"
    # the half-written step 2 holds shards but no manifest: never loaded
    assert any(n.endswith(".distcp") for n in os.listdir(os.path.join(root, "iter_0000002.tmp")))
    assert not os.path.exists(os.path.join(root, "iter_0000002.tmp", "flexfloor.json"))

    seen = run_worker("ckpt_crash.py", 2, root, "resume", timeout=300).load("seen.json")
    assert seen["step"] == 1 and seen["marker"] == 1
    # the weights were moved before the load; the load brought back step 1's, not a mix with
    # step 2's
    assert seen["moved_before_load"] is True and seen["same_as_init"] is True
    assert seen["saved"] == "iter_0000002"
    assert "iter_0000002.tmp" not in seen["dirs"]  # the leftover was cleared by the next save


def test_resume_at_another_worker_count_and_build_after_destroy(shared):
    """A run saved on 1 worker resumes on 2 and back (model and optimizer, every entry equal
    after the load), and Parallel builds again after destroy() in one process at EP=2
    (tests/workers/reshard.py, in the session's 2-worker launch)."""
    res = shared.run(WORKER).results
    assert res["b_loaded_step"] == 1 and res["b_ep_size"] == 2 and res["c_loaded_step"] == 2
    for case in ("one_to_two", "two_to_one"):  # saved again right after the load: same entries
        assert res[case]["differ"] == [], (case, res[case]["differ"][:10])
        assert res[case]["optimizer_tensors"] >= 20 and res[case]["model_tensors"] >= 10
    # the step trained at 2 workers moved the weights and the optimizer's moments, experts too
    moved = set(res["trained"]["differ"])
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in moved
    assert "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight" in moved
    assert res["b2"] == {**res["b2"], "ep_size": 2, "all_reduce": 2.0}
