"""Response-length workloads: how long each sample of each prompt runs, epoch after epoch.

Used by the rollout benchmark (requests carry these lengths as `target_len`) and by the cluster
simulator, so it is plain numpy: no torch, no process groups.

A workload is an int array `[epochs, prompts, samples]` of lengths in [1, max_len]. It has the
three properties length prediction relies on in real RL runs:
- each prompt has a base length, drawn once: its history predicts it in later epochs;
- the samples of a prompt vary around that base (sibling similarity: lognormal noise,
  `sample_sigma`);
- each epoch the base drifts a little (a multiplicative random walk, `drift_sigma`), as a policy
  that trains changes its answers.

Bases are a *stratified* draw (one draw inside each 1/P quantile slice of the distribution,
shuffled over the P prompts), so a prompt set of a few dozen still shows the tail its distribution
describes instead of depending on the luck of the seed.

Distributions (`make_lengths(dist, ...)`, parameters as keywords):
- `lognormal`: `median`, `sigma` of the base length. The default (16, 1.2) has
  p99/p50 >= 8 over all response lengths (capped by `max_len` = 200 in the benchmark).
- `bimodal`: `short`, `long`, `long_frac`: round(long_frac * P) prompts are long, the rest short.
- `uniform`: bases uniform in [`min_len`, max_len].
- `file`: `path`. JSON `{"lengths": L}` with L `[prompts][samples]` (the same every epoch) or
  `[epochs][prompts][samples]`, used as given (`save_lengths` writes this form; a length above
  `max_len` is refused, naming the largest and where it is, never clipped); any
  other file is text, one base length per line (one line per prompt; blank lines and `#` comments skipped), with
  samples and epochs drawn around it like the other distributions (`sample_sigma=0`,
  `drift_sigma=0` repeat it exactly).
Every distribution also takes `sample_sigma` (default 0.2) and `drift_sigma` (default 0.05), and
two RL mixes (`MIX_PARAMS`; not with an exact JSON file):
- `history_correlation` (default 1.0): how much a prompt's base length one epoch tells of the next.
  Below 1 the base is redrawn each epoch, correlated with the last one: in normal-quantile space
  z' = c z + sqrt(1 - c^2) e (the distribution of bases stays the same; 0: history is noise);
- `cap_fraction` (default 0.0): that share of all samples, drawn afresh each epoch, runs to the
  cap (reasoning that does not stop): no history predicts which.
`DEFAULT_PARAMS`, `NOISE_PARAMS` and `MIX_PARAMS` hold the defaults.

RL draws a step's prompts from a dataset larger than one step's batch (`dataset_batches`): with D
prompts and B a step, a prompt comes back once per D/B steps, so most rollouts have no history
for most of their prompts. A workload is then `[steps, D, samples]`: epoch e of the generators
above is training step e, and a step reads the rows of its drawn prompts.
"""

from __future__ import annotations

import json
import math
from statistics import NormalDist
from typing import Sequence

import numpy as np

DISTRIBUTIONS = ("lognormal", "bimodal", "uniform", "file")

DEFAULT_PARAMS = {
    "lognormal": {"median": 16.0, "sigma": 1.2},
    "bimodal": {"short": 8.0, "long": 160.0, "long_frac": 0.2},
    "uniform": {"min_len": 1.0},
    "file": {"path": None},
}
NOISE_PARAMS = {"sample_sigma": 0.2, "drift_sigma": 0.05}
MIX_PARAMS = {"history_correlation": 1.0, "cap_fraction": 0.0}


