#!/usr/bin/env python
"""FlexFloor's generation engine vs `transformers` on the same converted model and prompts.

For each model: load the HF folder into FlexFloor's model in memory (the converter's code,
`flexfloor.convert.model_from_hf`; no checkpoint is written), then decode the same prompts
greedily with transformers' `generate` and with FlexFloor's
`RolloutEngine` (one process, EP=1), `--batch` prompts at a time for both. Reports decode
tokens/s of each, their ratio (FlexFloor / transformers) and how many responses are identical.

Decode tokens/s excludes prefill: each side runs once with 1 new token and once with
`--new-tokens`, and decode rate = (tokens of the long run - tokens of the short run) / (time of
the long run - time of the short run). Best of `--repeats` runs each, the two sides
alternating so that load from other processes falls on both alike; on a machine other work
shares, `--clock cpu` times this process's CPU time instead of the wall clock.

    python tools/bench_vs_hf.py                                    # tiny random models, all families
    python tools/bench_vs_hf.py --family olmoe --size small --batch 8 --out b.json
    python tools/bench_vs_hf.py --hf path/to/hf_folder              # a real checkpoint

With --batch > 1 transformers pads prompts on the left (its batched path); its tokens may then
differ from unpadded decoding in the last bits of a logit, so only --batch 1 is expected to
match token for token (tests/test_convert.py checks that).

Each run also reports `roofline_tokens_per_s`, this CPU's limit for the decode step, and
`roofline_fraction` (FlexFloor's decode rate over it). Per step at batch b and the mean context
c of the decode run: bytes = dense weights + the expected distinct experts b tokens touch per
layer (uniform top-k routing: E * (1 - (1 - k/E)^b)) + b * c tokens of KV; FLOPs = 2 * b * the
weights one token uses + the attention's 4 * b * c * heads * head_dim per layer. The bandwidth
(a streaming sum over 256 MiB) and the matmul rate (a square sgemm) are measured in the same
run, on the same threads; the step's time is the larger of bytes / bandwidth and FLOPs / rate.
`--static-decode` pads FlexFloor's decode steps to batch buckets with fixed shapes
(rollout.static_decode, docs/engine.md); each run says which it ran (`static_decode`).
`grouped_expert_layers` says in how many layers the experts ran as grouped GEMMs
(over the stacked expert weights) rather than one GEMM per expert; `expert_kernel` which kernel
ran them and `attention_kernel` the decode steps' attention: `cpu_kernels`
(megatron_ext/cpu_kernels.py, float32 on CPU) or `torch` (`torch._grouped_mm` / `F.linear`,
SDPA; `--cpu-kernels 0`, rollout.cpu_kernels false, forces it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def parse(argv=None):
    from flexfloor.outputs import path_arg  # light: json and os

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", type=path_arg,
                   help="HF model folder; default: tiny random models of --family")
    p.add_argument("--family", action="append", choices=["mixtral", "qwen3_moe", "olmoe"],
                   help="families for random models (repeatable; default all)")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny",
                   help="random model size: tiny (hidden 64) or small (hidden 256, 4 layers)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together, both sides")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="time with the wall clock, or with this process's CPU time (on a machine "
                        "other work shares: the figures then exclude time spent waiting for a core)")
    p.add_argument("--static-decode", action="store_true",
                   help="FlexFloor's decode steps padded to buckets (rollout.static_decode)")
    p.add_argument("--cpu-kernels", type=int, choices=(0, 1), default=1,
                   help="float32 CPU decode steps on FlexFloor's C kernels (1, the default) or "
                        "on torch's (0) (rollout.cpu_kernels)")
    p.add_argument("--out", type=path_arg, help="write the figures as JSON here")
    args = p.parse_args(argv)
    for flag, value in (("--batch", args.batch), ("--prompts", args.prompts),
                        ("--repeats", args.repeats), ("--threads", args.threads)):
        if value < 1:
            p.error(f"{flag} {value}: must be at least 1")
    if args.threads > (os.cpu_count() or 1):
        p.error(f"--threads {args.threads}: this machine has {os.cpu_count()} CPUs; more threads "
                "than cores only measure contention: give at most that")
    if args.new_tokens < 2:
        p.error(f"--new-tokens {args.new_tokens}: must be at least 2 (the decode rate is the "
                "long run's tokens less a 1-token run's)")
    if args.out:
        from flexfloor.outputs import writable

        try:  # before the work: a bad path costs a second
            writable(args.out, "--out")
        except ValueError as e:
            p.error(str(e))
    if args.hf:
        if args.family:
            p.error("--family picks the random models' families; with --hf the folder's config "
                    "says the family: give one of them")
        from flexfloor.convert import ConversionError, read_hf

        try:  # a local folder of a supported family, every tensor's shape checked: no Hub
            read_hf(args.hf)
        except (ConversionError, OSError, ValueError) as e:
            p.error(f"--hf {args.hf}: {e}")
    return args


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]  # set from --clock by main(); every timing of this tool reads it


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(torch.randint(4, 17, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def hf_generate(model, prompts, new_tokens: int, batch: int):
    """Greedy tokens per prompt and seconds; batches left-padded."""
    import torch

    pad = model.config.pad_token_id or 0
    out, t0 = [], clock()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i: i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            seq = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            out += seq[:, width:].tolist()
    return out, clock() - t0


def flexfloor_generate(engine, prompts, new_tokens: int):
    from flexfloor.rollout.engine import StaticMembership
    from flexfloor.rollout.types import Request, SamplingParams

    reqs = [Request(prompt_uid=i, sample_index=0, prompt_ids=tuple(p), max_new_tokens=new_tokens,
                    sampling=SamplingParams(greedy=True)) for i, p in enumerate(prompts)]
    t0 = clock()
    res = engine.generate(reqs, StaticMembership()).results
    seconds = clock() - t0
    by_id = {r.prompt_uid: r.token_ids for r in res}
    return [by_id[i] for i in range(len(prompts))], seconds


def decode_rates(runs: dict, prompts, new_tokens: int, repeats: int):
    """Per side: (tokens per prompt, decode tokens/s, seconds of the long run). Decode rate =
    best long run minus best 1-token run; the sides alternate, so load from other processes
    falls on both alike."""
    for run in runs.values():
        run(prompts[:1], 2)  # warm-up
    short = {k: float("inf") for k in runs}
    long = dict(short)
    tokens = {}
    for _ in range(repeats):
        for k, run in runs.items():
            short[k] = min(short[k], run(prompts, 1)[1])
            tokens[k], seconds = run(prompts, new_tokens)
            long[k] = min(long[k], seconds)
    decoded = len(prompts) * (new_tokens - 1)
    return {k: (tokens[k], decoded / max(long[k] - short[k], 1e-9), long[k]) for k in runs}


def machine_rates(dtype) -> dict:
    """Streaming read bandwidth (bytes/s) and matmul rate (FLOP/s) of this CPU, best of 5."""
    import torch

    big = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB
    a = torch.randn(512, 512, dtype=dtype)
    best_bw, best_mm = float("inf"), float("inf")
    for _ in range(5):
        t0 = clock()
        big.sum()
        best_bw = min(best_bw, clock() - t0)
        t0 = clock()
        a @ a
        best_mm = min(best_mm, clock() - t0)
    return {"bandwidth_bytes_per_s": big.nbytes / best_bw, "matmul_flops_per_s": 2 * 512 ** 3 / best_mm}


def roofline(model, moe, batch: int, mean_context: float, rates: dict) -> float:
    """Decode tokens/s this CPU allows for one step of `batch` tokens (see the module docstring)."""
    from flexfloor.rollout.engine import kv_bytes_per_token

    cfg = model.config
    experts = [p for layer in model.decoder.layers for p in layer.mlp.experts.parameters()]
    expert_ids = {id(p) for p in experts}
    embedding = {id(p) for p in model.embedding.parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_ids and id(p) not in embedding]
    elem = experts[0].element_size()
    dense_n = sum(p.numel() for p in dense)
    per_expert_n = moe.expert_nbytes // elem  # one expert, all layers
    E, k = cfg.num_moe_experts, cfg.moe_router_topk
    touched = E * (1 - (1 - k / E) ** batch)  # distinct experts per layer
    kv = batch * mean_context * kv_bytes_per_token(cfg)
    nbytes = (dense_n + touched * per_expert_n) * elem + kv
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    attn = 4 * mean_context * cfg.num_attention_heads * head_dim * cfg.num_layers
    flops = batch * (2 * (dense_n + k * per_expert_n) + attn)
    step_s = max(nbytes / rates["bandwidth_bytes_per_s"], flops / rates["matmul_flops_per_s"])
    return batch / step_s


def kernels(param, asked: bool) -> str:
    """What ran the experts' GEMMs and the decode steps' attention for weights like `param`:
    FlexFloor's CPU kernels (`asked`, float32 on CPU, built) or torch's."""
    import torch

    from megatron_ext import cpu_kernels

    runs = (asked and param.device.type == "cpu" and param.dtype == torch.float32
            and cpu_kernels.available())
    return "cpu_kernels" if runs else "torch"


def bench_one(hf_dir: str, label: str, args, par) -> dict:
    from transformers import AutoModelForCausalLM

    from flexfloor.config import RolloutConfig
    from flexfloor.convert import model_from_hf
    from flexfloor.rollout.stack import RolloutStack

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                              local_files_only=True).eval()
    model, cfg = model_from_hf(hf_dir, par)  # in memory: a real --hf model is not saved again
    model.eval()
    stack = RolloutStack.build(par, model, rollout=RolloutConfig(
        max_batch_size=args.batch, progress=False, static_decode=args.static_decode,
        cpu_kernels=bool(args.cpu_kernels)))
    moe, engine = stack.moe, stack.engine
    prompts = make_prompts(args.prompts, cfg.vocab_size)
    rates = decode_rates({"hf": lambda p, n: hf_generate(hf, p, n, args.batch),
                          "flexfloor": lambda p, n: flexfloor_generate(engine, p, n)},
                         prompts, args.new_tokens, args.repeats)
    (hf_tokens, hf_rate, hf_s), (ff_tokens, ff_rate, ff_s) = rates["hf"], rates["flexfloor"]
    ran = kernels(next(model.parameters()), bool(args.cpu_kernels))
    same = sum(a == b for a, b in zip(hf_tokens, ff_tokens))
    rates = machine_rates(next(model.parameters()).dtype)
    mean_context = sum(map(len, prompts)) / len(prompts) + args.new_tokens / 2
    bound = roofline(model, moe, min(args.batch, len(prompts)), mean_context, rates)
    return {
        "model": label, "params_dtype": cfg.params_dtype, "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers, "num_experts": cfg.num_experts,
        "prompts": len(prompts), "new_tokens": args.new_tokens, "batch": args.batch,
        "threads": args.threads, "clock": args.clock, "static_decode": args.static_decode,
        "hf_decode_tokens_per_s": hf_rate, "flexfloor_decode_tokens_per_s": ff_rate,
        "ratio_flexfloor_over_hf": ff_rate / hf_rate,
        "hf_generate_s": hf_s, "flexfloor_generate_s": ff_s,
        "identical_responses": same, "responses": len(prompts),
        "grouped_expert_layers": moe.grouped_layers(next(model.parameters()).dtype),
        "expert_kernel": ran, "attention_kernel": ran,
        "roofline_tokens_per_s": bound, "roofline_fraction": ff_rate / bound, **rates,
    }


def main(argv=None) -> int:
    global clock
    args = parse(argv)
    clock = CLOCKS[args.clock]
    warnings.filterwarnings("ignore")
    if "RANK" not in os.environ:  # one process: its own one-rank gloo world
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="0")  # its store binds a free port
    import torch

    from flexfloor.convert.hf_reference import tiny_hf_model
    from flexfloor.parallel import Parallel

    torch.set_num_threads(args.threads)
    par = Parallel.build(expert_parallel_size=1, backend="gloo")
    rows = []
    try:
        if args.hf:
            rows.append(bench_one(args.hf, args.hf, args, par))
        else:
            for family in args.family or ["mixtral", "qwen3_moe", "olmoe"]:
                with tempfile.TemporaryDirectory() as d:
                    tiny_hf_model(family, seed=0, size=args.size).save_pretrained(d)
                    rows.append(bench_one(d, f"{family} ({args.size}, random)", args, par))
    finally:
        par.destroy()
    print(f"{'model':28s} {'HF tok/s':>10s} {'FlexFloor tok/s':>16s} {'ratio':>7s} {'identical':>10s}"
          f" {'roofline tok/s':>15s} {'fraction':>9s}")
    for r in rows:
        print(f"{r['model']:28s} {r['hf_decode_tokens_per_s']:10.1f} "
              f"{r['flexfloor_decode_tokens_per_s']:16.1f} {r['ratio_flexfloor_over_hf']:7.2f} "
              f"{r['identical_responses']:>4d}/{r['responses']:<5d} "
              f"{r['roofline_tokens_per_s']:15.1f} {r['roofline_fraction']:9.3f}")
    print("expert GEMMs and decode attention ran on: "
          + ", ".join(sorted({r["expert_kernel"] for r in rows})))
    if args.out:
        from flexfloor.outputs import write_json

        write_json(args.out, {"runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
