"""Where the executor's models come from: a local Hugging Face directory (safetensors, nothing
downloaded) or random weights from a config, seeded, built directly on the target device in the
target dtype (an 8B model never passes through CPU memory)."""
from __future__ import annotations

from pathlib import Path

import torch

from kvpipe.pipeline.layer_kinds import refuse_model_type
from kvpipe.pipeline.model import FAMILIES as _MODEL_TYPES   # HF model_type -> family

from kvpipe.executor.layers.adapter import check_supported


def _check_type(model_type) -> None:
    refuse_model_type(model_type)
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"model_type: unsupported architecture {model_type!r} "
                         f"(supported: {', '.join(sorted(_MODEL_TYPES))})")


def _config(config):
    """A transformers config from a config object or a config.json dict; ValueError if unsupported."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        _check_type(config.model_type)
        return config
    cfg = dict(config)
    mtype = cfg.pop("model_type", None)
    _check_type(mtype)
    return AutoConfig.for_model(mtype, **cfg)


def random_model(config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> torch.nn.Module:
    """A causal LM with seeded random weights from `config` (dict or transformers config), built
    on `device` in `dtype`, in eval mode. The global RNG state is left as it was."""
    from transformers import AutoModelForCausalLM

    cfg = _config(config)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    check_supported(model)
    return model.eval()


def load_pretrained(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A causal LM from a local directory (config.json + safetensors), loaded straight onto
    `device`; `dtype` defaults to the checkpoint's. Never downloads."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model: no config.json in {str(path)!r}")
    _check_type(AutoConfig.from_pretrained(path, local_files_only=True).model_type)
    device = torch.device(device)
    # Straight onto the device where transformers can (it needs accelerate for a device_map).
    direct = device.type != "cpu" and is_accelerate_available()
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or "auto",
                                                 use_safetensors=True,
                                                 **({"device_map": device} if direct else {}))
    check_supported(model)
    return model.to(device).eval()
