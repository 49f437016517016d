"""Accelerator readiness on 4 real gloo workers, one launch (tests/workers/accel.py): one memory
model for fp32 and bf16; a released rank offloads its weights, gradient buffers and optimizer
state and gets them back bit for bit; training after an offloading rollout equals training after
a static one; survivor groups built ahead from the plan. Plus the pure parts, without processes."""

import json

import pytest

from distributed import Worker
from flexfloor.rollout.survivors import nearest_prebuilt, planned_survivor_sets

WORKER = Worker("accel.py", 4, timeout=400)

BUDGET_TOKENS = 48  # three whole KV blocks of the engine's default 16 tokens


@pytest.fixture(scope="module")
def parts(shared):
    return shared.run(WORKER).results


def test_memory_model_admits_the_same_tokens_in_fp32_and_bf16(parts):
    for p in parts:
        m = p["memory"]
        for dtype in ("float32", "bfloat16"):
            x = m[dtype]
            assert x["scheduler_kv_tokens"] == x["engine_kv_tokens"] == BUDGET_TOKENS
            assert x["kv_bytes_per_token"] == x["engine_kv_bytes_per_token"]
            assert x["expert_bytes"] == x["moe_expert_nbytes"]  # measured == what a borrow costs
            assert x["formula_equal"]  # the simulator's formula agrees with the built model
            assert x["verdict"][str(BUDGET_TOKENS)] == "admitted"
            assert "rollout.kv_budget_tokens" in x["verdict"][str(BUDGET_TOKENS + 1)]
        # bf16 really is half the bytes, and the plans do not change with the dtype
        assert m["bfloat16"]["kv_bytes_per_token"] * 2 == m["float32"]["kv_bytes_per_token"]
        assert m["bfloat16"]["plan"] == m["float32"]["plan"]


def test_released_ranks_hold_at_most_a_tenth_of_a_survivor(parts):
    survivor = parts[0]["offload"]
    assert not survivor["released"] and survivor["survivor_bytes_at_end"] > 0
    for rank in (1, 2, 3):
        o = parts[rank]["offload"]
        assert o["released"]
        s = o["stats"]
        assert s["resident_bytes_before_release"] > 0
        assert s["offloaded_bytes"] >= s["resident_bytes_before_release"] * 0.9
        assert s["resident_bytes_after_release"] <= 0.1 * survivor["survivor_bytes_at_end"]
        assert s["resident_bytes_after_release"] <= 0.1 * s["resident_bytes_before_release"]
        assert s["resident_bytes_after_resync"] == s["resident_bytes_before_release"]


def test_resync_restores_weights_grads_and_optimizer_bit_identically(parts):
    for p in parts:
        assert p["offload"]["start_equal"] and p["offload"]["restored_bit_identical"]


def test_training_after_an_offloading_rollout_equals_after_a_static_one(parts):
    for p in parts:
        o = p["offload"]
        assert o["tokens_static"] == o["tokens_elastic"] and o["tokens_static"]
        assert o["applied"] == [True, True] and o["trained_changed"]
        assert o["trained_equal"] and o["optimizer_equal"]


def test_the_coordinator_offloads_released_ranks_and_trains_the_same(parts):
    job = parts[0]["job"]
    assert all(p["job"]["weights_equal"] for p in parts)  # offloading step == static step
    released = [r for r in job["records"] if "offloaded_bytes" in r]
    assert released, "no rank was released in the offloading run"
    for r in released:
        assert r["resident_bytes_after_release"] <= 0.1 * r["resident_bytes_before_release"]
        assert r["resident_bytes_after_resync"] == r["resident_bytes_before_release"]


def test_a_planned_4_3_2_1_rollout_creates_no_group_after_decoding_starts(parts):
    for rank, p in enumerate(parts):
        o = p["offload"]["on_plan"]
        assert o["built_ahead"] == 3  # (0, 1, 2), (0, 1), (0,): before the first step
        assert o["groups_added"] == 0 and o["groups_created_during_rollout"] == 0
        assert o["leaving"] == [[3], [2], [1]][:len(o["leaving"])]
        assert len(o["leaving"]) == min(3, 4 - rank)  # a rank sees the shrinks until it leaves
        assert len(o["switch_s_per_shrink"]) == len(o["leaving"])
        assert p["offload"]["tokens_static"] == p["offload"]["tokens_elastic"]


