"""HF <-> FlexFloor conversion against `transformers`, every family, one launch.

On W workers (EP = W): rank 0 builds a tiny random `transformers` model per family, saves it
with save_pretrained(safe_serialization=True), and records its logits and greedy generations.
Then every rank runs the converter's CLI (in process) HF -> FlexFloor, loads the checkpoint into
FlexFloor's model, computes the trainer path's logits (forward_logits) and the engine's greedy
generation, and converts back FlexFloor -> HF (one shard per EP rank). Rank 0 compares every
tensor of the round trip with the original and reloads it with transformers. With W = 1 it also
runs the error cases and a rerun over a crashed conversion's leftover iter_N.tmp. Results:
OUT_DIR/results.json (rank 0).

Usage: torchrun --nproc-per-node W tests/workers/convert.py OUT_DIR
"""

import json
import os
import shutil
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from flexfloor.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from flexfloor.convert import ConversionError, FAMILIES, hf_to_flexfloor  # noqa: E402
from flexfloor.convert.hf_io import HFCheckpoint  # noqa: E402
from flexfloor.convert.hf_reference import hf_greedy, tiny_hf_model  # noqa: E402
from flexfloor.convert.pipeline import checkpoint_model_config, flexfloor_to_hf  # noqa: E402
from flexfloor.model import build_model, forward_logits  # noqa: E402
from flexfloor.parallel import Parallel  # noqa: E402
from flexfloor.config import ReleasePolicy, RolloutConfig  # noqa: E402
from flexfloor.rollout.stack import RolloutStack  # noqa: E402
from flexfloor.rollout.types import Request, SamplingParams  # noqa: E402
from tools.convert_checkpoint import main as convert_cli  # noqa: E402

from _harness import broadcast, gather, run  # noqa: E402

NEW_TOKENS = 16


