"""A KV directory's load with the next prefill running behind it (executor/engine/live.py
`LiveSession.load(overlap=True)`, executor/kv/loader.py): a slowed load still gives the
uninterrupted run bit for bit, the prefill starts before the load ends, a corrupt block is named
and leaves the conversation empty, and closing joins the readers."""
from __future__ import annotations

import json
import threading
import time

import pytest

import kvpipe
from kvpipe.conversation import Conversation
from kvpipe.pipeline.units import fmt_bytes

torch = pytest.importorskip("torch")

from kvpipe.executor.kv import loader   # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

P = [(7 * i + 3) % 256 for i in range(40)]       # the document
Q = [(5 * i + 1) % 256 for i in range(13)]       # the next question
# every tier: 1 GPU-resident unit, 1 host, 1 disk per layer (2 layers x 3 KV heads)
OPTS = dict(random_weights=True, device="cpu", chunk=16, seed=5, resident="2", group=1, disk="2")
DELAY_S = 0.03                                   # per unit of the last layer: the load lags the prefill


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import TINY_LLAMA
    d = tmp_path_factory.mktemp("kv3")
    (d / "config.json").write_text(json.dumps(dict(TINY_LLAMA, num_key_value_heads=3, num_attention_heads=6, hidden_size=96)))
    return d


@pytest.fixture
def saved_dir(model_dir, tmp_path):
    kvpipe.generate(str(model_dir), " ".join(map(str, P)), prompt_format="ids", max_new_tokens=3,
                    save_kv=tmp_path / "kv", **OPTS)
    return tmp_path / "kv"


@pytest.fixture
def slow_last_layer(monkeypatch):
    """Readers that sleep before each unit of layer 1; returns the times its units ended."""
    done: list[float] = []
    unit = loader._Reader.unit

    def slow(self, u):
        if u["layer"] == 1:
            time.sleep(DELAY_S)
        out = unit(self, u)
        if u["layer"] == 1:
            done.append(time.perf_counter())
        return out
    monkeypatch.setattr(loader._Reader, "unit", slow)
    return done


def conversation(model_dir, **over) -> Conversation:
    return Conversation(str(model_dir), max_context=len(P) + len(Q) + 6, max_new_tokens=6, **dict(OPTS, **over))


def reference(model_dir, **over):
    with conversation(model_dir, **over) as c:
        return c.append(P + Q, breaks=(len(P),), max_new_tokens=6)


def test_a_prefill_behind_a_slow_load_is_the_uninterrupted_run(model_dir, saved_dir, slow_last_layer):
    """Fault caught: a prefill stage that does not wait for its layer's units (the gate returning
    at once reads homes the readers have not filled yet), or a layer counted home before its
    units' blocks are read."""
    with conversation(model_dir) as c:
        c.load(saved_dir, overlap=True)
        got = c.append(P + Q, max_new_tokens=6)
        assert c.live.loaded.path == "overlapped"
    ref = reference(model_dir)
    assert got.tokens == ref.tokens and got.output_digest == ref.output_digest


def test_the_prefill_starts_before_the_load_ends(model_dir, saved_dir, slow_last_layer):
    """Fault caught: an overlapped load that is joined before the prefill starts (no overlap),
    or layer 0's stages waiting for every layer."""
    first: list[float] = []
    with conversation(model_dir) as c:
        c.load(saved_dir, overlap=True)
        c.live.extend(P + Q, 2, stage_hook=lambda s: first.append(time.perf_counter()) if not first else None)
        stats = c.live.loaded
    assert first and first[0] < max(slow_last_layer)
    assert stats.bytes == len(P) * 2 * 16 * 4 * 6 and stats.read_s > 0 and stats.crc_s > 0


def test_generate_reports_the_overlapped_load(model_dir, saved_dir):
    """Fault caught: `generate --load-kv` loading without the prefill behind it, or timings that
    drop the load's path, bytes, read and checksum seconds or the fingerprint's."""
    got = kvpipe.generate(str(model_dir), " ".join(map(str, Q)), prompt_format="ids", max_new_tokens=3,
                          load_kv=saved_dir, **OPTS)
    t = got.timings
    assert t["kv_load"]["path"] == "overlapped" and t["kv_load"]["bytes"] == t["kv_load_bytes"] > 0
    assert t["kv_load"]["read_s"] > 0 and t["kv_load"]["crc_s"] > 0 and t["kv_load"]["fingerprint_s"] > 0
    assert 0 < t["kv_load_held_s"] and t["kv_load_s"] > 0


