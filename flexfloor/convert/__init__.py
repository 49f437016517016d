"""Hugging Face <-> FlexFloor checkpoint conversion (Mixtral, Qwen3-MoE, OLMoE).

families.py  names, tensors and configs per family: a symmetric `from_hf` / `to_hf` pair (pure)
hf_io.py     HF folders: lazy safetensors reading, atomic sharded writing
pipeline.py  HF folder <-> FlexFloor checkpoint on any EP layout (tools/convert_checkpoint.py)
"""

from flexfloor.convert.families import FAMILIES, ConversionError, Family, family_of
from flexfloor.convert.pipeline import (check_flexfloor_to_hf, check_hf_to_flexfloor,
                                        flexfloor_to_hf, hf_to_flexfloor, load_state,
                                        local_expert_ids, model_from_hf, model_state, read_hf)

__all__ = ["FAMILIES", "ConversionError", "Family", "check_flexfloor_to_hf",
           "check_hf_to_flexfloor", "family_of", "flexfloor_to_hf", "hf_to_flexfloor",
           "load_state", "local_expert_ids", "model_from_hf", "model_state", "read_hf"]
