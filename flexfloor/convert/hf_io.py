"""Hugging Face model folders: config.json + safetensors (one file, or shards with an index).

Reading is lazy (a rank reads only the tensors it holds). Writing is atomic and sharded by EP
rank: every writing rank puts its own tensors in its own shard inside `OUT.tmp`, rank 0 adds
the index and config.json and renames `OUT.tmp` to `OUT`, so no rank holds the whole model and
a failure leaves no `OUT` behind.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from flexfloor.convert.families import ConversionError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def _json_object(path: str) -> dict:
    """The JSON object in `path`; ConversionError naming the file where it is not one."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path} is not readable JSON ({e}); re-save the model with "
                              "save_pretrained") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path} holds a JSON {type(value).__name__}, not an object; "
                              "re-save the model with save_pretrained")
    return value


class HFCheckpoint:
    """Read-only view of an HF model folder."""

    def __init__(self, path: str):
        if os.path.isfile(path):
            raise ConversionError(f"{path} is a file, give the folder that holds it (a Hugging "
                                  f"Face model folder: {CONFIG_FILE} and *.safetensors)")
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            raise ConversionError(f"{path} is not a Hugging Face model folder (no {CONFIG_FILE})")
        self.path = path
        self.config = _json_object(os.path.join(path, CONFIG_FILE))
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            weight_map = _json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index} has no weight_map object; re-save the model with "
                                      "save_pretrained")
            self.file_of = dict(weight_map)
            missing = sorted({f for f in self.file_of.values()
                              if not os.path.isfile(os.path.join(path, f))})
            if missing:
                raise ConversionError(f"the index {index} names {', '.join(missing[:3])}, which "
                                      f"{'is' if len(missing) == 1 else 'are'} missing; copy "
                                      "every shard of the model into the folder or re-save it "
                                      "with save_pretrained")
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            self.file_of = None  # filled from the file's own keys below
        else:
            raise ConversionError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE} (only "
                                  "safetensors checkpoints are read; re-save with "
                                  "save_pretrained(safe_serialization=True))")
        self._open: dict[str, object] = {}
        if self.file_of is None:
            self.file_of = {k: SINGLE_FILE for k in self._handle(SINGLE_FILE).keys()}

    def _handle(self, name: str):
        from safetensors import safe_open

        if name not in self._open:
            path = os.path.join(self.path, name)
            try:
                self._open[name] = safe_open(path, framework="pt")
            except Exception as e:  # safetensors' own error type (Rust), or an OSError
                raise ConversionError(f"{path} is not a readable safetensors file ({e}); "
                                      "re-save the model with save_pretrained") from None
        return self._open[name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the headers only."""
        return {k: tuple(self._handle(f).get_slice(k).get_shape()) for k, f in self.file_of.items()}

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.file_of:
            raise ConversionError(f"{key} is not in {self.path}")
        return self._handle(self.file_of[key]).get_tensor(key)


def write_hf(out: str, config: Mapping, tensors: Mapping[str, torch.Tensor], *, shard: int,
             num_shards: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """Write `tensors` as shard `shard` of `num_shards` (shard < 0: this rank writes nothing).
    Collective over `group` (every rank of the conversion job) when torch.distributed is up."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    tmp = out.rstrip("/") + ".tmp"
    if rank == 0:
        if os.path.exists(tmp):  # a crashed earlier attempt: never read, safe to drop
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier(group)
    name = (SINGLE_FILE if num_shards == 1
            else f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors")
    failure = None  # this rank's write error, told to every rank
    try:
        if shard >= 0:
            from safetensors.torch import save_file

            save_file({k: t.contiguous() for k, t in tensors.items()}, os.path.join(tmp, name),
                      metadata={"format": "pt"})
    except Exception as e:  # an OSError, or safetensors' own error type (Rust) around one
        failure = " ".join(str(e).split()) or type(e).__name__
    mine = (failure, {k: name for k in tensors} if shard >= 0 else {},
            sum(t.nbytes for t in tensors.values()) if shard >= 0 else 0)
    parts = [mine]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
    failures = [(r, p[0]) for r, p in enumerate(parts) if p[0] is not None]
    if failures:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        causes = "; ".join(f"rank {r}: {text}" if len(parts) > 1 else text
                           for r, text in failures)
        raise ConversionError(f"writing {out} failed: {causes}; free space there or give "
                              "another --out")
    if rank == 0:
        weight_map: dict[str, str] = {}
        for _, names, _ in parts:
            dup = set(weight_map) & set(names)
            if dup:
                shutil.rmtree(tmp, ignore_errors=True)
                raise ConversionError(f"tensors written by two ranks: {sorted(dup)[:5]}")
            weight_map.update(names)
        if num_shards > 1:
            index = {"metadata": {"total_size": sum(p[2] for p in parts)},
                     "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(dict(config), f, indent=2, sort_keys=True)
        os.replace(tmp, out)
    _barrier(group)


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)