def make_lengths(dist: str, *, num_prompts: int, samples_per_prompt: int, epochs: int, seed: int,
                 max_len: int, **params) -> np.ndarray:
    """Response lengths [epochs, num_prompts, samples_per_prompt], ints in [1, max_len].

    Deterministic in (dist, sizes, seed, params). Unknown distributions or parameters raise
    ValueError naming the valid ones. An exact JSON length file is a replay whose lengths are
    used as given: one above `max_len` is refused (ValueError naming the largest, where it is and
    the fix), not clipped.
    """
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {dist!r}; "
                         f"choose one of {list(DISTRIBUTIONS)}")
    allowed = {**DEFAULT_PARAMS[dist], **NOISE_PARAMS, **MIX_PARAMS}
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"length distribution {dist!r} takes no parameter {unknown}; "
                         f"its parameters are {sorted(allowed)}")
    for name, value in (("num_prompts", num_prompts), ("samples_per_prompt", samples_per_prompt),
                        ("epochs", epochs), ("max_len", max_len)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be at least 1")
    p = {**allowed, **params}
    shape = (epochs, num_prompts, samples_per_prompt)
    rng = np.random.default_rng(seed)
    c, cap = float(p["history_correlation"]), float(p["cap_fraction"])
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"history_correlation={c}: must be in [0, 1] (1: history predicts)")
    if not 0.0 <= cap <= 1.0:
        raise ValueError(f"cap_fraction={cap}: must be in [0, 1]")

    if dist == "file":
        if p["path"] is None:
            raise ValueError("length distribution 'file' needs path=FILE (--length-file)")
        exact, bases = _read_file(p["path"], shape, max_len=max_len)
        if exact is not None:
            if c != 1.0 or cap != 0.0:
                raise ValueError("history_correlation and cap_fraction do not apply to an exact "
                                 "JSON length file (its lengths are used as given)")
            return exact.astype(np.int64)
        quantile = _empirical_quantile(bases)
    elif dist == "lognormal":
        _check_positive(dist, median=p["median"], sigma=p["sigma"])
        z = np.array([NormalDist().inv_cdf(u) for u in _stratified(rng, num_prompts)])
        bases = p["median"] * np.exp(p["sigma"] * z)
        quantile = lambda u: p["median"] * np.exp(p["sigma"] * _inv_cdf(u))  # noqa: E731
    elif dist == "bimodal":
        _check_positive(dist, short=p["short"], long=p["long"])
        if not 0.0 <= p["long_frac"] <= 1.0:
            raise ValueError(f"bimodal long_frac={p['long_frac']}: must be in [0, 1]")
        n_long = int(round(p["long_frac"] * num_prompts))
        is_long = rng.permutation(np.arange(num_prompts) < n_long)
        bases = np.where(is_long, p["long"], p["short"]).astype(float)
        quantile = lambda u: np.where(u >= 1 - p["long_frac"], p["long"], p["short"])  # noqa: E731
    else:  # uniform
        lo = float(p["min_len"])
        if not 1 <= lo <= max_len:
            raise ValueError(f"uniform min_len={lo}: must be in [1, --max-len {max_len}]")
        bases = lo + _stratified(rng, num_prompts) * (max_len - lo)
        quantile = lambda u: lo + u * (max_len - lo)  # noqa: E731

    _check_non_negative(sample_sigma=p["sample_sigma"], drift_sigma=p["drift_sigma"])
    # drift: a random walk in log space, none in the first epoch; noise: per sample, every epoch
    steps = rng.normal(0.0, p["drift_sigma"], size=(epochs, num_prompts, 1))
    steps[0] = 0.0
    drift = np.cumsum(steps, axis=0)
    noise = rng.normal(0.0, p["sample_sigma"], size=shape)
    per_epoch = np.broadcast_to(bases, (epochs, num_prompts))
    if c < 1.0:
        per_epoch = _correlated_bases(bases, quantile, c, epochs,
                                      np.random.default_rng([seed, 3]))
    lengths = np.clip(np.rint(per_epoch[:, :, None] * np.exp(drift + noise)), 1, max_len)
    if cap > 0.0:
        capped = np.random.default_rng([seed, 4]).uniform(size=shape) < cap
        lengths[capped] = max_len
    return lengths.astype(np.int64)


def dataset_batches(dataset_prompts: int, batch_prompts: int, steps: int, seed: int) -> np.ndarray:
    """The prompt uids each training step draws [steps, batch_prompts]: the dataset's D prompts
    in a fresh shuffle per dataset epoch, B at a time (a prompt comes back once per D/B steps).
    D = B is `epoch_order` step by step."""
    if batch_prompts < 1 or dataset_prompts < batch_prompts:
        raise ValueError(f"dataset_prompts={dataset_prompts} must be at least the prompts per "
                         f"step ({batch_prompts} >= 1)")
    stream: list[int] = []
    epoch = 0
    while len(stream) < steps * batch_prompts:
        epoch += 1
        stream += epoch_order(dataset_prompts, seed, epoch)
    return np.array(stream[: steps * batch_prompts], dtype=np.int64).reshape(steps, batch_prompts)


