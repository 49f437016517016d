"""FlexFloor's rollout engine against Megatron-Core's own legacy static inference engine.

The peer implementation is Megatron-Core 0.16.1 as shipped: `GPTInferenceWrapper` over a
`StaticInferenceContext` (Megatron's KV cache), `TextGenerationController` (its sampling loop) and
`StaticInferenceEngine(legacy=True)` (its scheduler and static batching), greedy (`top_k=1`).
Both engines run on the same `GPTModel` object. On CPU only the `megatron_ext.cpu_compat` shims
apply (`Parallel.build()` / `build_model()` install them); none of Megatron's inference code is
replaced here.

Cases: the tiny preset (`ModelConfig()`) in float32 and float64, and the same shapes with a 10x
larger init std ("sharp"): the tiny preset's attention is almost uniform, so a small error in
attention barely moves its tokens; the sharp model's tokens react to it.

Per case, writes `<case>.json`: the prompts, FlexFloor's tokens and log-probs (all prompts in one
`generate`), Megatron's tokens (all prompts in one static batch of mixed prompt lengths, with
log-probs; and one prompt at a time) and the state of Megatron's KV cache after each run.

Usage: torchrun --nproc-per-node 1 tests/workers/megatron_reference.py OUT_DIR
"""

import torch

from flexfloor.config import ModelConfig, ReleasePolicy, RolloutConfig
from flexfloor.model import build_model
from flexfloor.parallel import Parallel
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.types import Request, SamplingParams

from _harness import run, write

NEW_TOKENS = 16
PROMPT_LENS = (3, 5, 6, 8, 9, 11, 13, 16)  # all different: Megatron's batch mixes prefill/decode
CASES = {
    "tiny_float32": (ModelConfig(), "float32"),
    "tiny_float64": (ModelConfig(), "float64"),
    "sharp_float32": (ModelConfig(init_method_std=0.2), "float32"),
    "sharp_float64": (ModelConfig(init_method_std=0.2), "float64"),
}


def prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2024)
    return [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


class IdTokenizer:
    """Text is the token ids written out with spaces ("5 17 3"). Has what the controller reads.

    `eod` is one past the vocabulary: the logits have `vocab_size` columns, so greedy decoding
    never produces it (no early stop), and Megatron pads its prompt tensor with it, so a padded
    slot that reached the embedding would raise instead of passing unnoticed.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size
        self.bos = None

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(t)) for t in ids)


# --------------------------------------------------------------------------------------------
# (a) FlexFloor


def flexfloor_generate(par, model, model_cfg, batch):
    stack = RolloutStack.build(par, model, rollout=RolloutConfig(
        replicas=par.world_size // par.ep_size, progress=False))
    reqs = [Request(prompt_uid=i, sample_index=0, prompt_ids=tuple(p), max_new_tokens=NEW_TOKENS,
                    sampling=SamplingParams(greedy=True)) for i, p in enumerate(batch)]
    run = stack.start(ReleasePolicy.STATIC)
    out = run.generate(reqs)
    run.resync()
    stack.close()
    by_uid = {r.prompt_uid: r for r in out.results}
    return {
        "tokens": [list(by_uid[i].token_ids) for i in range(len(batch))],
        "logprobs": [list(by_uid[i].logprobs) for i in range(len(batch))],
    }


# --------------------------------------------------------------------------------------------
# (b) Megatron-Core's legacy static inference engine


def megatron_generate(par, model, model_cfg, batch, *, logprobs: bool):
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
        InferenceWrapperConfig,
    )
    from megatron.core.inference.sampling_params import SamplingParams as MegatronSampling
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    wrapper_cfg = InferenceWrapperConfig(
        hidden_size=model.config.hidden_size,
        params_dtype=model.config.params_dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=model_cfg.vocab_size,
        inference_max_requests=len(batch),
        inference_max_seq_length=model_cfg.max_seq_len,
    )
    context = StaticInferenceContext.from_config(wrapper_cfg)
    wrapped = GPTInferenceWrapper(model, wrapper_cfg, context, pg_collection=par.pg_collection)
    controller = TextGenerationController(wrapped, IdTokenizer(model_cfg.vocab_size),
                                          pp_group=par.pg_collection.pp)
    # legacy=True: the static path itself (the default tries the dynamic engine first, which
    # needs flash-attention, and falls back to this path with a warning)
    engine = StaticInferenceEngine(controller, max_batch_size=len(batch), legacy=True)
    greedy = MegatronSampling(top_k=1, top_p=0.0, temperature=1.0,
                              num_tokens_to_generate=NEW_TOKENS, return_log_probs=logprobs)
    done = engine.generate(prompts=[" ".join(map(str, p)) for p in batch], sampling_params=greedy)
    return {
        "tokens": [[int(t) for t in r.generated_tokens.tolist()] for r in done],
        "lengths": [int(r.generated_length) for r in done],
        "prompt_tokens": [list(r.prompt_tokens) for r in done],
        "status": [r.status.name for r in done],
        "logprobs": [list(r.generated_log_probs) for r in done] if logprobs else None,
        "kv_cache": {str(k): [list(t.shape) for t in kv]
                     for k, kv in context.key_value_memory_dict.items()},
        "decode_mode": context.is_decode_only(),
        "sequence_len_offset": int(context.sequence_len_offset),
    }


def main(out):
    par = Parallel.build(expert_parallel_size=1, timeout_s=60)
    assert par.world_size == 1 and par.ep_size == 1
    for name, (model_cfg, dtype) in CASES.items():
        model = build_model(model_cfg, par, params_dtype=dtype)
        batch = prompts(model_cfg.vocab_size)
        result = {
            "prompts": batch,
            "num_layers": model_cfg.num_layers,
            "max_seq_len": model_cfg.max_seq_len,
            "dtype": str(model.config.params_dtype),
            "flexfloor_batch": flexfloor_generate(par, model, model_cfg, batch),
            "megatron_batch": megatron_generate(par, model, model_cfg, batch, logprobs=True),
            "megatron_single": [megatron_generate(par, model, model_cfg, [p], logprobs=False)
                                for p in batch],
        }
        write(out, f"{name}.json", result)
        del model


if __name__ == "__main__":
    run(main)
