"""Length workloads: plain numpy, no process groups."""

import numpy as np
import pytest

from flexfloor.rollout.workload import DISTRIBUTIONS, make_lengths, save_lengths, tail_stats

# the rollout benchmark's defaults
SIZES = dict(num_prompts=32, samples_per_prompt=8, epochs=4, max_len=200)


@pytest.mark.parametrize("dist", ["lognormal", "bimodal", "uniform"])
def test_shape_range_and_determinism_per_seed(dist):
    a = make_lengths(dist, seed=3, **SIZES)
    assert a.shape == (4, 32, 8) and a.dtype.kind == "i"
    assert a.min() >= 1 and a.max() <= 200
    assert np.array_equal(a, make_lengths(dist, seed=3, **SIZES))
    assert not np.array_equal(a, make_lengths(dist, seed=4, **SIZES))


@pytest.mark.parametrize("seed", range(10))
def test_lognormal_default_is_long_tailed(seed):
    stats = tail_stats(make_lengths("lognormal", seed=seed, **SIZES))
    assert stats["p99_over_p50"] >= 8
    assert stats["max"] <= 200


def test_history_predicts_lengths_and_siblings_are_similar():
    a = make_lengths("lognormal", seed=0, **SIZES).astype(float)
    group_max = a.max(axis=2)  # [epochs, prompts]
    # a prompt's longest sample last epoch ranks prompts like this epoch's (Spearman via ranks)
    r0, r1 = (np.argsort(np.argsort(g)) for g in (group_max[0], group_max[1]))
    assert np.corrcoef(r0, r1)[0, 1] > 0.9
    # siblings spread far less than prompts do
    spread = np.log(a).std(axis=2).mean()
    assert spread < 0.35 < np.log(a).mean(axis=2).std()


def test_bimodal_and_uniform_parameters():
    b = make_lengths("bimodal", seed=0, short=4, long=100, long_frac=0.25, sample_sigma=0.0,
                     drift_sigma=0.0, **SIZES)
    assert sorted(set(b.ravel().tolist())) == [4, 100]
    assert (b[0, :, 0] == 100).sum() == 8  # exactly a quarter of the prompts are long
    u = make_lengths("uniform", seed=0, min_len=50, sample_sigma=0.0, drift_sigma=0.0, **SIZES)
    assert u.min() >= 50 and u.max() <= 200


def test_clipped_to_max_len():
    a = make_lengths("lognormal", seed=0, median=100, sigma=1.0, **{**SIZES, "max_len": 64})
    assert a.max() == 64 and a.min() >= 1


def test_json_file_round_trip(tmp_path):
    a = make_lengths("lognormal", seed=1, **SIZES)
    path = tmp_path / "lengths.json"
    save_lengths(str(path), a)
    assert np.array_equal(make_lengths("file", path=str(path), seed=9, **SIZES), a)


