"""Megatron-Core DDP, optimizer and LR schedule for the actor (and critic).

Regular (non-distributed) Adam: its checkpoint re-shards across EP sizes, which the distributed
optimizer of Megatron-Core 0.16 cannot do. Expert parameters reduce
over the expert-data-parallel group, dense ones over data-parallel; Megatron's DDP does that.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """The wrapped model, its optimizer and LR schedule: everything an optimizer step touches."""

    model: object  # megatron.core.distributed.DistributedDataParallel
    optimizer: object  # megatron.core.optimizer.MegatronOptimizer
    scheduler: object  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float]:
        """Reduce gradients, clip, step, advance the schedule. Returns (applied, grad_norm)."""
        self.model.finish_grad_sync()
        applied, grad_norm, _ = self.optimizer.step()
        if applied:
            self.scheduler.step(increment=1)
        return bool(applied), float(grad_norm if grad_norm is not None else 0.0)

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])


def build_train_state(model, trainer_cfg, parallel, *, total_steps: int, ddp=None) -> TrainState:
    """Wrap `model` in Megatron DDP and build Adam + a cosine LR schedule with warm-up.

    Pass `ddp` (an existing wrapper of the same model) to get a second optimizer and schedule
    over the same gradient buffers, e.g. for a supervised warm start before RL: a model must
    never be wrapped twice (each wrapper hooks every parameter's gradient).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = model.config
    # Megatron marks routed experts `allreduce=False` only at EP > 1; at EP = 1 they would join
    # the dense parameters and the optimizer's checkpoint would have another structure (one part
    # instead of dense + expert), so a run saved on 1 worker could not resume on 2 and back.
    # At EP = 1 the expert-data-parallel group is the data-parallel group: same reduction.
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False
    ddp = ddp or DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=False,
            average_in_collective=False,
        ),
        module=model,
        pg_collection=parallel.pg_collection,
    )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=trainer_cfg.lr,
        min_lr=trainer_cfg.min_lr,
        weight_decay=trainer_cfg.weight_decay,
        adam_beta1=trainer_cfg.adam_beta1,
        adam_beta2=trainer_cfg.adam_beta2,
        clip_grad=trainer_cfg.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(
        opt_config, [ddp], use_gloo_process_groups=False, pg_collection=parallel.pg_collection
    )
    steps = max(1, total_steps)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if trainer_cfg.lr_warmup_steps > 0 else trainer_cfg.lr,
        max_lr=trainer_cfg.lr,
        min_lr=trainer_cfg.min_lr,
        lr_warmup_steps=trainer_cfg.lr_warmup_steps,
        lr_decay_steps=max(steps, trainer_cfg.lr_warmup_steps + 1),
        lr_decay_style="cosine",
        start_wd=trainer_cfg.weight_decay,
        end_wd=trainer_cfg.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )
    return TrainState(model=ddp, optimizer=optimizer, scheduler=scheduler)
