"""No silent hang: a stalled peer becomes an error naming the rank, the phase and the step."""

import os

from distributed import run_worker


def test_stalled_peer_fails_the_others_with_rank_phase_and_step(tmp_path):
    run = run_worker("hang.py", 3, tmp_path, check=False, timeout=240)
    assert run.proc.returncode != 0
    for rank in (0, 2):
        path = os.path.join(tmp_path, f"rank{rank}.txt")
        assert os.path.exists(path), f"rank {rank} never reached the rollout:\n{run.proc.stderr[-4000:]}"
        with open(path) as f:
            stall_ended, message = f.read().split("\n", 1)
        assert f"rank {rank}, phase 'step boundary (release)', engine step 3" in message
        assert stall_ended == "False"  # the 4 s timeout fired before the 15 s stall ended