def test_the_cli_says_what_it_loaded_and_that_the_prefill_ran_behind_it(model_dir, saved_dir, capsys):
    """Fault caught: `kvpipe generate --load-kv` whose stderr summary leaves out the load (its
    bytes, seconds and whether the prefill ran behind it)."""
    from kvpipe.cli import main
    code = main(["generate", "--model", str(model_dir), "--random-weights", "--device", "cpu", "--prompt-format", "ids",
                 "--prompt", " ".join(map(str, Q)), "--load-kv", str(saved_dir), "--max-new-tokens", "2",
                 "--chunk", "16", "--resident", "2", "--group", "1", "--disk", "2", "--seed", "5"])
    err = capsys.readouterr().err
    assert code == 0
    line = next(x for x in err.splitlines() if x.startswith("kvpipe: KV loaded: "))
    assert f"KV loaded: {fmt_bytes(len(P) * 128 * 6)} in " in line and "the prefill behind it" in line


def test_a_corrupt_block_behind_the_prefill_is_named_and_keeps_nothing(model_dir, saved_dir):
    """Fault caught: a failed overlapped load that leaves the conversation holding the saved
    tokens over homes partly filled (the next prompt then prefills only its new tokens on them),
    or an error that does not name the file and offset."""
    man = json.loads((saved_dir / "manifest.json").read_text())
    u = next(u for u in man["units"] if u["layer"] == 1)
    data = saved_dir / man["data"]
    raw = bytearray(data.read_bytes())
    raw[u["offset"] + 5] ^= 0x08
    data.write_bytes(bytes(raw))
    with conversation(model_dir) as c:
        c.load(saved_dir, overlap=True)
        with pytest.raises(ValueError, match=f"checksum mismatch in {data} at offset {u['offset']} "):
            c.append(P + Q, max_new_tokens=6)
        assert c.tokens == []
        got = c.append(P + Q, breaks=(len(P),), max_new_tokens=6)
    ref = reference(model_dir)
    assert got.tokens == ref.tokens and got.output_digest == ref.output_digest


def test_closing_with_a_load_in_flight_joins_the_readers(model_dir, saved_dir, slow_last_layer):
    """Fault caught: a conversation closed (its homes freed) while reader threads still write
    into them."""
    with conversation(model_dir) as c:
        c.load(saved_dir, overlap=True)
    ended = len(slow_last_layer)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvpipe-load")]
    time.sleep(3 * DELAY_S)
    assert len(slow_last_layer) == ended


def test_a_save_right_after_an_overlapped_load_writes_the_loaded_units(model_dir, saved_dir, tmp_path,
                                                                       slow_last_layer):
    """Fault caught: a save that reads the homes while the load behind it still fills them (its
    checksums then vouch for half-loaded units)."""
    with conversation(model_dir) as c:
        c.load(saved_dir, overlap=True)
        c.save(tmp_path / "again")
    with conversation(model_dir) as c:
        c.load(tmp_path / "again")
        got = c.append(P + Q, max_new_tokens=6)
    ref = reference(model_dir)
    assert got.tokens == ref.tokens and got.output_digest == ref.output_digest


@pytest.mark.gpu
def test_on_the_gpu_a_prefill_waits_for_late_copies(model_dir, tmp_path, monkeypatch):
    """Fault caught: on CUDA, a stream lane's prefill stage that waits on the host for its layer
    but not for the GPU units' H2D copies (their events): the readers' streams sleep before
    every copy, so compute that does not wait reads the homes before the copies land."""
    gpu = dict(device="cuda", dtype="bf16")
    kvpipe.generate(str(model_dir), " ".join(map(str, P)), prompt_format="ids", max_new_tokens=3,
                    save_kv=tmp_path / "kv", **dict(OPTS, **gpu))
    to_gpu = loader._Reader._to_gpu

    def late(self, dst, offset, spans):
        if getattr(self.local, "stream", None) is None:
            self.local.stream = torch.cuda.Stream(self.store.device)
            self.local.events = [None, None]
        with torch.cuda.stream(self.local.stream):
            torch.cuda._sleep(100_000_000)      # some 50 ms of GPU time before the unit's copies
        return to_gpu(self, dst, offset, spans)
    monkeypatch.setattr(loader._Reader, "_to_gpu", late)
    with conversation(model_dir, **gpu) as c:
        c.load(tmp_path / "kv", overlap=True)
        got = c.append(P + Q, max_new_tokens=6)
    monkeypatch.setattr(loader._Reader, "_to_gpu", to_gpu)
    ref = reference(model_dir, **gpu)
    assert got.tokens == ref.tokens and got.output_digest == ref.output_digest
