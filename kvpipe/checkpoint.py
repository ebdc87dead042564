"""Where `kvpipe generate` gets its model, tokenizer and stop tokens: a local Hugging Face directory
(safetensors), a `.gguf` file, or a preset / config.json with random weights. A GGUF file is read
once by transformers' GGUF loader (the `gguf` extra) and written as a safetensors directory in a
cache, which every later run loads like any other directory; nothing is downloaded."""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import sys
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "KVPIPE_CACHE_DIR"   # where converted GGUF checkpoints go (default ~/.cache/kvpipe)
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
log = logging.getLogger("kvpipe")   # its lines: printed by the CLI, quiet from Python
SOURCE = "kvpipe-source.json"       # in a converted folder: the GGUF and dtype it was made from


@dataclass(frozen=True)
class Checkpoint:
    """`model`: what `kvpipe run` takes as --model (a directory, preset or config.json);
    `tokenizer`: a directory holding a tokenizer, or None; `eos_ids`: the generation config's
    end-of-sequence ids (empty when it has none); `sampling`: the generation config's sampling
    fields (do_sample, temperature, top_k, top_p, min_p, repetition_penalty) that it sets."""

    model: str
    tokenizer: str | None
    eos_ids: tuple[int, ...]
    sampling: dict


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvpipe"


def is_gguf(model) -> bool:
    """Whether `--model` names a GGUF file (by its suffix, as the loaders tell them)."""
    return str(model).lower().endswith(".gguf")


