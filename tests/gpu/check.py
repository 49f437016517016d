"""The GPU check: one process on one NVIDIA GPU, NCCL world of 1; prints one JSON summary.

NCCL cannot put two ranks on one GPU (each rank needs a device of its own), so this checks the
CUDA/NCCL code paths at world size 1; the multi-rank protocol is tested on CPU with gloo.

Sections (each reports its seconds and, when it fails, its error; the others still run):
- rollout: the same requests through the static and the elastic code paths (NCCL group),
  identical tokens;
- grpo_bf16: one GRPO step of a bf16 model with Megatron's DDP and optimizer (fp32 main params);
- decode: decode tokens/s of the engine and of `transformers.generate` (greedy, same weights, same
  GPU) for a small random Qwen3-MoE-shaped model at batch 1, 32 and 128;
- offload: `torch.cuda.memory_allocated` before an offloading release, after it and after resync
  (weights, gradient buffers and optimizer state bit-identical after resync);
- static_decode: the padded decode step (`rollout.static_decode`, docs/engine.md) of a bf16
  model on the GPU: its layer stacks under `torch.cuda.set_sync_debug_mode("error")` (a host
  sync inside raises), their op audit (`flexfloor.rollout.capture`: no flagged op, one op
  sequence per bucket), and decode tokens/s with static_decode on vs off (same tokens).

Usage (from the repository root): bash tests/gpu/run.sh  (it sets up the one-rank environment).
`python tests/gpu/check.py --cpu-dry-run` runs the same sections on CPU with gloo, small, to catch
a broken script before it costs device time (figures meaningless).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

BATCHES = (1, 32, 128)
NEW_TOKENS = 32
DRY_BATCHES, DRY_NEW_TOKENS = (1, 4), 6


def section(summary: dict, name: str):
    """Run a section, recording its seconds and, if it raised, its error (never re-raised)."""
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            summary[name] = {"ok": True, **fn()}
        except Exception as e:  # a failing section must not hide the others' results
            summary[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()[-3000:]}
        summary[name]["seconds"] = round(time.perf_counter() - t0, 3)
        return fn
    return wrap


def requests(n: int, vocab: int, *, new_tokens: int, greedy: bool = False, seed: int = 3):
    import torch

    from flexfloor.rollout.types import Request, SamplingParams

    g = torch.Generator().manual_seed(seed)
    sampling = SamplingParams(greedy=True) if greedy else SamplingParams(temperature=1.0, top_p=0.95)
    return [Request(prompt_uid=i, sample_index=0, seed=seed, step=1, max_new_tokens=new_tokens,
                    prompt_ids=tuple(torch.randint(1, vocab, (4 + i % 5,), generator=g).tolist()),
                    sampling=sampling)
            for i in range(n)]


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    import torch

    dry = "--cpu-dry-run" in (sys.argv[1:] if argv is None else argv)
    summary: dict = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                     "cpu_dry_run": dry}
    if dry:
        batches, new_tokens = DRY_BATCHES, DRY_NEW_TOKENS
    else:
        batches, new_tokens = BATCHES, NEW_TOKENS
    if not dry and not torch.cuda.is_available():
        summary["error"] = "no CUDA device visible: this check needs one NVIDIA GPU"
        print(json.dumps(summary))
        return 1
    summary["device"] = "cpu (dry run)" if dry else torch.cuda.get_device_name(0)
    try:
        import megatron.core

        summary["megatron_core"] = getattr(megatron.core, "__version__", "?")
    except ImportError as e:
        summary["error"] = f"megatron-core is not importable ({e}): carry its wheel (tests/gpu/run.sh)"
        print(json.dumps(summary))
        return 1

    from flexfloor.config import ModelConfig, ReleasePolicy, RolloutConfig, TrainerConfig
    from flexfloor.model import build_model
    from flexfloor.parallel import Parallel
    from flexfloor.rollout.offload import HostOffload, ResidentSet
    from flexfloor.rollout.stack import RolloutStack
    from flexfloor.trainer.optim import build_train_state

    par = Parallel.build(expert_parallel_size=1, backend="gloo" if dry else "nccl")
    summary["backend"] = par.backend

    @section(summary, "rollout")
    def _rollout():
        model = build_model(ModelConfig(), par)
        stack = RolloutStack.build(par, model, rollout=RolloutConfig(max_batch_size=16,
                                                                     progress=False))
        reqs = requests(8, ModelConfig().vocab_size, new_tokens=24)
        tokens = {}
        for policy in (ReleasePolicy.STATIC, ReleasePolicy.ELASTIC):
            run = stack.start(policy)
            out = run.generate(reqs)
            run.resync(timeout_s=120)
            tokens[policy.value] = {r.request_id: r.token_ids for r in out.results}
        stack.close()
        return {"responses": len(tokens["static"]),
                "identical_static_elastic": tokens["static"] == tokens["elastic"]}

    @section(summary, "grpo_bf16")
    def _grpo():
        from flexfloor.trainer import algorithms as alg
        from flexfloor.trainer.actor import Actor, Sample

        # Megatron's bf16 optimizer wraps CUDA tensors only: the dry run steps in fp32
        cfg = ModelConfig(params_dtype="float32" if dry else "bfloat16")
        model = build_model(cfg, par)
        state = build_train_state(model, TrainerConfig(lr=1e-3), par, total_steps=2)
        stack = RolloutStack.build(par, model, rollout=RolloutConfig(max_batch_size=16,
                                                                     progress=False))
        reqs = [dataclasses.replace(r, sample_index=s)  # 4 prompts x 4 samples: GRPO groups
                for r in requests(4, cfg.vocab_size, new_tokens=16) for s in range(4)]
        run = stack.start(ReleasePolicy.STATIC)
        out = run.generate(reqs)
        run.resync(timeout_s=120)
        stack.close()
        results = sorted(out.results, key=lambda r: r.request_id)
        rewards = torch.tensor([r.token_ids.count(7) / max(1, len(r.token_ids)) + 0.01 * i
                                for i, r in enumerate(results)])
        adv = alg.grpo_advantages(rewards, torch.tensor([r.prompt_uid for r in results]),
                                  std_norm=True)
        samples = [Sample(prompt_ids=r.prompt_ids, response_ids=r.token_ids, advantage=float(a),
                          old_logprobs=r.logprobs) for r, a in zip(results, adv)]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        actor = Actor(state, TrainerConfig(lr=1e-3, micro_batch_size=8), par)
        metrics = actor.train_policy(actor.micro_batches(samples),
                                     global_tokens=sum(len(s.response_ids) for s in samples))
        changed = sum(not torch.equal(before[n], p) for n, p in model.named_parameters())
        return {"params_dtype": str(model.config.params_dtype), "applied": bool(metrics["actor/applied"]),
                "loss": float(metrics["actor/loss"]), "grad_norm": float(metrics.get("actor/grad_norm", 0)),
                "params_changed": changed, "params": len(before),
                "optimizer": type(state.optimizer).__name__}

    @section(summary, "decode")
    def _decode():
        from transformers import AutoModelForCausalLM

        from flexfloor.convert import model_from_hf
        from flexfloor.convert.hf_reference import tiny_hf_model

        rows = []
        with tempfile.TemporaryDirectory() as d:
            tiny_hf_model("qwen3_moe", seed=0, size="small").save_pretrained(d)
            hf = AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa").to(
                par.device).eval()
            model, cfg = model_from_hf(d, par)
            model.eval()
            for batch in batches:
                stack = RolloutStack.build(par, model, rollout=RolloutConfig(
                    max_batch_size=batch, progress=False))
                reqs = requests(batch, cfg.vocab_size, new_tokens=new_tokens, greedy=True)
                ff_tokens, ff_rate = _engine_rate(stack.engine, reqs)
                stack.close()
                hf_tokens, hf_rate = _hf_rate(hf, reqs, par.device)
                rows.append({"batch": batch, "new_tokens": new_tokens,
                             "flexfloor_decode_tokens_per_s": ff_rate,
                             "hf_decode_tokens_per_s": hf_rate,
                             "ratio_flexfloor_over_hf": ff_rate / hf_rate if hf_rate else None,
                             "identical_responses": sum(a == b for a, b in zip(ff_tokens, hf_tokens)),
                             "responses": batch})
        return {"model": f"qwen3_moe (small, random), hidden {cfg.hidden_size}, "
                         f"{cfg.num_layers} layers, {cfg.num_experts} experts, {cfg.params_dtype}",
                "runs": rows}

    @section(summary, "offload")
    def _offload():
        model = build_model(ModelConfig(hidden_size=512, moe_ffn_hidden_size=512, num_layers=4,
                                        ffn_hidden_size=1024, num_attention_heads=8,
                                        num_query_groups=4), par)
        state = build_train_state(model, TrainerConfig(), par, total_steps=2)
        tokens = torch.randint(1, 128, (2, 16), device=par.device)
        from flexfloor.model import forward_logits

        state.zero_grad()
        forward_logits(state.model, tokens).float().logsumexp(-1).mean().backward()
        state.step()  # Adam moments and fp32 state exist, as during a rollout between steps
        resident = ResidentSet(model, state)
        snapshot = [t.clone() for t in _bytes(resident)]
        _sync()
        off = HostOffload(resident, par.device)
        stats = off.offload()
        restore_s = off.restore()
        after = _bytes(resident)
        return {"memory_allocated_before_release": stats["resident_bytes_before_release"],
                "memory_allocated_after_release": stats["resident_bytes_after_release"],
                "memory_allocated_after_resync": off.stats["resident_bytes_after_resync"],
                "offloaded_bytes": stats["offloaded_bytes"], "offload_s": stats["offload_s"],
                "restore_s": restore_s,
                "bit_identical_after_resync": len(after) == len(snapshot) and all(
                    torch.equal(a, b) for a, b in zip(after, snapshot))}

    @section(summary, "static_decode")
    def _static_decode():
        from flexfloor.rollout.capture import audit_steps

        # bf16: the dtype torch's CUDA grouped GEMM runs (fp32 on the dry run's CPU)
        cfg = ModelConfig(params_dtype="float32" if dry else "bfloat16")
        model = build_model(cfg, par)
        model.eval()
        rows = []
        for batch in batches:
            reqs = requests(batch, cfg.vocab_size, new_tokens=new_tokens, greedy=True)
            runs = {}
            for static in (False, True):
                stack = RolloutStack.build(par, model, rollout=RolloutConfig(
                    max_batch_size=batch, progress=False, static_decode=static))
                runs[static] = _engine_rate(stack.engine, reqs)
                grouped = stack.moe.grouped_layers(model.config.params_dtype)
                stack.close()
            rows.append({"batch": batch, "new_tokens": new_tokens,
                         "eager_decode_tokens_per_s": runs[False][1],
                         "static_decode_tokens_per_s": runs[True][1],
                         "ratio_static_over_eager": runs[True][1] / runs[False][1],
                         "identical_responses": sum(a == b for a, b in
                                                    zip(runs[False][0], runs[True][0])),
                         "responses": batch, "grouped_expert_layers": grouped})
        # one more rollout (the stacks warm): every padded layer stack with a host sync raising
        batch = max(batches)
        stack = RolloutStack.build(par, model, rollout=RolloutConfig(
            max_batch_size=batch, progress=False, static_decode=True))
        engine = stack.engine
        real = engine._layer_stack

        def strict(plan, step, pool):
            if step.valid is None or dry:  # eager steps may sync; CPU has no sync mode
                return real(plan, step, pool)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return real(plan, step, pool)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        engine._layer_stack = strict
        with audit_steps(engine) as steps:
            from flexfloor.rollout.engine import StaticMembership

            engine.generate(requests(batch, cfg.vocab_size, new_tokens=new_tokens, seed=4),
                            StaticMembership())
        stack.close()
        padded = [st for st in steps if st.bucket is not None]
        by_bucket: dict = {}
        for st in padded:
            by_bucket.setdefault(st.bucket, set()).add(st.signature)
        flagged = sorted({f"{f.op}: {f.reason}" for st in padded for f in st.flagged})
        return {"model": f"default ModelConfig, {cfg.params_dtype}", "runs": rows,
                "padded_steps_under_sync_error": 0 if dry else len(padded),
                "padded_steps": len(padded), "flagged_in_padded_steps": flagged,
                "buckets": len(by_bucket),
                "one_op_sequence_per_bucket": all(len(v) == 1 for v in by_bucket.values()),
                "all_identical": all(r["identical_responses"] == r["responses"] for r in rows)}

    par.destroy()
    summary["ok"] = all(v.get("ok") for v in summary.values() if isinstance(v, dict))
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bytes(resident):
    import torch

    return [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
            for s in resident.offloadable()]


def _engine_rate(engine, reqs):
    """(tokens per request, decode tokens/s): the full run minus a 1-token run, best of 2."""
    import torch

    from flexfloor.rollout.engine import StaticMembership

    def run(rs):
        _sync()
        t0 = time.perf_counter()
        res = engine.generate(rs, StaticMembership()).results
        _sync()
        return {r.prompt_uid: r.token_ids for r in res}, time.perf_counter() - t0

    one = [dataclasses.replace(r, max_new_tokens=1) for r in reqs]
    run(one)  # warm-up
    short = min(run(one)[1] for _ in range(2))
    best, tokens = float("inf"), None
    for _ in range(2):
        tokens, s = run(reqs)
        best = min(best, s)
    decoded = len(reqs) * (reqs[0].max_new_tokens - 1)
    return [tokens[r.prompt_uid] for r in reqs], decoded / max(best - short, 1e-9)


def _hf_rate(hf, reqs, device):
    import torch

    pad = hf.config.pad_token_id or 0
    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in reqs],
                       device=device)
    mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids)
                         for r in reqs], device=device)

    def run(n):
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                              max_new_tokens=n, min_new_tokens=n)
        _sync()
        return seq[:, width:].tolist(), time.perf_counter() - t0

    n = reqs[0].max_new_tokens
    run(1)  # warm-up
    short = min(run(1)[1] for _ in range(2))
    best, tokens = float("inf"), None
    for _ in range(2):
        tokens, s = run(n)
        best = min(best, s)
    return tokens, len(reqs) * (n - 1) / max(best - short, 1e-9)


if __name__ == "__main__":
    sys.exit(main())