def make_prompts(num_prompts: int, prompt_len: tuple[int, int], vocab_size: int,
                 seed: int) -> list[tuple[int, ...]]:
    """Random prompts (token ids in [1, vocab_size)) with lengths uniform in prompt_len=(lo, hi);
    the benchmark decodes them, the simulator reads their lengths."""
    rng = np.random.default_rng([seed, 1])
    lo, hi = prompt_len
    return [tuple(int(t) for t in rng.integers(1, vocab_size, rng.integers(lo, hi + 1)))
            for _ in range(num_prompts)]


def epoch_order(num_prompts: int, seed: int, epoch: int) -> list[int]:
    """The order prompts come in, in one epoch (1-based): a fresh shuffle each epoch."""
    return [int(u) for u in np.random.default_rng([seed, 2, epoch]).permutation(num_prompts)]


def save_lengths(path: str, lengths: np.ndarray) -> None:
    """Write lengths [epochs, prompts, samples] as the JSON `file` format (exact round trip)."""
    with open(path, "w") as f:
        json.dump({"lengths": np.asarray(lengths).astype(int).tolist()}, f)


def tail_stats(lengths) -> dict:
    """How long-tailed a workload is, over all its response lengths."""
    flat = np.asarray(lengths, dtype=float).ravel()
    p50, p99 = (float(x) for x in np.percentile(flat, [50, 99]))
    return {"p50": p50, "p99": p99, "p99_over_p50": p99 / p50 if p50 > 0 else float("inf"),
            "max": int(flat.max()), "mean": float(flat.mean()), "total": int(flat.sum())}


def _inv_cdf(u):
    return np.array([NormalDist().inv_cdf(float(x)) for x in np.ravel(u)]).reshape(np.shape(u))


def _correlated_bases(bases, quantile, c: float, epochs: int, rng) -> np.ndarray:
    """Bases [epochs, prompts]: the first epoch's as drawn, each later one an AR(1) step in
    normal-quantile space with correlation c (the marginal distribution stays the same)."""
    order = np.argsort(np.argsort(bases, kind="stable"), kind="stable")
    z = _inv_cdf(np.clip((order + 0.5) / len(bases), 1e-12, 1 - 1e-12))
    out = [np.asarray(bases, dtype=float)]
    for _ in range(1, epochs):
        z = c * z + np.sqrt(1.0 - c * c) * rng.normal(size=z.shape)
        out.append(np.asarray(quantile(np.clip(_normal_cdf(z), 1e-12, 1 - 1e-12)), dtype=float))
    return np.stack(out)


def _normal_cdf(z):
    return np.array([NormalDist().cdf(float(x)) for x in np.ravel(z)]).reshape(np.shape(z))


def _empirical_quantile(bases):
    ordered = np.sort(np.asarray(bases, dtype=float))
    return lambda u: ordered[np.minimum(len(ordered) - 1, (np.asarray(u) * len(ordered)).astype(int))]


def _stratified(rng: np.random.Generator, n: int) -> np.ndarray:
    """n uniforms in (0, 1), one inside each slice [i/n, (i+1)/n), in random order."""
    u = (np.arange(n) + rng.uniform(size=n)) / n
    return rng.permutation(np.clip(u, 1e-12, 1 - 1e-12))


