"""HF folder <-> FlexFloor checkpoint, on any EP layout (call on every rank of the job).

`hf_to_flexfloor`: HF config -> model section; every tensor's shape checked from the headers
(an error names the tensors, nothing is written); each rank reads only its own experts into
`build_model`'s model; `save_checkpoint` writes atomically (iter_N.tmp -> iter_N; a leftover
iter_N.tmp of a crashed conversion is dropped, an existing iter_N refused), and a new root
appears whole (written as OUT.tmp, renamed to OUT with its `latest` and model.yaml). A root that
exists takes only a later step of the model it records. The model section and the source HF
config travel in the checkpoint's extra state, so the way back needs no other input.
`model_from_hf` is the same model in memory, nothing saved.

`flexfloor_to_hf`: `load_checkpoint` at the current layout (any EP size), then every EP rank
writes its experts as one safetensors shard (rank 0 the dense tensors too), atomically.

`check_hf_to_flexfloor` / `check_flexfloor_to_hf` are their checks that need no process group
(headers, configs, the output not there yet): a launcher runs them before starting workers.
"""

from __future__ import annotations

import os
import shutil
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import yaml

from flexfloor.checkpoint import (EXTRA_FILE, LATEST_FILE, iter_name, load_checkpoint,
                                  resolve_checkpoint, save_checkpoint)
from flexfloor.config import ModelConfig
from flexfloor.convert.families import (FAMILIES, ConversionError, Family, family_of,
                                        model_config_dict, model_config_from_dict)
from flexfloor.convert.hf_io import HFCheckpoint, write_hf
from flexfloor.model import DTYPES, build_model, global_param_name

MODEL_FILE = "model.yaml"  # a converted root's model section (`model:` of a FlexFloor config)

# the transformer-engine spec fuses the pre-attention norm into linear_qkv
_TE_ALIASES = {".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight"}


def local_expert_ids(model_cfg: ModelConfig, parallel) -> list[int]:
    """The training layout's experts of this rank (Megatron's contiguous blocks)."""
    n = model_cfg.num_experts // parallel.ep_size
    return list(range(parallel.ep_rank * n, (parallel.ep_rank + 1) * n))


def _global_names(model, expert_ids: Sequence[int]) -> dict[str, torch.nn.Parameter]:
    out = {}
    for name, p in model.named_parameters():
        g = global_param_name(name, expert_ids)
        for te, local in _TE_ALIASES.items():
            g = g.replace(te, local) if g.endswith(te) else g
        out[g] = p
    return out


