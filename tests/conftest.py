"""Shared pytest setup: the `gpu` marker (skipped without CUDA), the default hypothesis profile and
the tiny models the tests build (in memory, or as a config.json for the CLI)."""

import json
import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def _cuda_available() -> bool:
    try:
        import torch  # imported lazily: planning tests run with torch blocked
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in gpu_items:
            item.add_marker(skip)


_TINY_FAMILY = {  # config.json fields of a tiny model per family; head_dim set explicitly
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {},
}


@pytest.fixture(autouse=True)
def _lift_cuda_cap():
    """A run caps the process's CUDA allocator (set_per_process_memory_fraction), which outlives
    it: a GPU test that capped at 2 GB made the next GPU tests fail for memory on the H200
    (2026-11-30). Each test starts uncapped."""
    yield
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def tiny_model():
    """Factory of tiny seeded random HF causal LMs, cached for the session:
    tiny_model(family, kv_heads=2, q_heads=8, head_dim=16, layers=2, dtype=torch.float32,
    device="cpu", **config_overrides). Built with executor.layers.loader.random_model."""
    import zlib

    import torch

    from kvpipe.executor.layers.loader import random_model

    built = {}

    def make(family="llama", kv_heads=2, q_heads=8, head_dim=16, layers=2, dtype=None,
             device="cpu", **overrides):
        dtype = torch.float32 if dtype is None else dtype
        cfg = dict(model_type=family, vocab_size=128, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                   head_dim=head_dim, max_position_embeddings=512, initializer_range=0.1,
                   rms_norm_eps=1e-6, tie_word_embeddings=False, **_TINY_FAMILY[family])
        cfg.update(overrides)
        key = (repr(sorted(cfg.items())), str(dtype), str(device))
        if key not in built:
            built[key] = random_model(cfg, device=device, dtype=dtype, seed=zlib.crc32(key[0].encode()))
        return built[key]

    return make


@pytest.fixture(scope="module")
def single_thread():
    """Run a module's torch work on one CPU thread (restored afterwards): tiny kernels on 2 shared
    cores otherwise spend milliseconds per call waiting on the thread pool."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 4096, "torch_dtype": "float32"}


def write_config(tmp_path_factory, **overrides) -> str:
    """A tiny Llama config.json (TINY_LLAMA with `overrides`) in a fresh temp folder: its path."""
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(dict(TINY_LLAMA, **overrides)))
    return str(path)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """The path of TINY_LLAMA's config.json (`--model` for CLI and API runs)."""
    return write_config(tmp_path_factory)
