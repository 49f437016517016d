"""Atomic saves: a worker killed in the middle of a save leaves the previous checkpoint intact."""

import json
import os

from distributed import torchrun


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    crashed = torchrun("ckpt_crash.py", 2, root, "crash", check=False, timeout=300)
    assert crashed.returncode != 0
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002.tmp", "latest"]
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "iter_0000001"
    # the half-written step 2 holds shards but no manifest: never loaded
    assert any(n.endswith(".distcp") for n in os.listdir(os.path.join(root, "iter_0000002.tmp")))
    assert not os.path.exists(os.path.join(root, "iter_0000002.tmp", "flexfloor.json"))

    torchrun("ckpt_crash.py", 2, root, "resume", timeout=300)
    with open(os.path.join(root, "seen.json")) as f:
        seen = json.load(f)
    assert seen["step"] == 1 and seen["marker"] == 1
    assert seen["same_as_init"] is True  # step 1's weights, not a mix with step 2's
    assert seen["saved"] == "iter_0000002"
    assert "iter_0000002.tmp" not in seen["dirs"]  # the leftover was cleared by the next save