def test_a_release_off_the_planned_order_uses_the_nearest_prebuilt_group(parts):
    for rank, p in enumerate(parts):
        o = p["offload"]["off_plan"]
        assert o["tokens_equal"] and o["tokens"] == 2
        # 2 and 3 done together: (0, 1) is not prebuilt, (0, 1, 2) is: only 3 leaves
        assert o["leaving"][0] == [3] and o["active"][0] == [0, 1, 2]
        if rank in (0, 1):  # then (0, 1): no prebuilt group holds it, its members make it
            assert o["leaving"] == [[3], [2], [1]]
            assert o["groups_created_during_rollout"] == 1 and o["groups_added"] == 1
        else:
            assert o["groups_created_during_rollout"] == 0 and o["groups_added"] == 0


def test_survivor_groups_built_ahead_and_looked_up(parts):
    for rank, p in enumerate(parts):
        s = p["survivors"]
        assert [tuple(x) for x in s["sets"]] == [(0, 1, 2), (0, 1), (0,)]
        assert s["made"] == 3 and s["made_again"] == 0  # reused while the shape repeats
        assert s["groups_added_on_plan"] == 0 and s["created_on_plan"] == 0
        # each rank used each group it is a member of: the sum of its members' rank + 1
        want = {(0, 1, 2): 6, (0, 1): 3, (0,): 1}
        for ranks, total, created in s["on_plan"]:
            assert not created
            assert total == (want[tuple(ranks)] if rank in ranks else None)
        assert s["off_plan_superset"] == {"leaving": [3], "ranks": [0, 1, 2], "kept": [1],
                                          "created": False}
        late = s["late"]
        if rank in (0, 2):  # last resort: made by its two members, counted
            assert late == [[0, 2], 4, True] and s["created_late"] == 1
        else:
            assert late is None and s["created_late"] == 0
        # every rank that called that switch knows the set; rank 3 (already left) learns it
        # at the next prepare: the pace rule then prices the shrink alike on every rank
        assert s["creates_late_before"] == (rank == 3)
        assert s["creates_late_after"] is False


def test_planned_survivor_sets_follow_the_predicted_finish():
    assert planned_survivor_sets({0: 40, 1: 30, 2: 20, 3: 10}) == [(0, 1, 2), (0, 1), (0,)]
    # ties: the higher rank leaves first (the release keeps the lowest idle ranks); a floor
    assert planned_survivor_sets({0: 5, 1: 9, 2: 5, 3: 0}, floor=2) == [(0, 1, 2), (0, 1)]
    assert planned_survivor_sets({0: 1}) == []


def test_nearest_prebuilt_group_is_the_smallest_superset_inside_the_active_ranks():
    built = [(0, 1, 2), (0, 1), (0,)]
    assert nearest_prebuilt((0, 1, 2, 3), (0, 2), built) == (0, 1, 2)
    assert nearest_prebuilt((0, 1, 2, 3), (0,), built) == (0,)
    assert nearest_prebuilt((0, 1, 2), (0, 2), built) is None  # only the active group itself
    assert nearest_prebuilt((0, 1, 2, 3), (1, 3), built) is None


def test_a_shrink_creates_a_group_only_where_none_built_or_made_takes_the_survivors():
    """`creates_group`, what the pace rule prices a shrink's switch by (engine and simulator):
    the survivors' set built ahead, a prebuilt superset, or a group made late earlier: none."""
    from flexfloor.rollout.survivors import creates_group

    built = {(0, 1, 2), (0, 1), (0,)}
    assert not creates_group((0, 1, 2, 3), (0, 1), built)
    assert not creates_group((3, 0, 1, 2), (2, 0), built)  # into (0, 1, 2), 1 idle; any order
    assert creates_group((0, 1, 2, 3), (1, 3), built)
    assert not creates_group((0, 1, 2, 3), (1, 3), built, late={(1, 3)})
    assert creates_group((0, 1, 2), (0, 2), built, late={(1, 3)})


def test_leavers_for_keeps_the_others_idle_in_the_nearest_prebuilt_group():
    """The engine's `SurvivorGroups.leavers_for` and the simulator's `GroupSource.PLANNED` share
    this pure rule."""
    from flexfloor.rollout.survivors import leavers_for

    built = {(0, 1, 2), (0, 1), (0,)}
    assert leavers_for((0, 1, 2, 3), [3], built) == [3]  # the plan's order: prebuilt
    assert leavers_for((0, 1, 2, 3), [1, 3], built) == [3]  # 1 waits idle in (0, 1, 2)
    assert leavers_for((0, 1, 2, 3), [0, 2], built) == [0, 2]  # none near: a new group


