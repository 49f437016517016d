"""Greedy tokens of FlexFloor's rollout engine equal those of Megatron-Core's own legacy
`StaticInferenceEngine` (a peer implementation with its own KV cache, attention path and sampling
loop) on the same model. One worker (world 1, EP=1, in the session's 1-worker launch) shared by
the module; see tests/workers/megatron_reference.py."""


import pytest

from distributed import Worker

NEW_TOKENS = 16
CASES = ["tiny_float32", "tiny_float64", "sharp_float32", "sharp_float64"]
WORKER = Worker("megatron_reference.py", 1, timeout=300)


@pytest.fixture(scope="module")
def out(shared):
    run = shared.run(WORKER)
    return lambda name: run.load(f"{name}.json")


@pytest.mark.parametrize("case", CASES)
def test_megatron_ran_its_kv_cache_path_to_full_length(out, case):
    r = out(case)
    prompts = r["prompts"]
    batch = r["megatron_batch"]
    assert batch["prompt_tokens"] == prompts  # the tokenizer round trip
    assert batch["status"] == ["COMPLETED"] * len(prompts)
    assert batch["lengths"] == [NEW_TOKENS] * len(prompts)  # no early stop
    # Megatron's static KV cache: one (K, V) buffer pair per layer, [max_seq, batch, groups, dim],
    # left in decode mode at the last position the batch reached
    assert sorted(batch["kv_cache"]) == [str(i + 1) for i in range(r["num_layers"])]
    for k, v in batch["kv_cache"].values():
        assert k[:2] == v[:2] == [r["max_seq_len"], len(prompts)]
    assert batch["decode_mode"] is True
    assert batch["sequence_len_offset"] == max(map(len, prompts)) + NEW_TOKENS - 1
    for p, single in zip(prompts, r["megatron_single"]):
        assert single["lengths"] == [NEW_TOKENS] and single["decode_mode"] is True
        assert single["sequence_len_offset"] == len(p) + NEW_TOKENS - 1


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_identical_to_megatron_static_engine(out, case):
    r = out(case)
    ours = r["flexfloor_batch"]["tokens"]
    theirs = r["megatron_batch"]["tokens"]
    assert len(ours) == len(theirs) == len(r["prompts"])
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == len(b) == NEW_TOKENS
        assert a == b, f"prompt {i} (len {len(r['prompts'][i])}): flexfloor {a} megatron {b}"
    # Megatron one request at a time (no batch padding, prefill of the whole prompt)
    assert [s["tokens"][0] for s in r["megatron_single"]] == ours


@pytest.mark.parametrize("case", CASES)
def test_logprobs_match_megatron(out, case):
    """Megatron returns the log-probs in float32 (its `log_softmax(...).to(torch.float32)`), ours
    are float64 from the model's logits: float64 models agree up to that one rounding."""
    r = out(case)
    ours = r["flexfloor_batch"]["logprobs"]
    theirs = r["megatron_batch"]["logprobs"]
    float64 = r["dtype"] == "torch.float64"
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == len(b) == NEW_TOKENS
        for t, (x, y) in enumerate(zip(a, b)):
            tol = 2.0**-23 * abs(y) + 1e-10 if float64 else 1e-5
            assert abs(x - y) <= tol, f"prompt {i} token {t}: flexfloor {x} megatron {y}"


@pytest.mark.parametrize("case", CASES)
def test_compared_continuations_are_not_trivial(out, case):
    r = out(case)
    tokens = r["megatron_batch"]["tokens"]
    # different prompts lead to different continuations (the tiny preset's random weights have
    # an attractor two prompts can fall into; most prompts still differ)
    assert len({tuple(t) for t in tokens}) >= len(tokens) - 2
    assert all(len(set(t)) > 1 for t in tokens)  # no continuation is one token repeated
    assert len({t for seq in tokens for t in seq}) >= NEW_TOKENS
    # the two weight scales give different models
    if case.startswith("sharp"):
        assert tokens != out(case.replace("sharp", "tiny"))["megatron_batch"]["tokens"]