def prompts(seed=0, n=6, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(torch.randint(3, 12, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def reference(family, hf_dir):
    """rank 0: the transformers model, saved, with its logits and greedy tokens."""
    model = tiny_hf_model(family, seed=len(family))
    model.save_pretrained(hf_dir, safe_serialization=True)
    tokens = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
    greedy, _ = hf_greedy(model, prompts(), NEW_TOKENS)
    return {"tokens": tokens, "logits": logits, "greedy": greedy}


def engine_greedy(par, model, cfg):
    """Each rank decodes every W-th prompt; all results gathered, in prompt order."""
    reqs = [Request(prompt_uid=i, sample_index=0, prompt_ids=tuple(p), max_new_tokens=NEW_TOKENS,
                    sampling=SamplingParams(greedy=True))
            for i, p in enumerate(prompts()) if i % par.world_size == par.rank]
    stack = RolloutStack.build(par, model, rollout=RolloutConfig(
        replicas=par.world_size // par.ep_size, progress=False))
    run = stack.start(ReleasePolicy.STATIC)
    out = run.generate(reqs)
    run.resync()
    stack.close()
    parts = gather({r.prompt_uid: r.token_ids for r in out.results})
    merged = {k: v for p in parts for k, v in p.items()}
    return [merged[i] for i in sorted(merged)]


def compare_round_trip(src, back):
    a, b = HFCheckpoint(src), HFCheckpoint(back)
    keys_a, keys_b = set(a.file_of), set(b.file_of)
    differ = [k for k in sorted(keys_a & keys_b)
              if a.tensor(k).dtype != b.tensor(k).dtype or not torch.equal(a.tensor(k), b.tensor(k))]
    cfg_a = {k: v for k, v in a.config.items() if k != "transformers_version"}
    cfg_b = {k: v for k, v in b.config.items() if k != "transformers_version"}
    return {"tensors": len(keys_a), "missing": sorted(keys_a - keys_b),
            "unexpected": sorted(keys_b - keys_a), "differ": differ,
            "config_equal": cfg_a == cfg_b,
            "config_diff": sorted(k for k in set(cfg_a) | set(cfg_b) if cfg_a.get(k) != cfg_b.get(k)),
            "files": sorted(os.listdir(back))}


def family_case(out_dir, family, world, rank):
    d = os.path.join(out_dir, family)
    hf_dir, ff_dir, back_dir = (os.path.join(d, x) for x in ("hf", "flexfloor", "hf_back"))
    ref = None
    if rank == 0:
        os.makedirs(d, exist_ok=True)
        ref = reference(family, hf_dir)
    ref = broadcast(ref)

    assert 0 == convert_cli(["hf-to-flexfloor", "--hf", hf_dir, "--out", ff_dir, "--ep", str(world)])
    cfg, _ = checkpoint_model_config(ff_dir)
    par = Parallel.build(expert_parallel_size=world, backend="gloo", timeout_s=120)
    model = build_model(cfg, par)
    load_checkpoint(ff_dir, model=model, model_cfg=cfg)
    model.eval()
    with torch.no_grad():
        logits = forward_logits(model, ref["tokens"])
    diff = float((logits - ref["logits"]).abs().max())
    greedy = engine_greedy(par, model, cfg)
    par.destroy()

    assert 0 == convert_cli(["flexfloor-to-hf", "--ckpt", ff_dir, "--out", back_dir, "--ep", str(world)])
    res = {"logits_max_abs_diff": diff, "logits_max_abs": float(ref["logits"].abs().max()),
           "greedy_flexfloor": greedy, "greedy_hf": ref["greedy"], "qk_norm": cfg.qk_norm.value,
           "norm_topk": cfg.moe_router_norm_topk}
    if world > 1:  # saved at EP=W, written back at EP=1 (the experts' other replicas idle)
        assert 0 == convert_cli(["flexfloor-to-hf", "--ckpt", ff_dir, "--out", back_dir + "_ep1",
                                 "--ep", "1"])
    if rank == 0:
        res["round_trip"] = compare_round_trip(hf_dir, back_dir)
        if world > 1:
            res["round_trip_ep1"] = compare_round_trip(hf_dir, back_dir + "_ep1")
        from transformers import AutoModelForCausalLM

        again = AutoModelForCausalLM.from_pretrained(back_dir, attn_implementation="eager").eval()
        with torch.no_grad():
            res["reloaded_logits_equal"] = bool(torch.equal(again(ref["tokens"]).logits, ref["logits"]))
    return res


def error_cases(out_dir):
    """W = 1 only: bad inputs fail with a message naming the tensor and leave nothing behind."""
    src = os.path.join(out_dir, "mixtral", "hf")
    out = {}
    par = Parallel.build(expert_parallel_size=1, backend="gloo")

    def attempt(name, fn, target):
        try:
            fn()
            out[name] = {"error": None}
        except (ConversionError, CheckpointError) as e:
            out[name] = {"error": str(e), "type": type(e).__name__}
        out[name]["written"] = os.path.exists(target) or os.path.exists(target + ".tmp")

    from safetensors.torch import load_file, save_file

    def broken(name, edit, config_edit=None):
        d = os.path.join(out_dir, "bad_" + name)
        shutil.copytree(src, d)
        tensors = load_file(os.path.join(d, "model.safetensors"))
        edit(tensors)
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        if config_edit:
            with open(os.path.join(d, "config.json")) as f:
                c = json.load(f)
            config_edit(c)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(c, f)
        return d

    key = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    bad_shape = broken("shape", lambda t: t.__setitem__(key, t[key][:-1].clone()))
    target = os.path.join(out_dir, "ff_bad_shape")
    attempt("shape", lambda: hf_to_flexfloor(bad_shape, target, par), target)

    def shrink_vocab(t):
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:100].clone()
        t["lm_head.weight"] = t["lm_head.weight"][:100].clone()
    bad_vocab = broken("vocab", shrink_vocab)
    target = os.path.join(out_dir, "ff_bad_vocab")
    attempt("vocab", lambda: hf_to_flexfloor(bad_vocab, target, par), target)

    missing = broken("missing", lambda t: t.pop("model.layers.0.self_attn.v_proj.weight"))
    target = os.path.join(out_dir, "ff_missing")
    attempt("missing", lambda: hf_to_flexfloor(missing, target, par), target)

    # a FlexFloor checkpoint read with a config of another vocabulary
    from flexfloor.convert.families import model_config_from_dict, model_config_dict

    cfg, _ = checkpoint_model_config(os.path.join(out_dir, "mixtral", "flexfloor"))
    other = model_config_from_dict({**model_config_dict(cfg), "vocab_size": 256})
    target = os.path.join(out_dir, "hf_bad_vocab")
    attempt("to_hf_vocab", lambda: flexfloor_to_hf(os.path.join(out_dir, "mixtral", "flexfloor"),
                                                   target, par, model_cfg=other), target)
    # never overwrite
    existing = os.path.join(out_dir, "mixtral", "hf_back")
    before = sorted(os.listdir(existing))
    attempt("to_hf_exists", lambda: flexfloor_to_hf(os.path.join(out_dir, "mixtral", "flexfloor"),
                                                    existing, par), os.path.join(out_dir, "nothing"))
    out["to_hf_exists"]["unchanged"] = sorted(os.listdir(existing)) == before

    # published checkpoints are bfloat16: the round trip keeps dtype and bits
    src16 = os.path.join(out_dir, "bf16", "hf")
    tiny_hf_model("olmoe", seed=7, dtype=torch.bfloat16).save_pretrained(src16)
    _, cfg16, _ = hf_to_flexfloor(src16, os.path.join(out_dir, "bf16", "flexfloor"), par)
    flexfloor_to_hf(os.path.join(out_dir, "bf16", "flexfloor"), os.path.join(out_dir, "bf16", "back"), par)
    out["bf16"] = {"params_dtype": cfg16.params_dtype,
                   **compare_round_trip(src16, os.path.join(out_dir, "bf16", "back"))}
    # a crashed conversion left iter_0000000.tmp behind: a rerun proceeds, and its result loads
    root = os.path.join(out_dir, "rerun")
    leftover = os.path.join(root, "iter_0000000.tmp")
    os.makedirs(leftover)
    open(os.path.join(leftover, "partial.distcp"), "w").close()
    try:
        _, cfg_r, converted = hf_to_flexfloor(src, root, par)
        loaded = build_model(cfg_r, par)
        load_checkpoint(root, model=loaded, model_cfg=cfg_r)
        a, b = dict(converted.named_parameters()), dict(loaded.named_parameters())
        out["rerun"] = {"error": None, "leftover": os.path.exists(leftover),
                        "params": len(a), "equal": a.keys() == b.keys() and
                        all(torch.equal(a[k], b[k]) for k in a)}
    except (ConversionError, CheckpointError) as e:
        out["rerun"] = {"error": str(e)}
    par.destroy()
    # the CLI reports a refused conversion as exit status 2
    out["cli_exit"] = convert_cli(["hf-to-flexfloor", "--hf", bad_shape, "--out",
                                   os.path.join(out_dir, "ff_cli_bad")])
    out["cli_written"] = os.path.exists(os.path.join(out_dir, "ff_cli_bad"))
    return out


def main(out_dir):
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    Parallel.build(backend="gloo")  # the world (the harness tears it down)
    results = {f: family_case(out_dir, f, world, rank) for f in FAMILIES}
    if world == 1:
        results["errors"] = error_cases(out_dir)
    return results


if __name__ == "__main__":
    run(main)