def test_gpu_check_compiles_and_refuses_without_a_gpu():
    import os
    import py_compile
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    py_compile.compile(os.path.join(repo, "tests", "gpu", "check.py"), doraise=True)
    assert subprocess.run(["bash", "-n", os.path.join(repo, "tests", "gpu", "run.sh")]).returncode == 0
    with open(os.path.join(repo, "tests", "gpu", "run.sh")) as f:
        assert "NCCL cannot put two ranks on one GPU" in f.read()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(repo, "tests", "gpu", "check.py")],
                          capture_output=True, text=True, env=env, timeout=120)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 1 and not summary["cuda_available"]
    assert "needs one NVIDIA GPU" in summary["error"]


def test_gpu_check_runs_every_section_on_cpu():
    """`check.py --cpu-dry-run`: every section of the GPU check on CPU with gloo, small, so a
    broken script is caught here and not on borrowed device time (its speed figures mean
    nothing on CPU; its identities do)."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="0", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, os.path.join(repo, "tests", "gpu", "check.py"),
                           "--cpu-dry-run"], capture_output=True, text=True, env=env,
                          timeout=300)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and summary["ok"] and summary["cpu_dry_run"], proc.stderr[-3000:]
    sections = ("rollout", "grpo_bf16", "decode", "offload", "static_decode")
    assert all(summary[s]["ok"] for s in sections), {s: summary[s].get("error") for s in sections}
    assert summary["rollout"]["identical_static_elastic"]
    assert summary["grpo_bf16"]["applied"] and summary["grpo_bf16"]["params_changed"] > 0
    assert all(r["identical_responses"] == r["responses"] for r in summary["decode"]["runs"])
    offload = summary["offload"]
    assert offload["bit_identical_after_resync"] and offload["memory_allocated_after_release"] == 0
    assert summary["static_decode"]["all_identical"]
    assert summary["static_decode"]["one_op_sequence_per_bucket"]


COLLECTIVES = {"all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce",
               "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "isend",
               "irecv", "batch_isend_irecv", "send", "recv", "reduce_scatter",
               "reduce_scatter_tensor", "barrier", "gather", "scatter", "gather_object",
               "scatter_object_list", "reduce"}


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """(line, name) of every use of a torch.distributed collective or p2p call in `source`,
    whatever it was imported as (`import torch.distributed as dist`, `from torch import
    distributed`, `torch.distributed.x`, `from torch.distributed import x`)."""
    import ast

    tree = ast.parse(source)
    modules, names = set(), {}  # aliases of torch.distributed; local name -> collective
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d") \
                        and a.name in COLLECTIVES:
                    names[a.asname or a.name] = a.name

    def is_dist(node) -> bool:
        if isinstance(node, ast.Name):
            return node.id in modules
        return (isinstance(node, ast.Attribute) and node.attr in ("distributed", "distributed_c10d")
                and (isinstance(node.value, ast.Name) and node.value.id == "torch" or is_dist(node.value)))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and is_dist(node.value):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, names[node.id]))
    return sorted(found)


def test_only_the_collectives_module_calls_torch_distributed_collectives_in_the_rollout_path():
    import glob
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sorted(glob.glob(os.path.join(repo, "flexfloor", "rollout", "*.py"))
                   + glob.glob(os.path.join(repo, "megatron_ext", "*.py")))
    assert len(paths) > 10
    offenders = {}
    for path in paths:
        rel = os.path.relpath(path, repo)
        with open(path) as f:
            found = direct_collectives(f.read())
        if rel == os.path.join("flexfloor", "rollout", "collectives.py"):
            assert found, "the scan finds nothing even in the collectives module itself"
        elif found:
            offenders[rel] = found
    assert not offenders, (f"direct torch.distributed collectives outside "
                           f"flexfloor/rollout/collectives.py (route them through it): {offenders}")


def test_the_collective_scan_sees_every_spelling():
    src = ("import torch\nimport torch.distributed as d\nfrom torch import distributed\n"
           "from torch.distributed import all_reduce as ar\n"
           "d.all_reduce(x)\ntorch.distributed.barrier()\ndistributed.isend(x, 1)\nar(x)\n"
           "d.P2POp(d.irecv, x, 0)\nd.new_group([0])\nd.get_rank()\n")
    assert direct_collectives(src) == [(5, "all_reduce"), (6, "barrier"), (7, "isend"),
                                       (8, "all_reduce"), (9, "irecv")]