def gguf_dir(path: Path, dtype: str | None, root: Path | None = None) -> Path:
    """The cache directory a GGUF file converts into: keyed by its real path, size, mtime and
    the dtype, so an edited file or another dtype converts again."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype or 'fp32'}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return (root or cache_root()) / "gguf" / f"{path.resolve().stem}-{digest}"   # a link to it: the same folder


def gguf_config(path: str | os.PathLike, dtype: str | None = None) -> dict:
    """The Hugging Face config of GGUF file `path` for planning: its converted folder's config.json
    where it was converted, else transformers' GGUF reader over the metadata only (no tensors);
    without its dtype (the file's are quantised types: a plan assumes bf16, as for a preset)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"model: no file {str(path)!r}")
    done = gguf_dir(path, dtype) / "config.json"
    drop = ("torch_dtype", "dtype")
    if done.is_file():
        return {k: v for k, v in json.loads(done.read_text()).items() if k not in drop}
    try:
        import gguf  # noqa: F401
        import torch  # noqa: F401  (transformers' GGUF reader needs it even for metadata)
        from transformers import AutoConfig
    except ImportError as e:
        raise ValueError(f"model: reading a .gguf file needs the {e.name!r} package (pip install 'kvpipe[gguf]' "
                         "torch); or give the model's config.json") from None
    try:
        cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as e:   # a corrupt header fails anywhere in the reader
        raise ValueError(f"model: cannot read {str(path)!r} as GGUF ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return {k: v for k, v in cfg.to_dict().items() if k not in drop}


def convert_gguf(path: str | os.PathLike, dtype: str | None = None, root: Path | None = None,
                 quiet: bool = False) -> Path:
    """The safetensors directory of GGUF file `path` (dequantised to `dtype`, default fp32 as
    transformers loads GGUF), converting it on first use. ValueError names --model."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"model: no file {str(path)!r}")
    out = gguf_dir(path, dtype, root)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
        import accelerate  # noqa: F401
    except ImportError as e:
        raise ValueError(f"model: reading a .gguf file needs the {e.name!r} package: "
                         "pip install 'kvpipe[gguf]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not quiet:
        log.info(f"converting {path.name} to {dtype or 'fp32'} safetensors in {out} (once)")
    kw = dict(gguf_file=path.name, local_files_only=True)
    try:
        with _bars_off():   # the line above says what happens; no bar under --json
            tok = AutoTokenizer.from_pretrained(path.parent, **kw)
            model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=_DTYPE_NAMES[dtype or "fp32"], **kw)
    except Exception as e:   # a corrupt file fails anywhere in the GGUF reader (struct, numpy, KeyError...)
        if isinstance(e, MemoryError):
            raise
        raise ValueError(f"model: cannot read {str(path)!r} as GGUF ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    _sweep_dead(out, quiet)
    _sweep_stale(out, path, dtype, quiet)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        _write_plain(model, tmp)
        tok.save_pretrained(tmp)
        (tmp / SOURCE).write_text(json.dumps(_source(path, dtype)))
        if out.exists():   # a conversion cut short: replaced whole
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:   # Ctrl-C, SIGTERM or a full disk: no half-written copy of the weights stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextmanager
def _bars_off():
    """transformers' progress bars off (its switch), and stderr held meanwhile: its GGUF reader
    draws a tqdm bar of its own that the switch does not reach. Lines other than the bar's
    redraws (carriage returns) are passed on."""
    from transformers.utils import logging as hf_logging
    bars, held = hf_logging.is_progress_bar_enabled(), io.StringIO()
    hf_logging.disable_progress_bar()
    try:
        with redirect_stderr(held):
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        for line in held.getvalue().split("\n"):
            if line.strip() and "\r" not in line:
                print(line, file=sys.stderr)


def _sweep_dead(out: Path, quiet: bool) -> None:
    """Removes `out`'s temporary folders whose converting process is gone (SIGKILL, a crash):
    each holds a partial copy of the weights that nothing else would reclaim."""
    from kvpipe.executor.disk.io import alive
    for tmp in out.parent.glob(out.name + ".tmp*"):
        pid = tmp.name[len(out.name) + 4:]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            if not quiet:
                log.info(f"removed {tmp.name}, left by a conversion whose process is gone")


def _source(path: Path, dtype: str | None) -> dict:
    """What a converted folder was made from (its SOURCE file): the GGUF's real path and the dtype."""
    return {"path": str(path.resolve()), "dtype": dtype or "fp32"}


def _sweep_stale(out: Path, path: Path, dtype: str | None, quiet: bool) -> None:
    """Removes the earlier conversions of the same GGUF file to the same dtype (the file changed
    since: an update, a new download): each a full copy of the weights nothing would read again."""
    want = _source(path, dtype)
    for old in out.parent.glob(f"{path.resolve().stem}-*"):
        try:
            made = json.loads((old / SOURCE).read_text())
        except (OSError, ValueError):
            continue   # not a conversion that says what it was made from: left alone
        if old != out and made == want:
            shutil.rmtree(old, ignore_errors=True)
            if not quiet:
                log.info(f"removed {old}, an earlier conversion of {path.name} (the file changed since)")


def _write_plain(model, out: Path) -> None:
    """config.json (without the GGUF quantisation entry), generation_config.json and the weights
    as one safetensors file, tied tensors stored once."""
    from safetensors.torch import save_model
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    model.generation_config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"))


def _generation_config(d: Path) -> dict:
    f = d / "generation_config.json"
    if not f.is_file():
        f = d / "config.json"
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def resolve(model: str | os.PathLike, dtype: str | None = None, random_weights: bool = False) -> Checkpoint:
    """The checkpoint `--model` names: a .gguf file (converted once), a directory, or a preset /
    config.json (with `random_weights`; no tokenizer unless its directory holds one)."""
    text = str(model)
    if is_gguf(text):
        if not Path(text).is_file():
            raise ValueError(f"model: no file {text!r}")
        if random_weights:
            raise ValueError("random-weights: a .gguf file carries its weights; drop --random-weights")
        text = str(convert_gguf(text, dtype))
    d = Path(text)
    folder = d if d.is_dir() else d.parent if d.name.endswith(".json") else None
    tok = str(folder) if folder is not None and ((folder / "tokenizer.json").is_file()
                                                  or (folder / "tokenizer_config.json").is_file()) else None
    gen = _generation_config(folder) if folder is not None else {}
    keys = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
    return Checkpoint(text, tok, _ids(gen.get("eos_token_id")), {k: gen[k] for k in keys if gen.get(k) is not None})
