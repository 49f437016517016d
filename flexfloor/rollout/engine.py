"""In-process generation on the training weights: data-parallel attention, expert-parallel MoE.

Each rank decodes its own requests; every MoE layer exchanges tokens with the expert owners over
the EP group, so all ranks of the group step in lockstep. The engine runs Megatron-Core's own
modules of the `GPTModel` (embedding, layer norms, QKV/projection linears, rotary embedding, the
MoE layer with its router and experts, the output layer) but keeps its own per-request KV cache:
Megatron's static inference context holds one sequence offset for the whole batch and cannot
batch requests at different positions (continuous batching).

Per-request determinism: positions are per request (no padding), attention reads only the
request's own cache, sampling draws from the request's own RNG stream. The only math shared by
requests is the expert matmul over the tokens routed to an expert, which is row-independent (CPU
BLAS may still sum in another order for another batch shape: the last bit of a logit; tests that
compare batch compositions run in float64).

A step:   admit (slots + KV budget) -> one forward over all new tokens of this rank
          -> sample one token per running request -> finish/evict -> step boundary
The step boundary is where the membership decides who goes on: `StaticMembership` (the verl-like
baseline) keeps every rank stepping, with empty batches when it has no work, until all are done.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flexfloor.rollout.types import FinishReason, RankRecord, Request, Result, SamplingParams


class RolloutError(RuntimeError):
    """A request or rollout the engine refuses or cannot finish; the message names it."""


class CollectiveError(RolloutError):
    """A collective of the rollout failed or timed out (a peer died or hangs)."""


@contextlib.contextmanager
def collective_phase(rank: int, phase: str, step: int | None = None):
    """Turn a failed or timed-out collective into an error naming the rank, phase and step.

    Every group is created with a timeout (parallel.timeout_s), so a hang ends as an error here
    instead of waiting forever; the launcher then sees the process exit non-zero.
    """
    try:
        yield
    except RolloutError:
        raise
    except (RuntimeError, dist.DistError) as e:
        where = f"rank {rank}, phase '{phase}'" + (f", engine step {step}" if step is not None else "")
        raise CollectiveError(f"{where}: collective failed ({type(e).__name__}: {e})") from e


# --------------------------------------------------------------------------------------------
# KV cache


def kv_bytes_per_token(model_config) -> int:
    """Bytes of K and V one token holds over all layers (Megatron TransformerConfig)."""
    head_dim = model_config.kv_channels or model_config.hidden_size // model_config.num_attention_heads
    groups = model_config.num_query_groups or model_config.num_attention_heads
    elem = torch.empty((), dtype=model_config.params_dtype).element_size()
    return 2 * model_config.num_layers * groups * head_dim * elem


class KVCache:
    """One request's keys and values for every layer, allocated for its whole reservation."""

    def __init__(self, num_layers: int, capacity: int, groups: int, head_dim: int, dtype, device):
        self.k = torch.empty(num_layers, capacity, groups, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0  # tokens whose K/V are stored

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


# --------------------------------------------------------------------------------------------
# membership: who keeps stepping


@dataclass
class StepReport:
    """What ranks share at a step boundary (one small all-gather)."""

    has_work: list[bool]
    finished: int  # responses finished, all ranks
    tokens: int  # response tokens produced, all ranks
    requests: int  # responses asked for, all ranks
    running: list[int]  # per rank of the group: requests decoding now
    queued: list[int]  # per rank: requests waiting for admission
    remaining: list[int]  # per rank: most tokens a running request may still produce
    kv_free: list[int]  # per rank: KV bytes free


class Membership(Protocol):
    """Decides at each step boundary whether this rank keeps stepping."""

    def step_boundary(self, engine: "RolloutEngine", has_work: bool) -> tuple[bool, StepReport]:
        """Returns (keep_stepping, report). Called by every active rank after every step."""
        ...


def share_step_state(group, has_work: bool, engine: "RolloutEngine") -> StepReport:
    mine = torch.tensor(
        [int(has_work), engine.finished_count, engine.token_count, engine.request_count,
         len(engine.running), len(engine.queue), engine.remaining_bound(), engine.kv_free_bytes()],
        dtype=torch.int64,
    )
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    table = torch.stack(parts)
    return StepReport(
        has_work=[bool(x) for x in table[:, 0].tolist()],
        finished=int(table[:, 1].sum()),
        tokens=int(table[:, 2].sum()),
        requests=int(table[:, 3].sum()),
        running=table[:, 4].tolist(),
        queued=table[:, 5].tolist(),
        remaining=table[:, 6].tolist(),
        kv_free=table[:, 7].tolist(),
    )


class StaticMembership:
    """Static EP (the baseline): a rank with nothing left still enters every step's collectives
    (empty batches) until no rank of the group has work."""

    def step_boundary(self, engine, has_work):
        report = share_step_state(engine.moe.group, has_work, engine)
        return any(report.has_work), report

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# sampling


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """Pick one token from logits [V]; returns (token, its log-prob at the sampling temperature).

    The log-prob is under the temperature-scaled distribution before top-k/top-p filtering: the
    quantity the trainer recomputes for the importance ratio. Greedy reports it at temperature 1.
    """
    logits = logits.double()
    if params.greedy or params.temperature == 0.0:
        token = int(torch.argmax(logits))
        return token, float(F.log_softmax(logits, dim=-1)[token])
    scaled = logits / params.temperature
    logprobs = F.log_softmax(scaled, dim=-1)
    filtered = scaled.clone()
    if params.top_k > 0 and params.top_k < filtered.numel():
        kth = torch.topk(filtered, params.top_k).values[-1]
        filtered[filtered < kth] = -math.inf
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already cover top_p
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        filtered[order[drop]] = -math.inf
    probs = torch.softmax(filtered, dim=-1)
    token = int(torch.multinomial(probs, 1, generator=gen))
    return token, float(logprobs[token])


# --------------------------------------------------------------------------------------------
# the engine


@dataclass
class _Running:
    request: Request
    cache: KVCache
    gen: torch.Generator
    admitted_s: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # tokens to feed at the next step

    @property
    def position(self) -> int:
        return self.cache.length


@dataclass
class RolloutOutput:
    results: list[Result]
    record: RankRecord


class RolloutEngine:
    """Token-only generation on a Megatron-Core `GPTModel` (the trainer's own weights).

    Lifecycle: build once per model; `generate()` per rollout. KV caches live only inside one
    `generate()` call and are freed when it returns.
    """

    def __init__(
        self,
        model,
        moe,
        *,
        rank: int,
        max_batch_size: int = 64,
        kv_budget_bytes: Optional[int] = None,
        progress: bool = False,
        valid_vocab: Optional[int] = None,
    ):
        self.model = model
        self.moe = moe  # megatron_ext.elastic_moe.PlacedMoE over the current EP group
        self.config = model.config
        self.rank = rank
        self.max_batch_size = max_batch_size
        self.kv_budget_bytes = kv_budget_bytes
        self.progress = progress
        # the tokenizer's vocabulary when the model's is padded beyond it: never sample padding
        self.valid_vocab = valid_vocab
        self.max_seq_len = model.max_sequence_length
        cfg = self.config
        self.head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.groups = cfg.num_query_groups or cfg.num_attention_heads
        self.heads = cfg.num_attention_heads
        self.device = next(model.parameters()).device
        self.dtype = cfg.params_dtype
        self.kv_bytes_per_token = kv_bytes_per_token(cfg)
        self._freqs = None
        # per-rollout counters read by the membership
        self.finished_count = 0
        self.token_count = 0
        self.request_count = 0
        self.running: list[_Running] = []
        self.queue: deque[Request] = deque()
        self.kv_used = 0

    # ---------------------------------------------------------------- validation

    def check_requests(self, requests: Sequence[Request]) -> None:
        seen = set()
        vocab = self.model.vocab_size
        for r in requests:
            if r.request_id in seen:
                raise RolloutError(f"request {r.request_id} appears twice in one rollout")
            seen.add(r.request_id)
            if not r.prompt_ids:
                raise RolloutError(f"request {r.request_id} has an empty prompt")
            if len(r.prompt_ids) >= self.max_seq_len:
                raise RolloutError(
                    f"request {r.request_id}: prompt of {len(r.prompt_ids)} tokens does not fit the "
                    f"context of {self.max_seq_len} (model.max_seq_len); shorten it or raise "
                    "data.max_prompt_len / model.max_seq_len"
                )
            if r.max_total_tokens > self.max_seq_len:
                raise RolloutError(
                    f"request {r.request_id}: prompt {len(r.prompt_ids)} + up to "
                    f"{r.max_total_tokens - len(r.prompt_ids)} new tokens exceeds the context of "
                    f"{self.max_seq_len} (model.max_seq_len); lower rollout.max_new_tokens"
                )
            bad = [t for t in r.prompt_ids if not 0 <= t < vocab]
            if bad:
                raise RolloutError(f"request {r.request_id}: token ids {bad[:5]} outside vocab {vocab}")
            if self.kv_budget_bytes is not None:
                need = r.max_total_tokens * self.kv_bytes_per_token
                if need > self.kv_budget_bytes:
                    raise RolloutError(
                        f"request {r.request_id} needs {need} bytes of KV cache alone, more than the "
                        f"rank's budget of {self.kv_budget_bytes} (rollout.kv_budget_tokens); raise "
                        "the budget or lower rollout.max_new_tokens"
                    )

    def _check_on_every_rank(self, requests: Sequence[Request]) -> None:
        """Validate locally, then agree: a request one rank refuses fails the rollout on every
        rank at once (instead of leaving the others waiting in a collective)."""
        try:
            self.check_requests(requests)
            problem = None
        except RolloutError as e:
            problem = str(e)
        group = self.moe.group
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
        ranks = dist.get_process_group_ranks(group)
        bad = [f"rank {r}: {p}" for r, p in zip(ranks, problems) if p is not None]
        if bad:
            raise RolloutError("rollout refused; " + "; ".join(bad))

    # ---------------------------------------------------------------- forward

    def _rotary(self, positions: torch.Tensor) -> torch.Tensor:
        if self._freqs is None:
            self._freqs = self.model.rotary_pos_emb(self.max_seq_len)  # [S, 1, 1, D]
        return self._freqs[positions]

    @torch.no_grad()
    def forward(self, segments: list[tuple[KVCache, list[int]]]) -> torch.Tensor:
        """One forward over the new tokens of several requests; returns the logits of each
        segment's last token [n_segments, V]. Appends the new K/V to each cache.

        Every rank of the EP group must call this once per step, even with no segments: the MoE
        all-to-all needs all of them.
        """
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        if not segments:
            return self._empty_step()
        ids, pos, lens = [], [], []
        for cache, toks in segments:
            ids.extend(toks)
            pos.extend(range(cache.length, cache.length + len(toks)))
            lens.append(len(toks))
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device).view(1, -1)
        x = self.model.embedding(input_ids=tokens, position_ids=positions)  # [T, 1, H]
        freqs = self._rotary(positions[0])  # [T, 1, 1, D]
        for li, layer in enumerate(self.model.decoder.layers):
            attn = layer.self_attention
            h = layer.input_layernorm(x)
            q, k, v = attn.get_query_key_value_tensors(h, None)[:3]  # [T, 1, heads|groups, D]
            q = apply_rotary_pos_emb(q, freqs, config=self.config)
            k = apply_rotary_pos_emb(k, freqs, config=self.config)
            out = torch.empty(q.shape[0], self.heads * self.head_dim, dtype=q.dtype, device=q.device)
            start = 0
            for (cache, _), n in zip(segments, lens):
                p0 = cache.length
                cache.k[li, p0 : p0 + n] = k[start : start + n, 0]
                cache.v[li, p0 : p0 + n] = v[start : start + n, 0]
                out[start : start + n] = self._attend(
                    q[start : start + n, 0], cache.k[li, : p0 + n], cache.v[li, : p0 + n], p0,
                    attn.core_attention.softmax_scale,
                )
                start += n
            proj, bias = attn.linear_proj(out.unsqueeze(1))
            x = x + (proj if bias is None else proj + bias)
            x = x + self.moe.forward(li, layer.pre_mlp_layernorm(x))
        for cache, n in zip((c for c, _ in segments), lens):
            cache.length += n
        last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))], device=self.device)
        h = self.model.decoder.final_layernorm(x[last])
        logits, _ = self.model.output_layer(h)
        logits = logits[:, 0, : self.valid_vocab]
        return logits.float() if logits.dtype != torch.float64 else logits

    def _empty_step(self) -> torch.Tensor:
        """A step with no own tokens: still enter every MoE layer's all-to-all, with 0 tokens."""
        x = torch.empty(0, 1, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for li in range(len(self.model.decoder.layers)):
            self.moe.forward(li, x)
        return torch.empty(0, self.model.vocab_size, device=self.device)

    def _attend(self, q, k, v, p0: int, scale: float) -> torch.Tensor:
        """Causal attention of n new queries at positions p0.. over the cache [p0+n, G, D]."""
        n = q.shape[0]
        rep = self.heads // self.groups
        kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, L, D]
        vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
        qq = q.transpose(0, 1)  # [heads, n, D]
        scores = torch.matmul(qq, kk.transpose(1, 2)) * scale  # [heads, n, L]
        if n > 1:
            qpos = torch.arange(p0, p0 + n, device=q.device).view(n, 1)
            kpos = torch.arange(p0 + n, device=q.device).view(1, -1)
            scores = scores.masked_fill(kpos > qpos, -math.inf)
        low = q.dtype in (torch.float16, torch.bfloat16)  # softmax in fp32 for half types
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if low else q.dtype).to(q.dtype)
        return torch.matmul(probs, vv).transpose(0, 1).reshape(n, -1)  # [n, heads*D]

    # ---------------------------------------------------------------- generate

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], membership: Membership) -> RolloutOutput:
        """Generate every request of this rank; returns exactly one result per request.

        All ranks of the EP group (`self.moe.group`) must call it together (with their own requests, possibly
        none). Requests are admitted in the order given when a slot and KV room are free.
        """
        with collective_phase(self.rank, "request check"):
            self._check_on_every_rank(requests)
        self.model.eval()
        t0 = self._t0 = time.perf_counter()
        record = self.record = RankRecord(rank=self.rank, requests=len(requests))
        self.queue: deque[Request] = deque(requests)
        self.running: list[_Running] = []
        self.kv_used = 0
        self.migrated_out: list[str] = []  # request ids handed to another rank
        self.adopted: list[Request] = []  # requests taken over from another rank
        results: list[Result] = []
        self.finished_count = self.token_count = 0
        self.request_count = len(requests)
        bar = self._progress_bar()
        with collective_phase(self.rank, "rollout start", 0):
            keep, report = membership.step_boundary(self, self.has_work)  # nobody has work: no step
        while keep:
            # admit while a slot and KV room are free (longest-first order is the caller's)
            while self.queue and len(self.running) < self.max_batch_size:
                need = self.queue[0].max_total_tokens * self.kv_bytes_per_token
                if self.kv_budget_bytes is not None and self.kv_used + need > self.kv_budget_bytes:
                    if not self.running:  # nothing will free room: fail instead of spinning
                        raise RolloutError(
                            f"rank {self.rank}: request {self.queue[0].request_id} needs {need} KV "
                            f"bytes and only {self.kv_budget_bytes - self.kv_used} are free with "
                            "nothing running (borrowed experts hold the rest); raise "
                            "rollout.kv_budget_tokens or elastic.min_active_ranks")
                    break
                req = self.queue.popleft()
                self._start(req, req.generator(), pending=list(req.prompt_ids))
            record.kv_peak_bytes = max(record.kv_peak_bytes, self.kv_used)

            running = self.running
            with collective_phase(self.rank, "decode (MoE all-to-all)", record.steps):
                logits = self.forward([(r.cache, r.pending) for r in running])
            record.steps += 1
            if running:
                record.busy_steps += 1
            now = time.perf_counter() - t0
            still = []
            for row, r in zip(logits, running):
                token, logprob = sample_token(row, r.request.sampling, r.gen)
                r.tokens.append(token)
                r.logprobs.append(logprob)
                r.pending = [token]
                reason = self._finish_reason(r, token)
                if reason is None:
                    still.append(r)
                    continue
                results.append(Result(
                    request_id=r.request.request_id, prompt_uid=r.request.prompt_uid,
                    sample_index=r.request.sample_index, prompt_ids=r.request.prompt_ids,
                    token_ids=r.tokens, logprobs=r.logprobs, finish_reason=reason,
                    rank=self.rank, admitted_s=r.admitted_s, finished_s=now,
                ))
                self.kv_used -= r.cache.nbytes
                record.local_finish_s = now
                record.extra["local_finish_step"] = record.steps
                self.finished_count += 1
            self.token_count += len(running)
            record.tokens += len(running)
            self.running = still
            with collective_phase(self.rank, "step boundary (release)", record.steps):
                keep, report = membership.step_boundary(self, self.has_work)
            if bar is not None:
                bar.total = report.requests
                bar.set_postfix(tok_s=f"{report.tokens / max(now, 1e-9):.0f}",
                                active=len(report.has_work), refresh=False)
                bar.update(report.finished - bar.n)
        if "release_step" not in record.extra:  # not released early: occupied to the end
            record.release_s = time.perf_counter() - t0
            record.extra["release_step"] = record.steps
        if bar is not None:
            bar.close()
        if self.has_work:
            raise RolloutError(
                f"rank {self.rank} left the rollout with {len(self.running)} running and "
                f"{len(self.queue)} queued requests"
            )
        # an adopted request may move on again (to a rank that stays longer): owed by that one
        gone = set(self.migrated_out)
        owed = [r for r in list(requests) + self.adopted if r.request_id not in gone]
        self._check_complete(owed, results)
        self.running, self.queue = [], deque()
        return RolloutOutput(results=results, record=record)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.queue)

    def _start(self, req: Request, gen: torch.Generator, *, pending: list[int],
               tokens=(), logprobs=(), admitted_s: Optional[float] = None) -> None:
        cache = KVCache(len(self.model.decoder.layers), req.max_total_tokens, self.groups,
                        self.head_dim, self.dtype, self.device)
        self.kv_used += cache.nbytes
        self.running.append(_Running(
            req, cache, gen, self.elapsed() if admitted_s is None else admitted_s,
            tokens=list(tokens), logprobs=list(logprobs), pending=pending))

    # ---------------------------------------------------------------- migration

    def export_running(self) -> list[dict]:
        """Hand over every running request (the queue must be empty): its tokens so far and
        its RNG stream's state. This rank then has no work and can be released."""
        if self.queue:
            raise RolloutError(f"rank {self.rank}: cannot migrate with {len(self.queue)} queued")
        out = [{"request": r.request, "tokens": r.tokens, "logprobs": r.logprobs,
                "gen_state": r.gen.get_state(), "admitted_s": r.admitted_s}
               for r in self.running]
        for r in self.running:
            self.kv_used -= r.cache.nbytes
            self.migrated_out.append(r.request.request_id)
        self.running = []
        self.record.extra["migrated_out"] = self.record.extra.get("migrated_out", 0) + len(out)
        return out

    def adopt(self, payloads: list[dict]) -> None:
        """Continue requests another rank started: re-prefill prompt + tokens so far, then keep
        sampling from the same RNG stream, so the tokens are those the other rank would have
        produced."""
        for p in payloads:
            gen = torch.Generator(device="cpu")
            gen.set_state(p["gen_state"])
            req = p["request"]
            self._start(req, gen, pending=list(req.prompt_ids) + list(p["tokens"]),
                        tokens=p["tokens"], logprobs=p["logprobs"], admitted_s=p["admitted_s"])
            self.adopted.append(req)
        self.record.extra["adopted"] = self.record.extra.get("adopted", 0) + len(payloads)

    def kv_free_bytes(self) -> int:
        if self.kv_budget_bytes is None:
            return 1 << 62
        return self.kv_budget_bytes - self.kv_used

    def remaining_bound(self) -> int:
        """Most tokens any running request of this rank may still produce (its reservation)."""
        return max((r.request.max_total_tokens - len(r.request.prompt_ids) - len(r.tokens)
                    for r in self.running), default=0)

    def elapsed(self) -> float:
        """Seconds since this rollout started on this rank."""
        return time.perf_counter() - self._t0

    @staticmethod
    def _finish_reason(r: _Running, token: int) -> Optional[FinishReason]:
        req = r.request
        n = len(r.tokens)
        if req.target_len is not None:
            return FinishReason.TARGET if n >= req.target_len else None
        if req.sampling.eos_id is not None and token == req.sampling.eos_id:
            return FinishReason.EOS
        if token in req.sampling.stop_token_ids:
            return FinishReason.STOP
        if n >= req.max_new_tokens:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _check_complete(requests: Sequence[Request], results: list[Result]) -> None:
        want = sorted(r.request_id for r in requests)
        got = sorted(r.request_id for r in results)
        if want != got:
            missing = sorted(set(want) - set(got))
            extra = [g for g in got if got.count(g) > 1 or g not in want]
            raise RolloutError(f"rollout results do not match requests: missing {missing[:5]}, "
                               f"duplicated or unknown {sorted(set(extra))[:5]}")

    def _progress_bar(self):
        if not self.progress or self.rank != 0:
            return None
        from tqdm import tqdm

        return tqdm(desc="rollout", unit="resp", total=None, leave=False, dynamic_ncols=True,
                    mininterval=1.0)
