"""Length history, prediction, a memory model and placement: so the ranks that can leave, do.

Release alone only helps when the ranks meant to leave finish early. The scheduler predicts each
prompt's response length (its own history from earlier epochs, else its siblings already finished
in this rollout, else a running quantile of all lengths seen), then places prompt groups: the
longest predicted work on the ranks meant to stay, the rest staggered so ranks leave one after
another, every rank's concurrent batch within its KV budget. The baseline (verl-like) splits the
batch into equal contiguous chunks.

Everything here is plain Python on plain values, so the simulator drives the same objects as the
real engine.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Sequence

from flexfloor.config import PlacementPolicy
from flexfloor.rollout.types import Request


# --------------------------------------------------------------------------------------------
# history and prediction


# `LengthHistory.unproven`: a finished sample disagrees with its prompt's history when it ends
# outside the last epoch's range widened by this share; the history is unproven when more
# than UNPROVEN_SHARE of at least UNPROVEN_MIN_SAMPLES finished samples disagree
UNPROVEN_TOLERANCE = 0.25
UNPROVEN_SHARE = 0.1
UNPROVEN_MIN_SAMPLES = 16


@dataclass
class LengthHistory:
    """Past response lengths per prompt uid (most recent epoch last), saved with checkpoints."""

    lengths: dict[int, list[list[int]]] = field(default_factory=dict)  # uid -> epochs -> lengths
    max_epochs: int = 4
    _all: list[int] = field(default_factory=list)  # sorted, every length seen (for the prior)
    max_prior_samples: int = 100_000
    # whether the last rollout recorded (`record_rollout`) proved this history wrong: its
    # lengths, set against the history before them, were `unproven`
    proved_wrong: bool = False

    def record(self, uid: int, lengths: Sequence[int]) -> None:
        epochs = self.lengths.setdefault(uid, [])
        epochs.append(list(lengths))
        del epochs[: -self.max_epochs]
        for n in lengths:
            bisect.insort(self._all, n)
        if len(self._all) > self.max_prior_samples:
            self._all = self._all[:: 2]

    def record_rollout(self, finished: Mapping[int, Sequence[int]]) -> None:
        """Record one whole rollout's lengths (uid -> its samples' lengths), first judging the
        history by them (`proved_wrong`: `unproven` over the whole rollout)."""
        self.proved_wrong = self.unproven(finished)
        for uid in sorted(finished):
            self.record(uid, finished[uid])

    def record_results(self, results: Iterable) -> None:
        """`record_rollout` of one rollout's `Result`s."""
        by_uid: dict[int, list[int]] = {}
        for r in results:
            by_uid.setdefault(r.prompt_uid, []).append(len(r.token_ids))
        self.record_rollout(by_uid)

    def last(self, uid: int) -> Optional[list[int]]:
        epochs = self.lengths.get(uid)
        return epochs[-1] if epochs else None

    def quantile(self, q: float) -> Optional[float]:
        if not self._all:
            return None
        i = min(len(self._all) - 1, max(0, int(round(q * (len(self._all) - 1)))))
        return float(self._all[i])

    def beyond(self, n: float) -> Optional[float]:
        """The median of the lengths seen that are longer than `n` (what a request that has
        produced n tokens is, by the prior), or None when none was."""
        i = bisect.bisect_right(self._all, n)
        if i >= len(self._all):
            return None
        return float(self._all[(i + len(self._all) - 1) // 2])

    def unproven(self, finished: Mapping[int, Sequence[int]],
                 tolerance: float = UNPROVEN_TOLERANCE, share: float = UNPROVEN_SHARE,
                 min_samples: int = UNPROVEN_MIN_SAMPLES) -> bool:
        """Whether this history has proved wrong in the rollout under way: of the samples
        `finished` so far (uid -> lengths) of prompts with history, at least `min_samples`, more
        than `share` ended outside their prompt's last epoch's range widened by `tolerance`
        (shorter than its shortest / (1 + tolerance) or longer than its longest x (1 +
        tolerance)). False with no history for the finished prompts: there is nothing to be
        wrong (and no end to keep). Measured on the generator (tools/heldout.py's workloads and
        paper-like, whole rollouts): 0.01-0.08 of samples outside with history as it was (cap
        fraction 0.1: 0.06-0.12), 0.13-0.44 with history correlation 0.8, 0.28-0.63 with 0.5."""
        outside = seen = 0
        for uid, ls in finished.items():
            last = self.last(uid)
            if not last:
                continue
            lo, hi = min(last) / (1.0 + tolerance), max(last) * (1.0 + tolerance)
            seen += len(ls)
            outside += sum(1 for n in ls if n < lo or n > hi)
        return seen >= min_samples and outside > share * seen

    def sibling_spread(self) -> float:
        """How much longer a prompt's longest sample is than its shortest: the median ratio
        over the prompts seen (their last epoch), 1 when none had two samples."""
        ratios = sorted(max(ls) / max(1, min(ls)) for ls in
                        (epochs[-1] for epochs in self.lengths.values()) if len(ls) >= 2)
        return ratios[len(ratios) // 2] if ratios else 1.0

    def surprise_share(self, cap: float) -> float:
        """How often a sample runs to `cap` against its prompt's history: over the prompts seen
        in two epochs or more, the samples at the cap in the last epoch beyond those of the
        epoch before, per sample; with no such prompt, the share of every length seen that
        reached the cap (0 when nothing was seen)."""
        surprises = samples = 0
        for epochs in self.lengths.values():
            if len(epochs) >= 2:
                before = sum(n >= cap for n in epochs[-2])
                surprises += max(0, sum(n >= cap for n in epochs[-1]) - before)
                samples += len(epochs[-1])
        if samples:
            return surprises / samples
        if not self._all:
            return 0.0
        return (len(self._all) - bisect.bisect_left(self._all, cap)) / len(self._all)

    def state_dict(self) -> dict:
        return {"lengths": {int(k): v for k, v in self.lengths.items()}, "all": list(self._all),
                "max_epochs": self.max_epochs, "proved_wrong": self.proved_wrong}

    @classmethod
    def from_state_dict(cls, state: dict) -> "LengthHistory":
        h = cls(lengths={int(k): [list(e) for e in v] for k, v in state["lengths"].items()},
                max_epochs=state["max_epochs"])
        h._all = list(state["all"])
        h.proved_wrong = bool(state.get("proved_wrong", False))  # absent from older checkpoints
        return h


@dataclass
class Predictor:
    """Predicted response length of a prompt's samples.

    Order of evidence: the prompt's own history (max and mean over its samples last time it was
    seen), else siblings already finished in this rollout, else the global prior (a running
    quantile), else `default` (nothing seen yet).
    """

    history: LengthHistory
    prior_quantile: float = 0.5
    default: float = 64.0
    # False: a prompt's own past lengths are not evidence (the last rollout proved them wrong,
    # `LengthHistory.proved_wrong`); siblings and the prior still are
    trust_history: bool = True

    def predict(self, uid: int, siblings: Sequence[int] = ()) -> tuple[float, str]:
        """(predicted longest sample of the group, source of the prediction)."""
        past = self.history.last(uid) if self.trust_history else None
        if past:
            return float(max(past)), "history"
        if siblings:
            return float(max(siblings)), "siblings"
        prior = self.history.quantile(self.prior_quantile)
        if prior is not None:
            return prior, "prior"
        return self.default, "default"

    def running(self, uid: int, siblings: Sequence[int], produced: int,
                spread: float = 1.0) -> float:
        """Predicted length of a sample still running after `produced` tokens: from history
        as `predict`; from siblings done (the shorter ones: they finish first), the longest of
        them or `spread` (`LengthHistory.sibling_spread`) times the shortest, whichever is
        longer; with neither, the prior beyond what it produced (`LengthHistory.beyond`)."""
        past = self.history.last(uid) if self.trust_history else None
        if past:
            return float(max(past))
        if siblings:
            return float(max(max(siblings), spread * min(siblings)))
        beyond = self.history.beyond(produced)
        return beyond if beyond is not None else self.predict(uid)[0]


def prediction_accuracy(predicted: dict[int, float], realised: dict[int, float]) -> dict:
    """Spearman rank correlation and mean absolute error of predicted vs realised lengths."""
    uids = sorted(set(predicted) & set(realised))
    if len(uids) < 2:
        return {"spearman": float("nan"), "mae": float("nan"), "n": len(uids)}

    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        r = [0.0] * len(values)
        i = 0
        while i < len(order):  # average ranks for ties
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    p = ranks([predicted[u] for u in uids])
    q = ranks([realised[u] for u in uids])
    mp, mq = sum(p) / len(p), sum(q) / len(q)
    cov = sum((a - mp) * (b - mq) for a, b in zip(p, q))
    sp = math.sqrt(sum((a - mp) ** 2 for a in p) * sum((b - mq) ** 2 for b in q))
    mae = sum(abs(predicted[u] - realised[u]) for u in uids) / len(uids)
    return {"spearman": cov / sp if sp > 0 else float("nan"), "mae": mae, "n": len(uids)}


def evidence_accuracy(plan, lengths: dict, predictor) -> dict:
    """The predictor's accuracy this step (Spearman, MAE of each prompt's predicted vs realised
    longest sample), per evidence: `history` (the plan's predictions from the prompt's own past)
    and `siblings` (`Predictor.predict(uid, siblings)` given the shorter half of its samples,
    those that finish first: what the rollout knows once they are done)."""
    realised = {uid: float(max(ls)) for uid, ls in lengths.items()}
    hist = {uid: p for uid, p in plan.predicted.items() if predictor.history.last(uid)}
    sib = {}
    for uid, ls in lengths.items():
        done = sorted(ls)[: len(ls) // 2]
        if done:
            sib[uid] = Predictor(LengthHistory(), predictor.prior_quantile).predict(uid, done)[0]
    return {"history": prediction_accuracy(hist, realised),
            "siblings": prediction_accuracy(sib, realised)}


# --------------------------------------------------------------------------------------------
# memory


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}  # model.params_dtype


@dataclass(frozen=True)
class MemoryModel:
    """Bytes that bound a rank's batch: KV cache per token, expert weights, the rank's budget.

    `kv_budget_bytes` is the KV room of a rank hosting only its own experts; each borrowed expert
    costs `expert_bytes` of it. KV is allocated in blocks of `block_tokens` tokens (the engine's
    block size; 1 = per token), so room is counted in whole blocks.

    One object per job, built by `of_model` from the model as built, is handed to the scheduler,
    the engine (its `kv_budget_bytes`), the release decision and the benchmark, so they all count
    the same bytes: `kv_budget_tokens` means the same number of tokens in fp32 and in bf16.
    `from_model_config` is the formula version, for the simulator (no model is built there).
    """

    kv_bytes_per_token: int
    expert_bytes: int
    kv_budget_bytes: Optional[int] = None  # None: unbounded
    block_tokens: int = 1
    num_experts: Optional[int] = None  # routed experts per layer (None: not known)

    @classmethod
    def of_model(cls, model, *, kv_budget_tokens: Optional[int] = None,
                 block_tokens: int = 1) -> "MemoryModel":
        """From a built Megatron-Core `GPTModel`: KV bytes per token at the parameters' real
        element size, one expert's measured bytes over all layers (what borrowing it costs)."""
        from flexfloor.rollout.engine import kv_bytes_per_token

        kv = kv_bytes_per_token(model.config)
        expert = 0
        for layer in model.decoder.layers:
            first = layer.mlp.experts.local_experts[0]
            expert += sum(p.nbytes for p in first.parameters())
        return cls._with_budget(kv, expert, kv_budget_tokens, block_tokens,
                                model.config.num_moe_experts)

    @classmethod
    def from_model_config(cls, model_cfg, *, kv_budget_tokens: Optional[int] = None,
                          dtype_bytes: Optional[int] = None,
                          block_tokens: int = 1) -> "MemoryModel":
        """The formula version (the simulator's): shapes of a `ModelConfig`, element size from
        its `params_dtype` (fp32 when it names none) unless `dtype_bytes` is given. Equal to
        `of_model` for the same model (tested)."""
        if dtype_bytes is None:
            dtype_bytes = _DTYPE_BYTES[getattr(model_cfg, "params_dtype", "float32")]
        head_dim = model_cfg.kv_channels or model_cfg.hidden_size // model_cfg.num_attention_heads
        kv = 2 * model_cfg.num_layers * model_cfg.num_query_groups * head_dim * dtype_bytes
        # gated MLP expert: fc1 [2F, H] + fc2 [H, F], per layer
        expert = 3 * model_cfg.moe_ffn_hidden_size * model_cfg.hidden_size * dtype_bytes
        expert *= model_cfg.num_layers
        return cls._with_budget(kv, expert, kv_budget_tokens, block_tokens,
                                getattr(model_cfg, "num_experts", None))

    @classmethod
    def _with_budget(cls, kv: int, expert: int, kv_budget_tokens: Optional[int],
                     block_tokens: int, num_experts: Optional[int]) -> "MemoryModel":
        if block_tokens < 1:
            raise ValueError(f"KV block size must be at least 1 token, got {block_tokens}")
        budget = None
        if kv_budget_tokens is not None:  # whole blocks: the budget in tokens, rounded down
            budget = (kv_budget_tokens // block_tokens) * block_tokens * kv
        return cls(kv_bytes_per_token=kv, expert_bytes=expert, kv_budget_bytes=budget,
                   block_tokens=block_tokens, num_experts=num_experts)

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token

    def blocks_for(self, tokens: int) -> int:
        """KV blocks `tokens` cached tokens occupy (the engine's block pool counts the same)."""
        from flexfloor.rollout.kv import blocks_for

        return blocks_for(tokens, self.block_tokens)

    def kv_tokens(self, borrowed_experts: int = 0) -> Optional[int]:
        """Tokens of KV a rank can hold while hosting `borrowed_experts` extra experts."""
        if self.kv_budget_bytes is None:
            return None
        room = self.kv_budget_bytes - borrowed_experts * self.expert_bytes
        return max(0, room // self.block_bytes) * self.block_tokens

    def max_borrowed(self, min_kv_tokens: int) -> Optional[int]:
        """Most experts a rank can borrow and still hold `min_kv_tokens` of KV (None: no bound)."""
        if self.kv_budget_bytes is None:
            return None
        room = self.kv_budget_bytes - self.blocks_for(min_kv_tokens) * self.block_bytes
        return max(0, room // self.expert_bytes) if self.expert_bytes else None


# --------------------------------------------------------------------------------------------
# placement


@dataclass(frozen=True)
class PromptGroup:
    """The n samples of one prompt: placed together on one rank."""

    uid: int
    requests: tuple[Request, ...]


# the modelled seconds of one rank's decode step: (requests decoding on it, their cached tokens)
# -> seconds, with every rank of its EP group loaded alike (a lockstep step runs at its fullest
# rank's pace). The simulator passes its cost model's; the engine, the measured one.
StepCost = Callable[[int, float], float]


@dataclass
class RolloutPlan:
    assignment: dict[int, list[Request]]  # rank -> its requests, in admission order
    predicted: dict[int, float]  # uid -> predicted longest sample
    sources: dict[str, int]  # how many predictions came from history / siblings / prior
    # rank -> predicted steps to its local finish, or, placed with a step cost, its modelled
    # seconds: the planned order in which ranks and replicas leave
    expected_finish: dict[int, float]
    per_request: dict[str, float] = field(default_factory=dict)  # request id -> predicted length
    # FlexFloor: the static baseline's predicted end (with a step cost in seconds, else in
    # steps); None where the plan is static's (`distrusted`) or the baseline's
    finish_bound: Optional[float] = None
    # FlexFloor placed as static, the last rollout having proved the history wrong
    # (`Scheduler.distrust_wrong_history`)
    distrusted: bool = False
    # placed with a step cost: `expected_finish` and `finish_bound` are modelled seconds
    by_seconds: bool = False

    def leaving_order(self, replicas: Sequence[Sequence[int]]) -> list[int]:
        """Replica indices in the order they are planned to leave (first to leave first): the
        survivor groups to build ahead, from `expected_finish`."""
        ends = [max((self.expected_finish.get(r, 0.0) for r in ranks), default=0.0)
                for ranks in replicas]
        return sorted(range(len(replicas)), key=lambda i: (ends[i], -i))


def replica_finish(work: Sequence[tuple[Sequence[float], Sequence[int]]], step_cost: StepCost
                   ) -> list[float]:
    """Predicted modelled seconds at which each rank of one lockstep EP group finishes, every
    request admitted at once. work: per rank (response lengths, prompt lengths). Between two
    finishes each rank's running requests and context are known; the group steps at its fullest
    rank's pace, so each stretch is priced by the trapezoid of the slowest rank's step cost at
    its ends. `step_cost` is applied elementwise to numpy arrays."""
    import numpy as np

    lens, prompts = [], []
    for lengths, prompt_lens in work:
        ls = np.maximum(1.0, np.asarray(lengths, dtype=float))
        order = np.argsort(ls, kind="stable")
        lens.append(ls[order])
        prompts.append(np.asarray(prompt_lens, dtype=float)[order])
    every = [x for x in lens if len(x)]
    if not every:
        return [0.0] * len(work)
    points = np.unique(np.concatenate([[0.0]] + every))
    start, stop = points[:-1], points[1:]
    p_start = np.zeros(len(start))
    p_end = np.zeros(len(start))
    stretches = []  # per busy rank: (requests running in each stretch, their prompts' tokens)
    for ls, ps in zip(lens, prompts):
        if not len(ls):
            continue
        done = np.searchsorted(ls, start, side="right")  # finished by each stretch's start
        left = np.concatenate([[0.0], np.cumsum(ps)])
        stretches.append((len(ls) - done, left[-1] - left[done]))
    shared = getattr(step_cost, "shared", None)
    total = sum(n for n, _ in stretches) if shared is not None else None
    for n, running_prompts in stretches:
        busy = n > 0
        # a step with fewer requests on the other ranks reads fewer of this rank's experts
        # than `step_cost` (every rank loaded alike) prices (`GroupStepCost.shared`)
        less = shared(n, total) if shared is not None else 0.0
        c0 = np.where(busy, step_cost(n, running_prompts + n * start) + less, 0.0)
        c1 = np.where(busy, step_cost(n, running_prompts + n * stop) + less, 0.0)
        p_start, p_end = np.maximum(p_start, c0), np.maximum(p_end, c1)
    clock = np.concatenate([[0.0], np.cumsum((stop - start) * (p_start + p_end) / 2)])
    return [float(clock[np.searchsorted(points, ls[-1])]) if len(ls) else 0.0 for ls in lens]


def lockstep_end(work: Sequence[Sequence[tuple[float, int]]], step_cost: StepCost) -> float:
    """A lockstep group's predicted end, seconds from now: work per rank [(remaining tokens,
    cached tokens)] of each of its running requests (`replica_finish`'s last rank; 0: none)."""
    return max(replica_finish([([n for n, _ in w], [c for _, c in w]) for w in work], step_cost),
               default=0.0)


def _worst_end(lengths: Sequence[Sequence[float]], prompt_lens: Sequence[Sequence[int]],
               cap: float, step_cost: StepCost, share: float = 0.0) -> float:
    """A lockstep replica's end (`replica_finish`) if `share` of its requests (rounded; at least
    one, its longest) ran to `cap`: taken evenly over its requests longest first, starting with
    the longest. One already predicted at the cap counts among them. lengths, prompt_lens: per
    rank."""
    lens = [list(ls) for ls in lengths]
    order = sorted(((n, r, i) for r, ls in enumerate(lens) for i, n in enumerate(ls)),
                   key=lambda x: -x[0])
    m = max(1, round(share * len(order))) if order else 0
    for j in range(m):
        _, r, i = order[j * len(order) // m]
        lens[r][i] = max(lens[r][i], cap)
    return max(replica_finish(list(zip(lens, prompt_lens)), step_cost), default=0.0)


def simulate_rank_steps(lengths: Sequence[float], prompt_lens: Sequence[int], kv_tokens: Optional[int],
                        max_batch: int, *, block_tokens: Optional[int] = None,
                        withheld: Sequence[tuple[int, int]] = ()) -> float:
    """Predicted steps for one rank to finish `lengths` (admitted in this order) under its KV room
    and batch limit: a small event simulation of the engine's admission (`rank_profile`)."""
    return rank_profile(lengths, prompt_lens, kv_tokens, max_batch, block_tokens=block_tokens,
                        withheld=withheld)[0]


def rank_profile(lengths: Sequence[float], prompt_lens: Sequence[int], kv_tokens: Optional[int],
                 max_batch: int, *, block_tokens: Optional[int] = None,
                 withheld: Sequence[tuple[int, int]] = ()) -> tuple[float, float]:
    """(steps to finish, peak KV tokens in use) of one rank: requests admitted in this order
    while a batch slot and KV room are free. The room is counted one of two ways:
    - `block_tokens` None: a request reserves prompt + response at admission;
    - blocks of `block_tokens` tokens: the engine's pool exactly (`pool_trace`: blocks taken as
      tokens are produced, admission over the watermark, the youngest preempted when the pool
      runs out), `kv_tokens` in whole blocks, less what borrowed experts take after a release
      (`withheld`: (after step t, blocks) each).
    The peak counts the tokens cached, which a decode step reads: where decoding is bound by
    memory bandwidth (accelerators), the step time of the lockstep group follows the fullest rank."""
    if not lengths:
        return 0.0, 0.0
    if block_tokens is not None:
        from flexfloor.rollout.kv import blocks_for, watermark_blocks

        capacity = None if kv_tokens is None else kv_tokens // block_tokens
        # every request's last block taken with the watermark still free: no wave, no preemption
        fits = capacity is None or sum(
            blocks_for(math.ceil(n - 1e-9) + p, block_tokens) for n, p in zip(lengths, prompt_lens)
        ) + sum(b for _, b in withheld) + watermark_blocks(capacity) <= capacity
        if not (fits and len(lengths) <= max_batch):
            t = pool_trace(lengths, prompt_lens, capacity, block_tokens, max_batch, withheld,
                           trace=False)
            return float(t.steps), t.peak
        lengths = [max(1, math.ceil(n - 1e-9)) for n in lengths]
    elif not (len(lengths) <= max_batch and (
            kv_tokens is None or sum(int(n) + p for n, p in zip(lengths, prompt_lens)) <= kv_tokens)):
        return _profile_by_events(lengths, prompt_lens, kv_tokens, max_batch)
    # everything admitted at once: just before the k-th longest finishes, it and every longer
    # one hold their prompt plus that many tokens
    peak, prompts = 0.0, 0
    ordered = sorted(zip((max(1.0, n) for n in lengths), prompt_lens), reverse=True)
    for k, (n, p) in enumerate(ordered, start=1):
        prompts += p
        peak = max(peak, prompts + k * n)
    return ordered[0][0], peak

@dataclass(frozen=True)
class PoolTrace:
    """A rank's predicted run through its KV block pool (`rank_profile` with blocks): steps to
    its local finish, the peak of cached tokens, and after each step t (index t - 1) the blocks in
    use, the requests queued and running, and the most tokens a running one may still produce:
    what the release decision sees of the rank at that boundary (`StepReport`)."""

    steps: int
    peak: float
    used: tuple[int, ...] = ()
    queued: tuple[int, ...] = ()
    running: tuple[int, ...] = ()
    remaining: tuple[int, ...] = ()


def pool_trace(lengths: Sequence[float], prompt_lens: Sequence[int], capacity: Optional[int],
               block_tokens: int, max_batch: int, withheld: Sequence[tuple[int, int]] = (),
               *, trace: bool = True) -> PoolTrace:
    """One rank's requests (admitted in this order) through the engine's KV block pool, step by
    step as `RolloutEngine.generate` runs them (flexfloor/rollout/kv.py): admission while a batch
    slot and the prefill's blocks are free over the watermark, each running request then takes
    the blocks its next token needs in admission order, and when the pool runs out the youngest
    is preempted (re-queued first; re-admitted later with prompt + what it had produced, its
    progress kept). `capacity`: the pool's blocks (None: unbounded); `withheld`: (after step t,
    blocks) borrowed experts take from the room from then on (a survivor after a release).
    Lengths are rounded up to whole tokens (at least one). Raises ValueError where the engine
    would fail: a request whose prefill does not fit with nothing running. `trace` False: the
    steps and peak only (`used` and `queued` left empty)."""
    from flexfloor.rollout.kv import watermark_blocks

    bt = block_tokens
    todo = [(max(1, math.ceil(n - 1e-9)), int(p)) for n, p in zip(lengths, prompt_lens)]
    # each request: [target length, prompt, tokens produced, blocks held]
    queue = deque([n, p, 0, 0] for n, p in todo)
    running: list[list[int]] = []
    mark = watermark_blocks(capacity)
    held = step = 0
    peak = 0.0
    extra = sorted(withheld)
    taken = 0  # blocks withheld so far
    used_after, queued_after, running_after, remaining_after = [], [], [], []
    while queue or running:
        while extra and extra[0][0] <= step:
            taken += extra.pop(0)[1]
        free = None if capacity is None else capacity - taken - held
        while queue and len(running) < max_batch:  # admit
            r = queue[0]
            need = -(-(r[1] + r[2]) // bt)
            if free is not None and free - need < (mark if running else 0):
                if not running:
                    raise ValueError(f"a request of {r[1] + r[2]} tokens needs {need} KV "
                                     f"blocks and only {free} are free with nothing running")
                break
            queue.popleft()
            r[3] = need
            held += need
            free = None if free is None else free - need
            running.append(r)
        i, preempted = 0, False
        while i < len(running):  # the blocks this step's tokens need, the youngest preempted
            r = running[i]
            need = -(-(r[1] + r[2]) // bt) - r[3]  # its context with the token it feeds
            if need <= 0 or free is None or free >= need:
                if need > 0:
                    r[3] += need
                    held += need
                    free = None if free is None else free - need
                i += 1
                continue
            victim = running.pop()
            held -= victim[3]
            free += victim[3]
            victim[3] = 0
            queue.appendleft(victim)
            preempted = True
        step += 1
        peak = max(peak, sum(r[1] + r[2] + 1 for r in running))
        still = []
        for r in running:  # forward: every running request samples one token
            r[2] += 1
            if r[2] >= r[0]:
                held -= r[3]
            else:
                still.append(r)
        finished = len(still) < len(running)
        running = still
        if trace:
            used_after.append(held)
            queued_after.append(len(queue))
            running_after.append(len(running))
            remaining_after.append(max((r[0] - r[2] for r in running), default=0))
        if finished or preempted or not running:
            continue
        # nothing finished or was preempted: until the next finish (or withheld room) nobody is
        # admitted either (the room only shrinks), so jump over the steps whose blocks fit
        jump = min(r[0] - r[2] for r in running) - 1
        if extra:
            jump = min(jump, extra[0][0] - step)

        def blocks_at(j: int) -> int:  # blocks held once the j-th step from here took its own
            return sum(-(-(r[1] + r[2] + j - 1) // bt) for r in running)

        if capacity is not None and jump > 1:
            lo, hi = 0, jump  # the largest j whose blocks fit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if blocks_at(mid) <= capacity - taken:
                    lo = mid
                else:
                    hi = mid - 1
            jump = lo
        if jump < 2:
            continue
        if trace:
            used_after.extend(blocks_at(j) for j in range(1, jump + 1))
            queued_after.extend([len(queue)] * jump)
            running_after.extend([len(running)] * jump)
            left = max(r[0] - r[2] for r in running)
            remaining_after.extend(left - j for j in range(1, jump + 1))
        for r in running:
            r[2] += jump
            r[3] = -(-(r[1] + r[2] - 1) // bt)
        held = sum(r[3] for r in running)
        step += jump
        peak = max(peak, sum(r[1] + r[2] for r in running))
    return PoolTrace(step, peak, tuple(used_after), tuple(queued_after), tuple(running_after),
                     tuple(remaining_after))


def _profile_by_events(lengths, prompt_lens, kv_tokens, max_batch) -> tuple[float, float]:
    """rank_profile by an event simulation of the admission (waves: KV room or slots short)."""
    running: list[tuple[float, float, int, int]] = []  # (finish, admitted, prompt, reserved)
    now = peak = 0.0
    used = 0
    pending = list(zip(lengths, prompt_lens))
    while pending or running:
        while pending and len(running) < max_batch:
            n, p = pending[0]
            need = int(n) + p
            if kv_tokens is not None and used + need > kv_tokens and running:
                break
            pending.pop(0)
            used += need
            running.append((now + max(1.0, n), now, p, need))
        nxt = min(r[0] for r in running)
        # just before the first of them finishes, every running request holds the most tokens
        peak = max(peak, sum(p + nxt - a for _, a, p, _ in running))
        now = nxt
        done = [r for r in running if r[0] <= nxt]
        running = [r for r in running if r[0] > nxt]
        used -= sum(r[3] for r in done)
    return now, peak


def least_outstanding(events: Sequence[tuple[str, str]], targets: int) -> dict[str, int]:
    """Route each submitted request to the target (replica, or rank of a replica) with the fewest
    outstanding requests at its submission, the lowest index on ties: verl's agent loop over its
    server replicas, and a data-parallel engine's balancing over its ranks.

    events: ("submit", request_id) or ("done", request_id) in time order; a request is
    outstanding from its submission to its "done". Returns {request_id: target index}. A rollout
    that submits its whole batch at once (no "done" before the last submit) is round robin.
    """
    if targets < 1:
        raise ValueError(f"targets={targets}: route to at least one")
    outstanding = [0] * targets
    where: dict[str, int] = {}
    for kind, rid in events:
        if kind == "submit":
            if rid in where:
                raise ValueError(f"request {rid!r} submitted twice")
            t = min(range(targets), key=lambda i: (outstanding[i], i))
            where[rid] = t
            outstanding[t] += 1
        elif kind == "done":
            if rid not in where:
                raise ValueError(f"request {rid!r} done before it was submitted")
            outstanding[where[rid]] -= 1
        else:
            raise ValueError(f"event {kind!r}: must be 'submit' or 'done'")
    return where


def _longest_first(groups: Sequence[PromptGroup], per_request: dict[str, float]) -> list[Request]:
    """The groups' requests in the order a rank admits them: longest predicted first."""
    reqs = [q for g in groups for q in g.requests]
    reqs.sort(key=lambda q: (-per_request[q.request_id], q.prompt_uid, q.sample_index))
    return reqs


def round_robin(reqs: Sequence[Request], replicas: Sequence[Sequence[int]]
                ) -> dict[int, list[Request]]:
    """`reqs` in order round robin over the replicas, then over each replica's ranks (least
    outstanding routing of a batch submitted at once). Returns rank -> requests."""
    out: dict[int, list[Request]] = {r: [] for g in replicas for r in g}
    for i, q in enumerate(reqs):
        g = replicas[i % len(replicas)]
        out[g[(i // len(replicas)) % len(g)]].append(q)
    return out


def _in_sample_order(groups: Sequence[PromptGroup]) -> list[Request]:
    """The groups' requests as a batch submits them: each group's samples in their own order,
    whatever order a plan holds them in (the oracle's plan holds them longest first)."""
    return [q for g in groups for q in sorted(g.requests, key=lambda q: q.sample_index)]


def _fill_replicas(order: Sequence[PromptGroup], replicas: Sequence[Sequence[int]], refusals: int,
                   accepts: Callable[[dict[int, list[Request]], list[int]], bool],
                   end_of: Callable[[dict[int, list[Request]]], object],
                   start: Optional[dict[int, list[Request]]] = None
                   ) -> dict[int, list[Request]]:
    """Groups in `order` onto the replicas, the first ones first: each group's samples spread
    over a replica's ranks (each to the rank with the fewest), kept where `accepts(trial, grown)`
    (trial: rank -> requests of the replica with the group; grown: its ranks that got samples);
    a replica that refuses `refusals` groups in a row is full. A group no replica accepts goes to
    the replica with the least `end_of(trial)`. `start`: requests already placed (rank ->
    requests). Returns rank -> requests."""
    placed: dict[int, list[Request]] = {r: list((start or {}).get(r, ())) for g in replicas
                                        for r in g}

    def spread(ranks, g) -> dict[int, list[Request]]:
        trial = {r: list(placed[r]) for r in ranks}
        for q in g.requests:
            trial[min(ranks, key=lambda r: (len(trial[r]), r))].append(q)
        return trial

    remaining = list(order)
    for ranks in replicas:
        left, refused = [], 0
        for k, g in enumerate(remaining):
            if refused >= refusals:
                left += remaining[k:]
                break
            trial = spread(ranks, g)
            if accepts(trial, [r for r in ranks if len(trial[r]) > len(placed[r])]):
                placed.update(trial)
                refused = 0
            else:
                left.append(g)
                refused += 1
        remaining = left
    for g in remaining:  # nothing in bound: the replica that finishes soonest with it
        placed.update(spread(min(replicas, key=lambda ranks: end_of(spread(ranks, g))), g))
    return placed


@dataclass
class Scheduler:
    """Places prompt groups on ranks for one rollout, and learns lengths from its results."""

    policy: PlacementPolicy
    history: LengthHistory = field(default_factory=LengthHistory)
    prior_quantile: float = 0.5
    memory: Optional[MemoryModel] = None
    max_batch_size: int = 64
    max_share: float = 2.0  # FlexFloor: most groups a rank takes, in fair shares
    # FlexFloor: a rank's predicted peak of cached KV tokens at most this times the baseline's
    # fullest rank's (None: no cap). On accelerators a decode step reads every cached token, and
    # the lockstep group steps at its fullest rank's pace: 1.0 keeps steps no slower than the
    # baseline's while the long work gathers on the ranks that stay.
    load_cap: Optional[float] = None
    # FlexFloor across replicas (with a step cost): a rank's predicted finish at most this times
    # the static baseline's predicted end (room for what the predictions miss)
    pace_margin: float = 0.9
    refusals: int = 16  # across replicas: a replica refusing this many groups in a row is full
    # FlexFloor across replicas by modelled seconds (a plan with a step cost): after a rollout
    # that proved the length history wrong (`LengthHistory.proved_wrong`), place the next as
    # the static baseline does (least outstanding requests over the replicas, then their
    # ranks), with no end to keep. There a replica's pace follows its load, so a plan packed by
    # a wrong history is what ends a rollout after static's, and no hand-over undoes it. The
    # history is judged again by each rollout, so the packing returns once it holds. Not by
    # predicted steps (no step cost, the trainer's plans): a step costs the same whatever its
    # batch, the plan keeps within static's predicted steps, and distrust there only cost
    # throughput (the simulator's tiny-cpu with history correlation 0.8: x2.00 -> x1.36, both
    # at static's steps)
    distrust_wrong_history: bool = True

    @property
    def predictor(self) -> Predictor:
        return Predictor(self.history, self.prior_quantile)

    def plan(self, groups: Sequence[PromptGroup], ranks: Sequence[int], *,
             replicas: Optional[Sequence[Sequence[int]]] = None,
             step_cost: Optional[StepCost] = None) -> RolloutPlan:
        """Place `groups` on `ranks`. FlexFloor with `step_cost` places across `replicas` (EP
        groups, default one of every rank) by modelled seconds (`_across_replicas`); without,
        by predicted steps over the ranks in order (`_flexfloor`)."""
        ranks = sorted(ranks)
        predicted, sources = {}, {"history": 0, "siblings": 0, "prior": 0, "default": 0}
        self._per_request = {}
        for g in groups:
            predicted[g.uid], src = self.predictor.predict(g.uid)
            sources[src] += 1
            # each sample's own estimate: the group's past lengths, longest first (the samples
            # of a prompt run on one rank, so which sample gets which length does not matter)
            past = sorted(self.history.last(g.uid) or [predicted[g.uid]], reverse=True)
            for i, req in enumerate(g.requests):
                self._per_request[req.request_id] = float(past[i % len(past)])
        bound = None
        distrusted = (self.policy == PlacementPolicy.FLEXFLOOR and step_cost is not None
                      and self.distrust_wrong_history and self.history.proved_wrong)
        if self.policy == PlacementPolicy.BASELINE:
            assignment = self._baseline(groups, ranks)
        elif distrusted:
            from flexfloor.rollout.replicas import route_least_outstanding

            groups_of = [tuple(sorted(g)) for g in replicas] if replicas else [tuple(ranks)]
            if sorted(r for g in groups_of for r in g) != ranks:
                raise ValueError(f"replicas {groups_of} must partition the ranks {ranks} exactly")
            assignment = route_least_outstanding(groups, groups_of)
            replicas = groups_of
        elif step_cost is not None:
            replicas = [sorted(g) for g in replicas] if replicas else [ranks]
            if sorted(r for g in replicas for r in g) != ranks:
                raise ValueError(f"replicas {replicas} must partition the ranks {ranks} exactly")
            assignment, bound = self._across_replicas(groups, replicas, predicted, step_cost)
        else:
            groups_of = [sorted(g) for g in replicas] if replicas else [ranks]
            if sorted(r for g in groups_of for r in g) != ranks:
                raise ValueError(f"replicas {groups_of} must partition the ranks {ranks} exactly")
            assignment, expected, bound = self._flexfloor(groups, ranks, predicted, groups_of)
        if step_cost is not None and self.policy != PlacementPolicy.BASELINE:
            expected = {}
            for g in replicas:
                expected.update(zip(g, self._finish([assignment[r] for r in g], step_cost)))
        elif self.policy == PlacementPolicy.BASELINE:
            expected = {r: self._profile(reqs)[0] for r, reqs in assignment.items()}
        return RolloutPlan(assignment, predicted, sources, expected, dict(self._per_request),
                           bound, distrusted, by_seconds=step_cost is not None
                           and self.policy != PlacementPolicy.BASELINE)

    def _finish(self, per_rank: Sequence[Sequence[Request]], step_cost: StepCost) -> list[float]:
        """Predicted seconds to each rank's finish in one lockstep group (`replica_finish`)."""
        return replica_finish([([self._per_request[q.request_id] for q in reqs],
                                [len(q.prompt_ids) for q in reqs]) for reqs in per_rank],
                              step_cost)

    def _across_replicas(self, groups, replicas, predicted, step_cost
                         ) -> tuple[dict[int, list[Request]], Optional[float]]:
        """FlexFloor over R replicas, bounded by modelled seconds. Prompt groups go longest
        predicted first to the replicas meant to stay (the lowest), their samples spread over the
        replica's ranks (siblings are alike: one rank holding a prompt's long samples together
        would step slowly for as long as they run), while the replica's end stays within the
        bound; a replica that refuses `refusals` groups in a row is full. So the replica of the
        longest work stays light and keeps the pace, one of short responses decodes large
        batches, and replicas leave in the planned order, the last ones early or at once.

        Hedged against mispredictions: a replica's end is taken as if as many of its requests
        ran to the cap as samples ran to it against their history (at least one, its longest;
        `LengthHistory.surprise_share`, the share `_flexfloor`'s hedge takes; `_worst_end`: any
        request may be one that does; a replica packed with short work then still ends in time,
        as its batch thins out before the long ones end; a replica of many requests holds more
        of the samples that run to the cap unforeseen),
        and a prompt with no history has its samples spread over the length quantiles seen so
        far (its prediction, one median for all, would model no tail). The bound: the static
        baseline's end (least outstanding requests: round robin over replicas, then ranks),
        taken the same way, times `pace_margin`, and no less than the longest request group
        alone; static's end is priced with the samples routed in their own order. A plan
        predicted to end after static's is static's routing instead, with no end to keep.
        Returns (rank -> requests, longest first; the bound in seconds, None for static's
        routing)."""
        kv = self.memory.kv_tokens() if self.memory else None
        est = dict(self._per_request)
        for g in groups:  # no history: the spread of lengths seen, not one value for all
            if not self.history.last(g.uid) and self.history.quantile(0.5) is not None:
                n = len(g.requests)
                for i, q in enumerate(g.requests):
                    est[q.request_id] = self.history.quantile(1.0 - (i + 0.5) / n)
        reqs_all = [q for g in groups for q in g.requests]
        cap = float(max((q.max_new_tokens for q in reqs_all), default=0))
        share = self.history.surprise_share(cap) if cap else 0.0

        # the bounds price every rank as if its group were loaded alike (`pace_margin` was set
        # against that: with the group's shared part, `GroupStepCost.shared`, the bound came
        # down and paper-like ended 1.2% after static); whether a prompt alone on one replica
        # ends past static is priced with it, where it tells one from the other
        grouped, step_cost = step_cost, getattr(step_cost, "per_rank", step_cost)

        def end(per_rank: Sequence[Sequence[Request]], step_cost=step_cost,
                worst: bool = False):
            """The predicted end; with `worst`, (it, the end if a share of its requests, its
            longest first, ran to the cap: `_worst_end`)"""
            lengths = [[est[q.request_id] for q in reqs] for reqs in per_rank]
            prompts = [[len(q.prompt_ids) for q in reqs] for reqs in per_rank]
            predicted = max(replica_finish(list(zip(lengths, prompts)), step_cost), default=0.0)
            return ((predicted, _worst_end(lengths, prompts, cap, step_cost, share)) if worst
                    else predicted)

        def ends(per_rank: Sequence[Sequence[Request]], step_cost=step_cost
                 ) -> tuple[float, float]:
            """(predicted end, worst end): `end` with `worst`"""
            return end(per_rank, step_cost, worst=True)

        # static routes the samples in their own order (routed longest first, as the oracle's
        # plan holds them, its bound was static's end with every prompt's longest sample on the
        # first replica: 1.5x static's with a tenth of them at the cap)
        static = round_robin(_in_sample_order(groups), replicas)
        static_ends = [ends([static[r] for r in g]) for g in replicas]
        static_end = tuple(max((e[k] for e in static_ends), default=0.0) for k in (0, 1))
        static_grouped = max((end([static[r] for r in g], grouped) for g in replicas),
                             default=0.0)
        bound = tuple(b * self.pace_margin for b in static_end)
        order = sorted(groups, key=lambda g: (-predicted[g.uid], g.uid))

        def alone(g: PromptGroup, step_cost=step_cost) -> tuple[float, float]:
            """`ends` of a group alone on a replica, its samples spread over the ranks."""
            per_rank: list[list[Request]] = [[] for _ in replicas[0]]
            for i, q in enumerate(g.requests):
                per_rank[i % len(per_rank)].append(q)
            return ends(per_rank, step_cost)

        # a prompt with no history has nothing to concentrate by: its samples go as static's
        # do (round robin over the replicas, then their ranks), which keeps the replicas'
        # loads alike; the prompts with history are placed around them
        start = round_robin([q for g in groups if not self.history.last(g.uid)
                              for q in g.requests], replicas)
        order = [g for g in order if self.history.last(g.uid)]

        def spread(g: PromptGroup, k: int) -> tuple[dict[int, list[Request]], tuple]:
            """g's samples round robin over the first k replicas, then their ranks, beside
            what is placed there: (rank -> requests, the latest of those replicas' `ends`)."""
            trial = {r: start[r] + reqs
                     for r, reqs in round_robin(_in_sample_order([g]), replicas[:k]).items()}
            return trial, max(ends([trial[r] for r in ranks], grouped)
                              for ranks in replicas[:k])

        # a prompt that alone on one replica would end past static's predicted end goes round
        # robin over the fewest of the replicas meant to stay that end it in time (all of them
        # if none do), before the others are placed: static holds its samples one to a replica,
        # and a lockstep step of fewer requests reads fewer experts (small seed 3 ended 2% after
        # static with the prompt's 8 samples two to a rank on one replica of 4)
        # (one replica: nowhere to spread to)
        while len(replicas) > 1 and order and alone(order[0], grouped)[0] > static_grouped:
            g = order.pop(0)
            for k in range(2, len(replicas) + 1):
                trial, got = spread(g, k)
                if got[0] <= static_grouped or k == len(replicas):
                    break
            start.update(trial)
            bound = tuple(max(b, e) for b, e in zip(bound, got))
        if order:  # the longest group alone, spread over a replica's ranks
            bound = tuple(max(b, e) for b, e in zip(bound, alone(order[0])))

        def fits(trial, _grown) -> bool:
            if max(len(v) for v in trial.values()) > self.max_batch_size:
                return False
            if kv is not None:
                for reqs in trial.values():
                    _, peak = rank_profile([est[x.request_id] for x in reqs],
                                           [len(x.prompt_ids) for x in reqs], None, len(reqs))
                    if peak > kv:
                        return False
            predicted_end, worst_end = ends(list(trial.values()))
            return predicted_end <= bound[0] and worst_end <= bound[1]

        placed = _fill_replicas(order, replicas, self.refusals, fits,
                                lambda trial: ends(list(trial.values())), start)
        # never a plan predicted to end after static: where little fits the bound, the groups
        # left over went whole to the replica that ends soonest, one sample to a rank in their
        # order, and could hold more long work to a rank than static does (the oracle with a
        # tenth of samples at the cap: 37% after static); static's routing then, with no end
        # to keep (as after distrust): the bound, below static's own predicted end, would have
        # the correction move static's work onto takers that then end late (held-out workloads
        # at seeds 10-19, every plan static's routing: 42 of 150 rollouts late with the bound,
        # 16 without)
        fallback = max(end([placed[r] for r in g], grouped) for g in replicas) > static_grouped
        if fallback:
            placed = static
        out = {}
        for rank, reqs in placed.items():
            out[rank] = sorted(reqs, key=lambda q: (-est[q.request_id], q.prompt_uid,
                                                    q.sample_index))
        return out, None if fallback else bound[0]

    @staticmethod
    def _baseline(groups, ranks) -> dict[int, list[Request]]:
        """verl-like: the batch in order, split into equal contiguous chunks (one per rank)."""
        reqs = [r for g in groups for r in g.requests]
        n = len(ranks)
        base, extra = divmod(len(reqs), n)
        out, start = {}, 0
        for i, rank in enumerate(ranks):
            size = base + (1 if i < extra else 0)
            out[rank] = reqs[start : start + size]
            start += size
        return out

    def _flexfloor(self, groups, ranks, predicted, replicas
                   ) -> tuple[dict[int, list[Request]], dict[int, float], float]:
        """FlexFloor by predicted steps (the CPU engine; the simulator at unit cost), never
        planned longer than static.

        The bound: the predicted end of the baseline users run (`route_least_outstanding` over
        the replicas, then their ranks; the same KV budget). Candidates place the longest
        predicted groups first on the ranks meant to stay (`_staggered`: rank after rank, each
        a shorter slice, so ranks leave one after another; `_filled`: replica after replica,
        balanced over its ranks, for groups that cannot shrink under their memory floor). A
        candidate counts only if every rank's predicted finish (`_releases`: the engine's block
        pool, borrowed experts withheld after each planned release) stays within the bound and,
        with `load_cap`, its peak KV load within the cap; of those, the one with the fewest
        predicted occupied steps wins. When none fits, the plan is the baseline's placement.
        Returns (rank -> requests, rank -> predicted local finish, the bound in steps)."""
        from flexfloor.rollout.replicas import route_least_outstanding

        for g in groups:  # a group's past lengths over its samples, rotated by prompt: spread
            # over ranks (sample i of every prompt to the same rank, as round robin does), the
            # longest past length of each prompt must not all land on one rank
            past = sorted(self.history.last(g.uid) or [predicted[g.uid]], reverse=True)
            for i, q in enumerate(g.requests):
                self._per_request[q.request_id] = float(past[(i + g.uid) % len(past)])
        static = route_least_outstanding(groups, [tuple(g) for g in replicas])
        static_finish, static_release = self._releases(static, replicas)
        cap = float(max((q.max_new_tokens for g in groups for q in g.requests), default=0))
        share = self.history.surprise_share(cap) if cap else 0.0
        longest = max(self._per_request.values(), default=0.0)

        bounded = self.memory is not None and self.memory.kv_budget_bytes is not None

        def margin(end: float, alone: float) -> float:
            """Room for what the predictions miss (`pace_margin`), but where no KV budget binds
            and the baseline's end is its longest request alone, that end exactly (no other
            request can delay it there)."""
            return end if end <= alone and not bounded else end * self.pace_margin

        # hedged: the same as if a share of each rank's requests ran to the cap as often as
        # samples ran to it against their history
        bound = (margin(max(static_finish.values(), default=0.0), longest),
                 margin(max((self._hedged(reqs, share, cap) for reqs in static.values()),
                            default=0.0), cap if share else longest))
        order = sorted(groups, key=lambda g: (-predicted[g.uid], g.uid))
        peak_bound = None
        if self.load_cap is not None:  # the baseline chunks' fullest rank (`load_cap`)
            peak_bound = self.load_cap * max(
                (self._profile(reqs)[1] for reqs in self._baseline(groups, ranks).values()),
                default=0.0)

        def within(reqs: Sequence[Request]) -> bool:
            """`reqs` (in admission order) on one rank keep its predicted and hedged finish
            within the bound, and its peak within `load_cap`."""
            steps, peak = self._profile(reqs)
            return (steps <= bound[0] and (peak_bound is None or peak <= peak_bound)
                    and self._hedged(reqs, share, cap) <= bound[1])

        best, best_occupied = (static, static_finish), sum(static_release.values())
        for candidate in (self._staggered(order, ranks, within),
                          self._filled(order, replicas, within)):
            finish, release = self._releases(candidate, replicas)
            if max(finish.values(), default=0.0) > bound[0]:
                continue
            if not all(within(reqs) for reqs in candidate.values() if reqs):
                continue
            if sum(release.values()) < best_occupied:
                best, best_occupied = (candidate, finish), sum(release.values())
        return best[0], best[1], bound[0]

    def _profile(self, reqs: Sequence[Request], withheld: Sequence[tuple[int, int]] = (),
                 lengths: Optional[Sequence[float]] = None) -> tuple[float, float]:
        """(predicted steps, peak cached tokens) of one rank running `reqs` in this order: the
        engine's block pool under the memory model's budget (`rank_profile`); `lengths`
        instead of the predicted ones."""
        m = self.memory
        kv = m.kv_tokens() if m else None
        if lengths is None:
            lengths = [self._per_request[q.request_id] for q in reqs]
        return rank_profile(lengths, [len(q.prompt_ids) for q in reqs], kv, self.max_batch_size,
                            block_tokens=m.block_tokens if kv is not None else None,
                            withheld=withheld)

    def _hedged(self, reqs: Sequence[Request], share: float, cap: float) -> float:
        """Predicted steps of one rank if `share` of its requests (rounded) ran to `cap` against
        their predictions: those spread evenly over the admission order among the requests
        predicted below the cap (a sample that runs long costs a rank in proportion to how many
        requests it runs, and where it is admitted)."""
        lengths = [self._per_request[q.request_id] for q in reqs]
        short = [i for i, n in enumerate(lengths) if n < cap]
        m = min(len(short), round(share * len(reqs)))
        for j in range(m):
            lengths[short[int((j + 0.5) * len(short) / m)]] = cap
        return self._profile(reqs, lengths=lengths)[0]

    def _releases(self, assignment: dict[int, list[Request]], replicas
                  ) -> tuple[dict[int, float], dict[int, float]]:
        """Predicted (local finish, release) step of every rank. Inside each replica the ranks
        leave in order of their finish, each at the first step boundary where the release
        decision's memory rule (`release.capacity_now`, `plan_shrink`) lets the survivors host
        its experts; each survivor's KV room then shrinks by what it borrows (withheld in
        whole blocks, as the engine's pool does), which may delay its own finish. A rank the
        floor holds leaves with the last of its replica. Without a KV budget or the expert
        count (`MemoryModel.num_experts`) every rank leaves at its finish."""
        m = self.memory
        finish = {r: self._profile(reqs)[0] for r, reqs in assignment.items()}
        if m is None or m.kv_budget_bytes is None or not m.num_experts:
            return finish, dict(finish)
        from types import SimpleNamespace

        from flexfloor.rollout.kv import blocks_for
        from flexfloor.rollout.release import RankLimits, ReleaseRules, capacity_now
        from megatron_ext.placement import balanced_placement, plan_shrink

        capacity = m.kv_budget_bytes // m.block_bytes
        limits = RankLimits(kv_bytes_per_token=m.kv_bytes_per_token, max_seq_len=0,
                            max_batch_size=self.max_batch_size, kv_budget_bytes=m.kv_budget_bytes,
                            expert_nbytes=m.expert_bytes)
        release = {}
        for group in replicas:
            group = sorted(group)
            withheld: dict[int, list[tuple[int, int]]] = {r: [] for r in group}

            def trace(r):
                reqs = assignment[r]
                return pool_trace([self._per_request[q.request_id] for q in reqs],
                                  [len(q.prompt_ids) for q in reqs], capacity, m.block_tokens,
                                  self.max_batch_size, withheld[r])

            traces = {r: trace(r) for r in group}
            placement = balanced_placement(m.num_experts, group)
            active = list(group)
            while len(active) > 1:
                leaver = min(active, key=lambda r: (traces[r].steps, -r))
                survivors = [r for r in active if r != leaver]
                end = max(traces[r].steps for r in active)
                at, plan = end, None
                for t in range(traces[leaver].steps, end):  # the first boundary that lets it go
                    report = SimpleNamespace(kv_free=[], queued=[], running=[], remaining=[])
                    for r in placement.ranks:  # what the ranks share after step t
                        tr, room = traces[r], capacity - sum(b for s, b in withheld[r] if s <= t)
                        used, queued, running, remaining = (
                            (0, len(assignment[r]), 0, 0) if t == 0 else
                            (tr.used[t - 1], tr.queued[t - 1], tr.running[t - 1],
                             tr.remaining[t - 1]) if t < tr.steps else (0, 0, 0, 0))
                        report.kv_free.append((room - used) * m.block_bytes)
                        report.queued.append(queued)
                        report.running.append(running)
                        report.remaining.append(remaining)
                    try:
                        plan = plan_shrink(placement, [leaver], capacity=capacity_now(
                            ReleaseRules(), placement, report, limits))
                    except ValueError:
                        continue
                    at = t
                    break
                release[leaver] = float(at)
                active = survivors
                if plan is None:  # the floor holds it to the end: the others leave with it
                    continue
                placement, transfers = plan
                got: dict[int, int] = {}
                for tr in transfers:
                    got[tr.dst] = got.get(tr.dst, 0) + 1
                for r, n in got.items():
                    withheld[r].append((at, blocks_for(n * m.expert_bytes, m.block_bytes)))
                    try:
                        traces[r] = trace(r)
                    except ValueError:  # its pool could not admit a prefill: hold everyone
                        traces[r] = PoolTrace(int(end), 0.0)
                    finish[r] = float(traces[r].steps)
            for r in active:
                release[r] = float(max([traces[x].steps for x in group]))
            for r in group:
                release[r] = max(release[r], finish[r])
        return finish, release

    def _staggered(self, order, ranks, within: Callable[[Sequence[Request]], bool]
                   ) -> dict[int, list[Request]]:
        """Longest predicted groups on the ranks meant to stay (the lowest), each later rank a
        shorter slice, so ranks leave one after another: a rank takes at most `max_share` fair
        shares of the groups, and only while it stays `within` the bound; what no rank takes
        goes where the finish stays lowest."""

        def fits(gs):
            return within(_longest_first(gs, self._per_request))

        assigned: dict[int, list[PromptGroup]] = {r: [] for r in ranks}
        remaining = list(order)
        for i, rank in enumerate(ranks):
            left_ranks = len(ranks) - i
            # at most `max_share` fair shares: the staying ranks take more of the long work (so
            # more ranks leave early), but a lockstep step costs what the fullest rank's batch
            # costs, so piling everything on them would slow every step
            share_cap = max(1, int(self.max_share * math.ceil(len(remaining) / left_ranks)))
            taken = []
            for g in list(remaining):
                if len(taken) >= share_cap:
                    break
                if taken and not fits(taken + [g]):
                    continue
                taken.append(g)
            for g in taken:
                remaining.remove(g)
            assigned[rank] = taken
        self._place_rest(assigned, remaining, ranks, within)
        return {r: _longest_first(gs, self._per_request) for r, gs in assigned.items()}

    def _filled(self, order, replicas, within: Callable[[Sequence[Request]], bool]
                ) -> dict[int, list[Request]]:
        """Longest predicted groups on the replicas meant to stay (the lowest), each group's
        samples spread over the replica's ranks (each to the rank with the fewest requests: a
        rank holding a long prompt's samples together would run them in waves under a tight KV
        budget), while every rank of it stays `within` the bound; a replica that refuses
        `refusals` groups in a row is full. The ranks of a replica end together: where the
        memory floor keeps a replica from shrinking, only whole replicas leave early."""

        def longest_first(reqs) -> list[Request]:
            return _longest_first([PromptGroup(-1, tuple(reqs))], self._per_request)

        placed = _fill_replicas(
            order, [sorted(x) for x in replicas], self.refusals,
            lambda trial, grown: all(within(longest_first(trial[r])) for r in grown),
            lambda trial: max(self._profile(longest_first(reqs))[0] for reqs in trial.values()))
        return {r: longest_first(reqs) for r, reqs in placed.items()}

    def _place_rest(self, assigned: dict[int, list[PromptGroup]], remaining, ranks,
                    within: Callable[[Sequence[Request]], bool]) -> None:
        """Groups no rank took within the caps: each to the rank whose predicted finish stays
        lowest with it, among those still `within` the bound if any (never all onto the last
        rank)."""
        for g in remaining:
            def cost(r):
                reqs = _longest_first(assigned[r] + [g], self._per_request)
                steps, peak = self._profile(reqs)
                return (not within(reqs), steps, peak, len(assigned[r]), -r)
            assigned[min(ranks, key=cost)].append(g)

    def observe(self, results: Iterable) -> None:
        self.history.record_results(results)

    def state_dict(self) -> dict:
        return {"history": self.history.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.history = LengthHistory.from_state_dict(state["history"])