def _read_file(path: str, shape: Sequence[int], max_len: int | None = None):
    """JSON: (exact lengths [epochs, prompts, samples], None); text: (None, bases [prompts]).
    Every error names the file (`--length-file` of the tools) and what to fix; with `max_len`,
    a JSON length above it (in the part used) is one."""
    epochs, prompts, samples = shape
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"length file {path}: {e.strerror} (--length-file)") from None
    if not text.strip():
        raise ValueError(f"length file {path}: is empty; give JSON {{\"lengths\": "
                         "[epochs][prompts][samples]} or one base length per line "
                         "(--length-file)")
    if text.lstrip().startswith(("{", "[")):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"length file {path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"length file {path}: a JSON length file is an object; wrap the "
                             f"list as {{\"lengths\": ...}} (--length-file)")
        if "lengths" not in data:
            raise ValueError(f"{path}: a JSON length file needs a 'lengths' key")
        flag = _first_bool(data["lengths"])
        if flag is not None:  # numpy would take true as 1
            raise ValueError(f"length file {path}: {_at(flag[0])} is {flag[1]}; lengths must "
                             "be whole numbers of at least 1: fix the file (--length-file)")
        try:
            arr = np.asarray(data["lengths"])
        except ValueError:  # ragged lists
            arr = np.asarray(None)
        if arr.dtype.kind in "iuf":  # 3.0 is whole, 3.5, nan and 0 are not
            with np.errstate(invalid="ignore"):
                bad = ~(np.isfinite(arr) & (arr == np.round(arr)) & (arr >= 1))
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ValueError(
                    f"length file {path}: {_at(where)} is {_number(arr[where])}; lengths must "
                    f"be whole numbers of at least 1 ({int(bad.sum())} of {arr.size} are not): "
                    "fix the file (--length-file)")
        else:
            raise ValueError(f"length file {path}: 'lengths' must be nested lists of whole "
                             "numbers of at least 1, every prompt with as many samples")
        need = (prompts, samples) if arr.ndim == 2 else (epochs, prompts, samples)
        if arr.ndim not in (2, 3):
            raise ValueError(
                f"{path}: lengths of shape {list(np.shape(data['lengths']))}: give "
                "[epochs][prompts][samples] or [prompts][samples] (--length-file)")
        short = [(flag, have, n) for flag, have, n in zip(
            ("--epochs", "--num-prompts", "--samples-per-prompt")[3 - arr.ndim:], arr.shape,
            need) if have < n]
        if short:
            fix = " and ".join(f"{flag} to {have}" + (_DATASET if flag == "--num-prompts" else "")
                               for flag, have, _ in short)
            raise ValueError(
                f"{path}: lengths of shape {list(arr.shape)} do not cover "
                f"[epochs={epochs}][prompts={prompts}][samples={samples}] (or [prompts][samples]): "
                f"lower {fix}, or give a file that covers them")
        used = arr[tuple(slice(n) for n in need)]
        if max_len is not None:
            _check_within(path, used, max_len)
        return np.array(np.broadcast_to(used, shape), dtype=np.int64), None
    bases = []
    for number, line in enumerate(text.splitlines(), 1):
        value = line.split("#")[0].strip()
        if not value:
            continue
        try:
            bases.append(float(value))
        except ValueError:
            bases.append(float("nan"))
        if not bases[-1] > 0:  # NaN too
            raise ValueError(f"length file {path}, line {number}: {value!r} is not a positive "
                             "length (one base length per line; # starts a comment)")
    if not bases:
        raise ValueError(f"length file {path}: holds no lengths, only comments or blank lines; "
                         "give one base length per line (--length-file)")
    if len(bases) < prompts:
        raise ValueError(f"{path}: {len(bases)} lengths (one per line, one per prompt), need "
                         f"at least {prompts}: one for each of the --num-prompts{_DATASET}, or "
                         f"lower it to {len(bases)}")
    return None, np.array(bases[:prompts])


# the prompts a length file covers are the dataset's where the tool has one
_DATASET = " (--dataset-prompts where given)"


def _first_bool(value, at=()):
    """(index, the JSON word) of the first true/false in nested lists, or None."""
    if isinstance(value, bool):
        return at, "true" if value else "false"
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _first_bool(v, (*at, i))
            if found is not None:
                return found
    return None


def _at(index: Sequence[int]) -> str:
    """A place in a JSON length file, as its own indices and in words: `lengths[0][3][1]
    (epoch 0, prompt 3, sample 1)`; [prompt][sample] for a file of one epoch for all."""
    names = {2: ("prompt", "sample"), 3: ("epoch", "prompt", "sample")}.get(len(index), ())
    words = ", ".join(f"{n} {i}" for n, i in zip(names, index))
    return "lengths" + "".join(f"[{i}]" for i in index) + (f" ({words})" if words else "")


def _number(value) -> str:
    value = float(value)
    return str(int(value)) if np.isfinite(value) and value == round(value) else repr(value)


def _check_within(path: str, lengths: np.ndarray, max_len: int) -> None:
    """ValueError where an exact length file's lengths (the part used, in the file's own
    indices) hold one above max_len: its largest, where, how many, and the two fixes."""
    over = lengths > max_len
    if not over.any():
        return
    where = np.unravel_index(int(np.argmax(lengths)), lengths.shape)
    largest = int(lengths[where])
    raise ValueError(
        f"length file {path}: its largest length, {largest} at "
        f"{_at(tuple(int(i) for i in where))}, is above --max-len {max_len} ({int(over.sum())} "
        f"of {lengths.size} lengths are); a length file is replayed as given, not clipped: pass "
        f"--max-len {largest} or more, or cap the file's lengths at {max_len}")


def _check_positive(dist: str, **values) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value > 0):  # NaN and inf too
            raise ValueError(f"{dist} {name}={value}: must be a finite number above 0")


def _check_non_negative(**values) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name}={value}: must be non-negative")