def test_json_file_per_prompt_repeats_every_epoch(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text('{"lengths": [[3, 4], [10, 12]]}')
    a = make_lengths("file", path=str(path), num_prompts=2, samples_per_prompt=2, epochs=3,
                     seed=0, max_len=12)
    assert a.tolist() == [[[3, 4], [10, 12]]] * 3
    # a replay is used as given: a length above max_len is refused, not clipped (the benchmark
    # and the simulator alike)
    with pytest.raises(ValueError, match=r"its largest length, 12 at lengths\[1\]\[1\].*above "
                                         r"--max-len 11"):
        make_lengths("file", path=str(path), num_prompts=2, samples_per_prompt=2, epochs=3,
                     seed=0, max_len=11)
    with pytest.raises(ValueError, match=r"do not cover .*: lower --num-prompts to 2 "
                                         r"\(--dataset-prompts where given\), or give a file"):
        make_lengths("file", path=str(path), num_prompts=3, samples_per_prompt=2, epochs=1,
                     seed=0, max_len=50)


def test_text_file_gives_prompt_bases(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# one base length per prompt\n5\n\n40\n7  # a comment\n")
    a = make_lengths("file", path=str(path), num_prompts=3, samples_per_prompt=4, epochs=2,
                     seed=0, max_len=200, sample_sigma=0.0, drift_sigma=0.0)
    assert a[:, :, 0].tolist() == [[5, 40, 7]] * 2 and (a == a[:, :, :1]).all()
    noisy = make_lengths("file", path=str(path), num_prompts=3, samples_per_prompt=4, epochs=2,
                         seed=0, max_len=200)
    assert noisy[0, 1].min() > 20  # samples stay around their prompt's base
    with pytest.raises(ValueError, match="3 lengths .*need at least 4: one for each of the "
                                         "--num-prompts .*or lower it to 3"):
        make_lengths("file", path=str(path), num_prompts=4, samples_per_prompt=1, epochs=1,
                     seed=0, max_len=200)


@pytest.mark.parametrize("name, text, message", [
    ("zero.json", '{"lengths": [[3, 0], [1, 2]]}', "whole numbers of at least 1"),
    ("half.json", '{"lengths": [[3.5, 1], [1, 2]]}', "whole numbers of at least 1"),
    ("nan.json", '{"lengths": [[NaN, 1], [1, 2]]}', "whole numbers of at least 1"),
    ("ragged.json", '{"lengths": [[3], [1, 2]]}', "every prompt with as many samples"),
    ("torn.json", '{"lengths": [[3, 1], [1, 2]', "not valid JSON"),
    ("word.txt", "5\nabc\n", "line 2: 'abc' is not a positive length"),
    ("zero.txt", "5\n0  # none\n", "line 2: '0' is not a positive length"),
    ("absent.txt", None, "No such file or directory (--length-file)"),
    # a bare list, read as JSON (not as a text file of one length per line) with the fix
    ("bare.json", "[[[10, 20], [30, 40]]]", 'is an object; wrap the list as {"lengths": ...}'),
    ("empty.json", "", 'is empty; give JSON {"lengths": [epochs][prompts][samples]} or one'),
    ("blank.txt", "# only a comment\n\n", "holds no lengths, only comments or blank lines"),
    # JSON true is not the length 1 (numpy would make it one)
    ("true.json", '{"lengths": [[3, 4], [1, true]]}',
     "lengths[1][1] (prompt 1, sample 1) is true; lengths must be whole numbers of at least 1"),
    ("short.json", '{"lengths": [[[3, 4]], [[1, 2]]]}',
     "lengths of shape [2, 1, 2] do not cover [epochs=1][prompts=2][samples=2] (or "
     "[prompts][samples]): lower --num-prompts to 1 (--dataset-prompts where given), or give"),
])
def test_a_bad_length_file_is_refused_naming_it(tmp_path, name, text, message):
    """Not raised to length 1 or read as something else: an error naming the file."""
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError) as e:
        make_lengths("file", path=str(path), num_prompts=2, samples_per_prompt=2, epochs=1,
                     seed=0, max_len=50)
    assert str(path) in str(e.value) and message in str(e.value)


def test_a_json_length_file_of_whole_floats_reads_as_its_integers(tmp_path):
    """[[3.0, 4.0]] (a tool that writes floats) is the same file as [[3, 4]]."""
    path = tmp_path / "floats.json"
    path.write_text('{"lengths": [[3.0, 4.0], [1.0, 2.0]]}')
    got = make_lengths("file", path=str(path), num_prompts=2, samples_per_prompt=2, epochs=1,
                       seed=0, max_len=50)
    assert got.dtype == np.int64 and got.tolist() == [[[3, 4], [1, 2]]]


def test_bad_names_list_the_choices():
    with pytest.raises(ValueError) as e:
        make_lengths("pareto", seed=0, **SIZES)
    assert all(d in str(e.value) for d in DISTRIBUTIONS)
    with pytest.raises(ValueError, match="median"):
        make_lengths("uniform", seed=0, median=5, **SIZES)
    with pytest.raises(ValueError, match="path"):
        make_lengths("file", seed=0, **SIZES)


def test_tail_stats():
    s = tail_stats(np.array([[1, 2, 3, 4, 100]]))
    # p99 interpolated between 4 and 100: 4 + 0.96 * 96
    assert s["p50"] == 3 and s["max"] == 100 and s["p99"] == pytest.approx(96.16)
    assert s["p99_over_p50"] == pytest.approx(96.16 / 3)
