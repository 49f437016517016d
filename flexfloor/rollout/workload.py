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
  `[epochs][prompts][samples]`, used as given (`save_lengths` writes this form); any other file is
  text, one base length per line (one line per prompt; blank lines and `#` comments skipped), with
  samples and epochs drawn around it like the other distributions (`sample_sigma=0`,
  `drift_sigma=0` repeat it exactly).
Every distribution also takes `sample_sigma` (default 0.2) and `drift_sigma` (default 0.05).
`DEFAULT_PARAMS` and `NOISE_PARAMS` hold the defaults.
"""

from __future__ import annotations

import json
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


def make_lengths(dist: str, *, num_prompts: int, samples_per_prompt: int, epochs: int, seed: int,
                 max_len: int, **params) -> np.ndarray:
    """Response lengths [epochs, num_prompts, samples_per_prompt], ints in [1, max_len].

    Deterministic in (dist, sizes, seed, params). Unknown distributions or parameters raise
    ValueError naming the valid ones.
    """
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {dist!r}; "
                         f"choose one of {list(DISTRIBUTIONS)}")
    allowed = {**DEFAULT_PARAMS[dist], **NOISE_PARAMS}
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

    if dist == "file":
        if p["path"] is None:
            raise ValueError("length distribution 'file' needs path=FILE (--length-file)")
        exact, bases = _read_file(p["path"], shape)
        if exact is not None:
            return np.clip(exact, 1, max_len).astype(np.int64)
    elif dist == "lognormal":
        _check_positive(dist, median=p["median"], sigma=p["sigma"])
        z = np.array([NormalDist().inv_cdf(u) for u in _stratified(rng, num_prompts)])
        bases = p["median"] * np.exp(p["sigma"] * z)
    elif dist == "bimodal":
        _check_positive(dist, short=p["short"], long=p["long"])
        if not 0.0 <= p["long_frac"] <= 1.0:
            raise ValueError(f"bimodal long_frac={p['long_frac']}: must be in [0, 1]")
        n_long = int(round(p["long_frac"] * num_prompts))
        is_long = rng.permutation(np.arange(num_prompts) < n_long)
        bases = np.where(is_long, p["long"], p["short"]).astype(float)
    else:  # uniform
        lo = float(p["min_len"])
        if not 1 <= lo <= max_len:
            raise ValueError(f"uniform min_len={lo}: must be in [1, max_len={max_len}]")
        bases = lo + _stratified(rng, num_prompts) * (max_len - lo)

    _check_non_negative(sample_sigma=p["sample_sigma"], drift_sigma=p["drift_sigma"])
    # drift: a random walk in log space, none in the first epoch; noise: per sample, every epoch
    steps = rng.normal(0.0, p["drift_sigma"], size=(epochs, num_prompts, 1))
    steps[0] = 0.0
    drift = np.cumsum(steps, axis=0)
    noise = rng.normal(0.0, p["sample_sigma"], size=shape)
    lengths = np.rint(bases[None, :, None] * np.exp(drift + noise))
    return np.clip(lengths, 1, max_len).astype(np.int64)


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


def _stratified(rng: np.random.Generator, n: int) -> np.ndarray:
    """n uniforms in (0, 1), one inside each slice [i/n, (i+1)/n), in random order."""
    u = (np.arange(n) + rng.uniform(size=n)) / n
    return rng.permutation(np.clip(u, 1e-12, 1 - 1e-12))


def _read_file(path: str, shape: Sequence[int]):
    """JSON: (exact lengths [epochs, prompts, samples], None); text: (None, bases [prompts])."""
    epochs, prompts, samples = shape
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if "lengths" not in data:
            raise ValueError(f"{path}: a JSON length file needs a 'lengths' key")
        arr = np.asarray(data["lengths"])
        if arr.ndim == 2:
            arr = np.broadcast_to(arr, (epochs, *arr.shape))
        if arr.ndim != 3 or any(have < need for have, need in zip(arr.shape, shape)):
            raise ValueError(
                f"{path}: lengths of shape {list(np.shape(data['lengths']))} do not cover "
                f"[epochs={epochs}][prompts={prompts}][samples={samples}] (or [prompts][samples])"
            )
        return np.array(arr[:epochs, :prompts, :samples], dtype=np.int64), None
    bases = [float(line.split("#")[0]) for line in text.splitlines() if line.split("#")[0].strip()]
    if len(bases) < prompts:
        raise ValueError(f"{path}: {len(bases)} lengths (one per line, one per prompt), "
                         f"need at least num_prompts={prompts}")
    return None, np.array(bases[:prompts])


def _check_positive(dist: str, **values) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{dist} {name}={value}: must be positive")


def _check_non_negative(**values) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name}={value}: must be non-negative")
