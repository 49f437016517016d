"""Prompts, rewards and tokenizers: no megatron, no torch."""

from __future__ import annotations

import importlib.util
import sys
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flexfloor.data import (
    SYNTHETIC_DATA_SOURCE,
    Example,
    compute_score,
    Scorer,
    load_prompts,
    make_synthetic_prompts,
    read_examples,
    register_reward,
    registered_rewards,
    sft_response,
    write_examples,
)
from flexfloor.tokenizer import BUNDLED_TOKENIZER, check_vocab, load_tokenizer, render_chat

REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[int], q: float) -> float:
    """Linear interpolation, as numpy's default."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# --- synthetic task ---------------------------------------------------------------------------

def test_synthetic_format_and_uids():
    examples = make_synthetic_prompts(64, seed=3)
    assert [e.uid for e in examples] == list(range(64))
    assert all(e.data_source == SYNTHETIC_DATA_SOURCE for e in examples)
    example = Example(uid=7, prompt="[a3b5c2d7]", ground_truth="3807",
                      data_source=SYNTHETIC_DATA_SOURCE)
    assert sft_response(example) == "a3b8c0d7=7"
    for e in examples:
        response = sft_response(e)
        assert response[1:-2:2] == e.ground_truth  # the running sums, step by step
        assert response.endswith("=" + e.ground_truth[-1])
        assert len(response) == 2 * len(e.ground_truth) + 2


def test_synthetic_same_seed_same_prompts():
    assert make_synthetic_prompts(256, seed=11) == make_synthetic_prompts(256, seed=11)
    assert make_synthetic_prompts(256, seed=11) != make_synthetic_prompts(256, seed=12)
    # A longer data set starts with the shorter one: a prompt's uid and length do not depend on N.
    assert make_synthetic_prompts(300, seed=11)[:256] == make_synthetic_prompts(256, seed=11)


def test_synthetic_response_lengths_long_tailed():
    tokenizer = load_tokenizer(None)
    examples = make_synthetic_prompts(512, seed=0)
    prompt_lengths = [len(tokenizer.encode(e.prompt)) for e in examples]
    response_lengths = [len(tokenizer.encode(sft_response(e))) for e in examples]
    assert percentile(response_lengths, 99) / percentile(response_lengths, 50) >= 6
    # BOS + prompt + response + EOS fits the tiny model's 256-token context.
    assert max(p + r for p, r in zip(prompt_lengths, response_lengths)) + 2 <= 256


def test_sft_response_rejects_foreign_prompt():
    with pytest.raises(ValueError, match="not a synthetic/running_sum prompt"):
        sft_response(Example(uid=0, prompt="What is 2+2?", ground_truth="4",
                             data_source=SYNTHETIC_DATA_SOURCE))
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        make_synthetic_prompts(0, seed=0)


# --- reward -----------------------------------------------------------------------------------

@pytest.mark.parametrize("response, score", [
    ("a3b8c0d7=7", 1.0),             # right
    (" a3b8c0d7=7\n", 1.0),          # surrounding whitespace is fine
    ("a3b8c0d7", 0.5),               # every step right, no final answer
    ("a3b8c1d7=5", 0.5 * 3 / 4),     # one step and the final answer wrong
    ("a3b8c0d7e1=1", 0.5 * 4 / 5),   # a step too many
    ("a3b8c1d7=7", 1.0),             # final answer right with all steps shown
    ("a3b8=7", 0.5 * 2 / 4),         # right final answer, steps missing
    ("=7", 0.0),                     # answer without work
    ("a1b1c1d1=1", 0.0),             # wrong
    ("", 0.0),
    ("hello world", 0.0),            # garbage
    ("b3c8d0e7=7", 0.0),             # wrong labels
    ("a3b8c0d7=7=7", 0.5),           # trailing junk: no final answer
])
def test_reward_known_answers(response, score):
    assert compute_score(SYNTHETIC_DATA_SOURCE, response, "3807") == pytest.approx(score)


def test_reward_of_sft_responses_is_full():
    examples = make_synthetic_prompts(512, seed=5)
    assert all(compute_score(e.data_source, sft_response(e), e.ground_truth) == 1.0
               for e in examples)
    # A wrong first step and a wrong final answer cost the full credit.
    for e in examples:
        response = sft_response(e)
        wrong = response[:1] + str((int(response[1]) + 1) % 10) + response[2:-1] \
            + str((int(response[-1]) + 1) % 10)
        assert compute_score(e.data_source, wrong, e.ground_truth) < 0.5


def test_reward_registry():
    @register_reward("test/exact_match")
    def exact(response: str, ground_truth: str) -> float:
        return float(response.strip() == ground_truth)

    assert "test/exact_match" in registered_rewards()
    assert compute_score("test/exact_match", " 42 ", "42") == 1.0
    assert compute_score("test/exact_match", "41", "42") == 0.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test/exact_match")(exact)
    with pytest.raises(KeyError) as error:
        compute_score("my/unregistered", "42", "42")
    assert "my/unregistered" in str(error.value) and SYNTHETIC_DATA_SOURCE in str(error.value)
    with pytest.raises(ValueError, match="ground_truth must be"):
        compute_score(SYNTHETIC_DATA_SOURCE, "a3=3", "three")


# --- parquet ----------------------------------------------------------------------------------

def test_parquet_round_trip(tmp_path):
    examples = make_synthetic_prompts(200, seed=1)
    path = tmp_path / "train.parquet"
    write_examples(examples, path)
    assert read_examples(path) == examples
    rows = pq.read_table(path).to_pylist()
    assert rows[3] == {
        "data_source": SYNTHETIC_DATA_SOURCE,
        "prompt": [{"role": "user", "content": examples[3].prompt}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": examples[3].ground_truth},
        "extra_info": {"index": 3, "split": "train"},
    }


def write_rows(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


def verl_row(index: int, messages: list[dict], ground_truth="4", data_source="test/exact") -> dict:
    return {"data_source": data_source, "prompt": messages, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"index": index, "split": "train"}}


def test_read_multi_turn_and_numeric_ground_truth(tmp_path):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"}]
    path = write_rows(tmp_path / "chat.parquet", [verl_row(10, messages, ground_truth=4)])
    [example] = read_examples(path)
    assert example == Example(uid=10, prompt="system: Be brief.\nuser: What is 2+2?\nassistant:",
                              ground_truth="4", data_source="test/exact")


def test_read_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        read_examples(tmp_path / "nope.parquet")


def test_read_missing_columns(tmp_path):
    path = write_rows(tmp_path / "bad.parquet", [
        {"data_source": "x", "prompt": [{"role": "user", "content": "hi"}], "ability": "a"}])
    with pytest.raises(ValueError) as error:
        read_examples(path)
    message = str(error.value)
    assert "['reward_model', 'extra_info']" in message
    assert "['data_source', 'prompt', 'reward_model', 'extra_info']" in message


def test_read_missing_nested_field(tmp_path):
    row = verl_row(0, [{"role": "user", "content": "hi"}])
    row["extra_info"] = {"split": "train"}
    with pytest.raises(ValueError, match=r"row 0: extra_info.index is missing"):
        read_examples(write_rows(tmp_path / "bad.parquet", [row]))


def test_read_empty_data_set(tmp_path):
    path = tmp_path / "empty.parquet"
    write_examples([], path)
    with pytest.raises(ValueError, match="empty.parquet has 0 rows"):
        read_examples(path)


def test_read_duplicate_index(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    path = write_rows(tmp_path / "dup.parquet", [verl_row(5, messages), verl_row(6, messages),
                                                 verl_row(5, messages)])
    with pytest.raises(ValueError, match=r"duplicate extra_info.index \[5\]"):
        read_examples(path)
    with pytest.raises(ValueError, match="duplicate extra_info.index"):
        write_examples([Example(1, "a", "b", "c"), Example(1, "d", "e", "c")],
                       tmp_path / "dup_out.parquet")


def test_load_prompts(tmp_path):
    assert load_prompts([], synthetic_num_prompts=32, synthetic_seed=4) == \
        make_synthetic_prompts(32, seed=4)
    examples = make_synthetic_prompts(40, seed=2)
    first, second = tmp_path / "first.parquet", tmp_path / "second.parquet"
    write_examples(examples[:25], first)
    write_examples(examples[25:], second)
    assert load_prompts([str(first), str(second)], 0, 0) == examples
    with pytest.raises(ValueError, match="appears in both"):
        load_prompts([str(first), str(first)], 0, 0)
    unknown = write_rows(tmp_path / "unknown.parquet",
                         [verl_row(0, [{"role": "user", "content": "hi"}], data_source="my/task")])
    with pytest.raises(KeyError, match="my/task"):
        Scorer().check(e.data_source for e in load_prompts([str(unknown)], 0, 0))


# --- tokenizer --------------------------------------------------------------------------------

def test_bundled_tokenizer_round_trip():
    tokenizer = load_tokenizer(None)
    assert tokenizer.vocab_size <= 128
    assert len({tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id}) == 3
    texts = [e.prompt + sft_response(e) for e in make_synthetic_prompts(64, seed=9)]
    texts += ["user: Hi  there!\n\tassistant: {x} = 42 ~ ok", " leading and trailing "]
    for text in texts:
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
    # One character per token on the task, and prompt + response tokenize as their concatenation.
    prompt, response = "[a3b5c2d7]", "a3b8c0d7=7"
    assert len(tokenizer.encode(prompt)) == len(prompt)
    assert tokenizer.encode(prompt) + tokenizer.encode(response) == \
        tokenizer.encode(prompt + response)
    assert tokenizer.decode(tokenizer.encode(response) + [tokenizer.eos_id]) == response


def test_bundled_tokenizer_is_what_the_tool_trains():
    import sentencepiece

    spec = importlib.util.spec_from_file_location("train_tokenizer",
                                                  REPO / "tools" / "train_tokenizer.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    trained = sentencepiece.SentencePieceProcessor(model_proto=tool.train(128))
    shipped = sentencepiece.SentencePieceProcessor(model_file=str(BUNDLED_TOKENIZER))
    assert [trained.id_to_piece(i) for i in range(trained.get_piece_size())] == \
        [shipped.id_to_piece(i) for i in range(shipped.get_piece_size())]


def test_check_vocab():
    tokenizer = load_tokenizer(None)
    check_vocab(tokenizer, 128)
    check_vocab(tokenizer, tokenizer.vocab_size)
    with pytest.raises(ValueError) as error:
        check_vocab(tokenizer, 64)
    assert f"tokenizer vocab_size {tokenizer.vocab_size}" in str(error.value)
    assert "model's vocab_size 64" in str(error.value)
    assert f"at least {tokenizer.vocab_size}" in str(error.value)


def test_load_tokenizer_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.model"):
        load_tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(ValueError, match="cannot tell the tokenizer type"):
        load_tokenizer(str(tmp_path / "vocab.txt"))


def test_chat_template():
    tokenizer = load_tokenizer(None)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "[a1]"}]) == "[a1]"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered == "system: S\nuser: U\nassistant: A\nuser: V\nassistant:"
    assert render_chat([{"role": "user", "content": rendered}]) == rendered
    with pytest.raises(ValueError, match="at least one message"):
        render_chat([])
    with pytest.raises(ValueError, match="message 0"):
        render_chat([{"role": "user"}])


def test_hf_tokenizer_json(tmp_path):
    import tokenizers  # a requirement: a missing install fails here, not skips
    words = ["<pad>", "<s>", "</s>", "[UNK]", "the", "sum", "is", "7", "3", "+", "4", "="]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = tokenizers.decoders.WordPiece()  # joins words with single spaces
    tokenizer.add_special_tokens(["<pad>", "<s>", "</s>"])
    model_dir = tmp_path / "hf_model"
    model_dir.mkdir()
    tokenizer.save(str(model_dir / "tokenizer.json"))

    for path in (model_dir / "tokenizer.json", model_dir):
        loaded = load_tokenizer(str(path))
        assert (loaded.vocab_size, loaded.pad_id, loaded.bos_id, loaded.eos_id) == (12, 0, 1, 2)
        ids = loaded.encode("the sum 3 + 4 is 7")
        assert ids == [4, 5, 8, 9, 10, 6, 7]
        assert loaded.decode(ids + [loaded.eos_id]) == "the sum 3 + 4 is 7"
        assert loaded.apply_chat_template([{"role": "user", "content": "3 + 4"}]) == "3 + 4"

    # A tokenizer_config.json beside it names the special tokens (Qwen: no BOS, EOS <|im_end|>).
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": {"content": "="}, "pad_token": "</s>"}))
    loaded = load_tokenizer(str(model_dir))
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (None, 11, 2)
    with pytest.raises(ValueError, match="does not fit"):
        check_vocab(loaded, 8)


def test_hf_tokenizer_without_the_package(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now fails
    with pytest.raises(ImportError, match="pip install tokenizers"):
        load_tokenizer(str(path))


# --- data cursor ------------------------------------------------------------------------------

def test_cursor_never_repeats_a_prompt_in_a_step_across_epochs_and_resumes_exactly():
    from flexfloor.data.cursor import DataCursor

    # 10 prompts, 4 per step: steps 3 and 8 straddle an epoch end (prompts 10 and 30). With
    # seed 0 the next epoch's order begins with a prompt of the previous epoch's end both times:
    # the plain "fill the step from the next epoch" cursor would serve it twice in one step.
    n, per_step, seed = 10, 4, 0
    run = DataCursor(n, seed, shuffle=True)
    assert set(run.order(0)[8:]) & set(run.order(1)[:2])  # the cases that used to repeat
    assert set(run.order(2)[8:]) & set(run.order(3)[:2])
    steps = [run.next(per_step) for _ in range(8)]
    for step in steps:
        assert len(set(step)) == per_step, step
    served = [i for step in steps for i in step]
    # every prompt exactly once per epoch (a deferred prompt is served early in the next step)
    assert sorted(served[:10]) == list(range(n))
    assert sorted(served[10:20]) == list(range(n))
    assert sorted(served[20:30]) == list(range(n))
    # resume after step 3 (a deferral pending) continues the same stream
    again = DataCursor(n, seed, shuffle=True)
    for _ in range(3):
        again.next(per_step)
    state = again.state_dict()
    assert state["epoch"] == 1 and state["deferred"]
    resumed = DataCursor(n, seed, shuffle=True)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint holds it
    assert [resumed.next(per_step) for _ in range(5)] == steps[3:]
    with pytest.raises(ValueError, match="trainer.prompts_per_step=11"):
        DataCursor(n, seed, shuffle=True).check(11)


def test_cursor_in_order_without_shuffle():
    from flexfloor.data.cursor import DataCursor

    c = DataCursor(5, 0, shuffle=False)
    assert [c.next(2) for _ in range(4)] == [[0, 1], [2, 3], [4, 0], [1, 2]]


# --- validation split, custom reward ------------------------------------------------------------

def test_held_out_synthetic_split_is_never_a_training_prompt(tmp_path):
    from flexfloor.config import DataConfig
    from flexfloor.data import load_data

    data = load_data(DataConfig(synthetic_num_prompts=64, val_size=32))
    assert data.train == make_synthetic_prompts(64, 0)  # the same training prompts as without it
    assert len(data.val) == 32
    assert not {e.prompt for e in data.train} & {e.prompt for e in data.val}
    assert not {e.uid for e in data.train} & {e.uid for e in data.val}
    assert len({e.prompt for e in data.val}) == 32
    # the raw generator does repeat short training prompts: the split had to drop some
    pool = make_synthetic_prompts(64 + 32, 0)[64:]
    assert {e.prompt for e in pool} & {e.prompt for e in data.train}
    # val_files: prompts that are training prompts are dropped, with a note
    val = make_synthetic_prompts(80, 0)[60:]  # 4 of them are training prompts (uids 60..63)
    path = tmp_path / "val.parquet"
    write_examples(val, path)
    files = load_data(DataConfig(val_files=[str(path)]))
    assert not {e.prompt for e in files.train} & {e.prompt for e in files.val}
    assert 60 not in {e.uid for e in files.val} and "repeat a training prompt" in files.note


def test_main_job_validates_on_its_whole_held_out_split():
    """The main job's config: every one of its data.val_size prompts is held out (none dropped
    for lack of candidates), and none is a training prompt."""
    from flexfloor.config import load_config
    from flexfloor.data import load_data

    cfg = load_config(str(REPO / "examples" / "configs" / "grpo_tiny.yaml"), []).data
    data = load_data(cfg)
    assert len(data.train) == cfg.synthetic_num_prompts and len(data.val) == cfg.val_size >= 256
    assert not {e.prompt for e in data.train} & {e.prompt for e in data.val}


def test_custom_reward_fn_from_a_file_and_errors_naming_file_and_function(tmp_path):
    fn = tmp_path / "my_reward.py"
    fn.write_text(
        "calls = []\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    calls.append((data_source, solution_str, ground_truth, extra_info))\n"
        "    return 1.0 if solution_str.strip() == ground_truth else 0.0\n")
    scorer = Scorer(f"{fn}:compute_score")
    scorer.check(["anything/at_all"])  # a custom function scores every data_source
    ex = Example(uid=7, prompt="2+2?", ground_truth="4", data_source="my/task")
    assert scorer(ex, " 4 ") == 1.0 and scorer(ex, "5") == 0.0
    assert scorer.custom.__module__ and scorer.custom.__globals__["calls"][0] == \
        ("my/task", " 4 ", "4", {"index": 7})
    with pytest.raises(AttributeError) as e:
        Scorer(f"{fn}:score")
    assert str(fn) in str(e.value) and "'score'" in str(e.value) and "compute_score" in str(e.value)
    with pytest.raises(FileNotFoundError, match="missing.py"):
        Scorer(f"{tmp_path}/missing.py:compute_score")


# --- real tasks: reasoning-gym, \\boxed{} math ----------------------------------------------------

def test_reasoning_gym_source_round_trips_through_parquet_and_scores_with_its_own_scorer(tmp_path):
    from flexfloor.config import DataConfig, DataSource
    from flexfloor.data import load_data

    data = load_data(DataConfig(source=DataSource.REASONING_GYM, task="basic_arithmetic",
                                size=12, val_size=4, synthetic_seed=5))
    assert len(data.train) == 12 and len(data.val) == 4
    assert not {e.prompt for e in data.train} & {e.prompt for e in data.val}
    assert all(e.data_source == "reasoning_gym/basic_arithmetic" for e in data.train)
    path = tmp_path / "rg.parquet"
    write_examples(data.train, path)
    back = read_examples(path)
    assert back == data.train
    scorer = Scorer()
    scorer.check(e.data_source for e in back)
    e = back[0]
    assert e.prompt.startswith("Calculate") and scorer(e, e.ground_truth) == 1.0
    assert scorer(e, sft_response(e)) == 1.0  # the warm start teaches the answer
    assert scorer(e, str(int(e.ground_truth) + 1)) == 0.0 and scorer(e, "no idea") == 0.0
    # the same seed gives the same prompts; an unknown task names the field
    again = load_data(DataConfig(source=DataSource.REASONING_GYM, task="basic_arithmetic",
                                 size=12, synthetic_seed=5))
    assert again.train == data.train
    with pytest.raises(ValueError, match="data.task='no_such_task'"):
        load_data(DataConfig(source=DataSource.REASONING_GYM, task="no_such_task"))


@pytest.mark.parametrize("response, score", [
    ("so 9 * 8 = 72, and the answer is \\boxed{72}", 1.0),
    ("\\boxed{70} at first, then \\boxed{72.0}", 1.0),  # the last box counts, 72.0 == 72
    ("the answer is \\boxed{71}", 0.0),
    ("72", 0.0),  # no box: not an answer
    ("\\boxed{\\frac{144}{2}}", 1.0),
])
def test_boxed_math_score_for_gsm8k_and_math(response, score):
    assert compute_score("openai/gsm8k", response, "72") == score
    assert compute_score("math", response, "72") == score