def model_state(model, expert_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """This rank's parameters by layout-independent name (experts by global id)."""
    return {g: p.detach() for g, p in _global_names(model, expert_ids).items()}


@torch.no_grad()
def load_state(model, state: Mapping[str, torch.Tensor], expert_ids: Sequence[int]) -> None:
    """Copy `state` (global names) into the model: every parameter, exact shapes, nothing left."""
    params = _global_names(model, expert_ids)
    missing = sorted(set(params) - set(state))
    extra = sorted(set(state) - set(params))
    if missing or extra:
        raise ConversionError(f"state does not match the model: missing {missing[:5]}, "
                              f"unexpected {extra[:5]}")
    for g, p in params.items():
        t = state[g]
        if tuple(t.shape) != tuple(p.shape):
            raise ConversionError(f"{g}: shape {list(t.shape)} but the model has {list(p.shape)}")
        p.copy_(t)


def read_hf(hf_dir: str, model_cfg: Optional[ModelConfig] = None):
    """(checkpoint, family, model section) of an HF folder, every tensor shape checked."""
    hf = HFCheckpoint(hf_dir)
    family = family_of(hf.config)
    cfg = model_cfg or family.model_config(hf.config)
    family.check_hf_shapes(hf.shapes(), cfg)
    return hf, family, cfg


def _check_ep(cfg: ModelConfig, ep: int) -> None:
    """Every EP rank holds the same number of experts (`local_expert_ids`)."""
    n = cfg.num_experts
    if n % ep:
        raise ConversionError(f"--ep {ep} does not divide the model's {n} experts (each worker "
                              f"holds the same number); use one of "
                              f"{[d for d in range(1, n + 1) if n % d == 0]}")


def check_hf_to_flexfloor(hf_dir: str, out_root: str, *, step: int = 0,
                          model_cfg: Optional[ModelConfig] = None, ep: int = 1):
    """The checks of `hf_to_flexfloor` that need no process group (--out outside --hf, the HF
    config, every tensor's shape from the headers, `ep` against the experts; a root that exists
    records the same model, has no iter_N yet and a `latest` below `step`); returns `read_hf`'s
    triple. A leftover `iter_N.tmp` of a crashed conversion is no obstacle: `save_checkpoint`
    drops it."""
    out, src = os.path.realpath(out_root), os.path.realpath(hf_dir)
    if out == src or out.startswith(src + os.sep):
        where = "is the --hf folder" if out == src else f"is inside the --hf folder {hf_dir}"
        raise ConversionError(f"--out {out_root} {where}: the checkpoint would be written among "
                              "the model's files; give an --out outside it")
    hf, family, cfg = read_hf(hf_dir, model_cfg)
    _check_ep(cfg, ep)
    recorded, where = _recorded_model(out_root)
    if recorded is not None and recorded != cfg:
        diff = model_differences(recorded, cfg, ("recorded", "--hf"))
        raise ConversionError(f"--out {out_root} holds checkpoints of another model than --hf "
                              f"{hf_dir} ({diff}; recorded in {where}); one root holds one "
                              "model: give another --out")
    final = os.path.join(out_root, iter_name(step))
    if os.path.exists(final):
        raise ConversionError(f"{final} exists already; checkpoints are never overwritten "
                              "(choose another output or --step)")
    latest = _latest_step(out_root)
    if latest is not None and step <= latest:
        raise ConversionError(f"--step {step} is not above step {latest}, which {out_root}/"
                              f"{LATEST_FILE} holds, and a conversion never moves it back: give "
                              f"--step {latest + 1} or more, or another --out")
    return hf, family, cfg


def model_differences(a: ModelConfig, b: ModelConfig, names=("checkpoint", "config")) -> str:
    """'model.F: A vs B' for the fields where model sections `a` and `b` differ (the first 4),
    each value after its name in `names`."""
    x, y = model_config_dict(a), model_config_dict(b)
    diff = [f"model.{k}: {names[0]} {x[k]} vs {names[1]} {y[k]}" for k in x if x[k] != y[k]]
    return ", ".join(diff[:4]) + (f" and {len(diff) - 4} more" if len(diff) > 4 else "")


def _recorded_model(root: str) -> tuple[Optional[ModelConfig], str]:
    """(model section, where it is recorded) of a checkpoint root: its model.yaml, else the
    extra state of the checkpoint `latest` names; (None, "") for a root that records none."""
    path = os.path.join(root, MODEL_FILE)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                return model_config_from_dict(yaml.safe_load(f)["model"]), path
        except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
            raise ConversionError(f"--out {root}: {path} is not a model section ({e}); give "
                                  "another --out") from None
    if os.path.isfile(os.path.join(root, LATEST_FILE)):
        cfg, _ = checkpoint_model_config(root)
        return cfg, resolve_checkpoint(root)
    return None, ""


def _latest_step(root: str) -> Optional[int]:
    """The step `root/latest` names; None where there is no `latest`."""
    try:
        with open(os.path.join(root, LATEST_FILE)) as f:
            name = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return int(name.removeprefix("iter_"))
    except ValueError:
        raise ConversionError(f"--out {root}: {LATEST_FILE} holds {name!r}, not an iter_N name; "
                              "give another --out") from None


def _model_from(hf: HFCheckpoint, family: Family, cfg: ModelConfig, parallel):
    model = build_model(cfg, parallel)
    ids = local_expert_ids(cfg, parallel)
    load_state(model, family.from_hf(hf.tensor, cfg, ids), ids)
    return model


def model_from_hf(hf_dir: str, parallel, model_cfg: Optional[ModelConfig] = None):
    """(FlexFloor model holding the HF folder's weights, model section), in memory: nothing is
    saved. Each rank reads only its own experts."""
    hf, family, cfg = read_hf(hf_dir, model_cfg)
    return _model_from(hf, family, cfg, parallel), cfg


def hf_to_flexfloor(hf_dir: str, out_root: str, parallel, *, step: int = 0,
                    model_cfg: Optional[ModelConfig] = None):
    """Convert; returns (checkpoint directory, model section, the model as loaded). Writes
    iter_N, `latest` and model.yaml; a new root is written as OUT.tmp and renamed, so it is
    there only complete."""
    hf, family, cfg = check_hf_to_flexfloor(hf_dir, out_root, step=step, model_cfg=model_cfg,
                                            ep=parallel.ep_size)
    new = not os.path.exists(out_root)
    root = out_root.rstrip("/") + ".tmp" if new else out_root
    if new and parallel.rank == 0 and os.path.exists(root):
        shutil.rmtree(root)  # a crashed earlier conversion's: never read, safe to drop
    parallel.barrier()  # every rank has looked before rank 0 starts writing
    model = _model_from(hf, family, cfg, parallel)
    extra = {"model_config": model_config_dict(cfg), "hf_config": hf.config}
    save_checkpoint(root, step, model=model, model_cfg=cfg, extra_state=extra)
    if parallel.rank == 0:
        _write_model_file(root, cfg)
        if new:
            os.replace(root, out_root)
    parallel.barrier()
    return os.path.join(out_root, iter_name(step)), cfg, model


def _write_model_file(root: str, cfg: ModelConfig) -> None:
    path = os.path.join(root, MODEL_FILE)
    try:
        with open(path + ".tmp", "w") as f:
            yaml.safe_dump({"model": model_config_dict(cfg)}, f, sort_keys=False)
        os.replace(path + ".tmp", path)
    except OSError as e:
        raise ConversionError(f"writing {path} failed: {e.strerror}; free space there or give "
                              "another --out") from None


def checkpoint_model_config(ckpt: str) -> tuple[Optional[ModelConfig], Optional[dict]]:
    """(model section, source HF config) stored by `hf_to_flexfloor`; (None, None) otherwise."""
    if os.path.isfile(os.path.join(ckpt, "config.json")):  # before the checkpoint's own refusal
        raise ConversionError(f"--ckpt {ckpt}: this is a Hugging Face model folder (config.json), "
                              "not a FlexFloor checkpoint: use hf-to-flexfloor")
    extra = torch.load(os.path.join(resolve_checkpoint(ckpt), EXTRA_FILE), weights_only=False)
    d = extra.get("model_config")
    return (model_config_from_dict(d) if d else None), extra.get("hf_config")


def check_flexfloor_to_hf(ckpt: str, out_dir: str, *, model_cfg: Optional[ModelConfig] = None,
                          family: Optional[str] = None, ep: int = 1):
    """The checks of `flexfloor_to_hf` that need no process group (the checkpoint says or is told
    its model, `ep` against its experts, the family can express it, the output not there yet);
    returns (model section, family, HF config to write)."""
    stored_cfg, hf_base = checkpoint_model_config(ckpt)
    if model_cfg is not None and stored_cfg is not None and model_cfg != stored_cfg:
        raise ConversionError(
            f"--config describes another model than --ckpt {ckpt} records ("
            f"{model_differences(stored_cfg, model_cfg)}); a checkpoint this converter made "
            "records its model: drop --config")
    cfg = model_cfg or stored_cfg
    if cfg is None:
        raise ConversionError(f"{ckpt} does not say which model it holds (it was not made by "
                              "this converter); pass the training config (--config)")
    _check_ep(cfg, ep)
    choices = "{" + ",".join(FAMILIES) + "}"
    if family is not None and family not in FAMILIES:
        raise ConversionError(f"--family {family}: not a supported family; pass --family "
                              f"{choices}")
    name = family or (hf_base or {}).get("model_type")
    if name is None:
        fits = [n for n, f in FAMILIES.items() if _expresses(f, cfg)]
        raise ConversionError(
            f"{ckpt} does not record its HF family (only a checkpoint this converter made from "
            f"an HF folder does); pass --family {choices}, the HF family of its model"
            + (f" (its layout fits {' or '.join(fits)})" if fits else
               " (none of them fits its layout; --family NAME says why)"))
    fam: Family = family_of(name)
    if os.path.exists(out_dir):
        raise ConversionError(f"{out_dir} exists already; choose a new output folder")
    return cfg, fam, fam.hf_config(cfg, hf_base)  # refuses a model the family cannot express


def _expresses(fam: Family, cfg: ModelConfig) -> bool:
    try:
        fam.hf_config(cfg)
    except ConversionError:
        return False
    return True


def flexfloor_to_hf(ckpt: str, out_dir: str, parallel, *, model_cfg: Optional[ModelConfig] = None,
                    family: Optional[str] = None) -> ModelConfig:
    """Convert a FlexFloor checkpoint (any step, saved at any EP size) to an HF folder."""
    cfg, fam, config = check_flexfloor_to_hf(ckpt, out_dir, model_cfg=model_cfg, family=family,
                                             ep=parallel.ep_size)
    model = build_model(cfg, parallel)
    load_checkpoint(ckpt, model=model, model_cfg=cfg)
    ids = local_expert_ids(cfg, parallel)
    # one writer per EP rank (the first expert-DP replica); EP rank 0 also writes the dense part
    writer = dist.get_rank(parallel.expt_dp_group) == 0
    tensors = fam.to_hf(model_state(model, ids), cfg, ids, dense=parallel.ep_rank == 0) if writer else {}
    # Megatron keeps torch norms in fp32 in a bf16 model; HF files hold one dtype
    tensors = {k: t.to(DTYPES[cfg.params_dtype]) for k, t in tensors.items()}
    write_hf(out_dir, config, tensors, shard=parallel.ep_rank if writer else -1,
             num_shards=parallel.ep_size, group=parallel.world_group)
    return cfg
