"""pipeline/pinned_blocks.py and the host peak it gives the memory model: where decode will be
replayed torch pins the KV homes in power-of-two blocks, and the plan's host peak must be those
blocks (what the run pins), not the homes' own bytes. Figures worked out by hand in the comments."""
import pytest

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.memory import breakdown, pinned_homes_bytes
from kvpipe.pipeline.model import ModelSpec, preset
from kvpipe.pipeline.pinned_blocks import carve
from kvpipe.pipeline.plan import Method, PhasePlan, Plan, decode_replayed
from kvpipe.pipeline.replay import Replay
from kvpipe.pipeline.stage import Pool
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.planner import NoPlanFits, Pins, _Search, search

GiB, KiB = 2**30, 2**10
WORK_512K = Workload(524288, 4, 1)
# Llama-3-8B: 32 layers x 8 KV heads x 128 dims, bf16. One layer's home at 524288 + 4 tokens:
# 8 heads x 524292 tokens x 2 (K, V) x 128 x 2 bytes = 2 GiB + 16 KiB; 32 of them 64 GiB + 512 KiB.
HOME = 2 * GiB + 16 * KiB
EXACT = 32 * HOME
# Carved: the largest power of two <= 64 GiB + 512 KiB is 64 GiB, it holds 31 homes; the 32nd
# takes the next power of two above 2 GiB + 16 KiB, 4 GiB: 68 GiB pinned. No disk units, no
# staging ring, no codec: no other host bytes.
CARVED = 64 * GiB + 4 * GiB


def _plan(replay, resident=0, disk=0):
    return Plan(Method.HEADWISE, PhasePlan(4, 16384, 2), PhasePlan(4, 1, 2), resident, disk,
                replay=Replay.from_json(replay))   # as a plan file writes it: true, false or null


@pytest.mark.parametrize("replay", [True, None])
def test_replayed_512k_host_peak_is_the_68_gib_torch_pins(replay):
    """Fault caught: the exact 512K Llama-3-8B run replayed its decode and torch pinned 68 GiB of
    blocks while the memory model (fits, the planner, --max-context) counted the homes' 64 GiB.
    A plan that will replay (replay true, or none: `run --replay auto` replays bf16 batch 1) now
    counts the blocks, in the breakdown and in the simulator's static host pool."""
    spec, plan = preset("llama-3-8b"), _plan(replay)
    assert decode_replayed(spec, WORK_512K, plan)
    mem = breakdown(spec, WORK_512K, plan)
    assert mem.host_kv == EXACT == 64 * GiB + 512 * KiB and mem.host_buffers == 0
    assert mem.host == CARVED == 68 * GiB and mem.host_slack == CARVED - EXACT
    assert build(spec, WORK_512K, plan, decode=range(1)).static_bytes(Pool.HOST) == CARVED


@pytest.mark.parametrize("plan,work", [(_plan(False), WORK_512K),                   # eager: registered homes
                                       (_plan(None), Workload(524288, 0, 1)),       # no decode to replay
                                       (_plan(None), Workload(524288, 4, 2))])      # batch 2 cannot replay
def test_eager_512k_host_peak_stays_the_exact_homes(plan, work):
    """Homes registered with the driver (eager decode) are exact: 64 GiB + 512 KiB per sequence
    (64 GiB without decode tokens: 524288 tokens of capacity, 512 bytes per head and token)."""
    spec = preset("llama-3-8b")
    assert not decode_replayed(spec, work, plan)
    mem = breakdown(spec, work, plan)
    exact = EXACT if work.decode_tokens else 64 * GiB
    assert mem.host == mem.host_kv == work.batch * exact and mem.host_slack == 0


def test_disk_plan_keeps_exact_homes_and_its_staging():
    """Disk units block replay (Plan.replay_blocker): the homes are registered, exact; the host also
    holds the staging ring (depth 2 slots of a 4-head group at full length: 2 x 4 x 524292 x 512 B)."""
    spec = preset("llama-3-8b")
    mem = breakdown(spec, WORK_512K, _plan(None, disk=1))
    assert mem.host_slack == 0 and mem.host_kv == EXACT - HOME // 8
    assert mem.host_buffers == 2 * 4 * 524292 * 512 and mem.host == mem.host_kv + mem.host_buffers


def test_pinned_homes_follow_placement_and_the_carve_law():
    """Resident units spread over layers as `placement` does (the first resident % L layers one
    more): 33 resident of 32 x 8 leave layer 0 six host heads and the others seven."""
    spec = preset("llama-3-8b")
    unit = HOME // 8
    assert pinned_homes_bytes(spec, WORK_512K, 33) == carve([6 * unit] + [7 * unit] * 31).total_bytes
    assert pinned_homes_bytes(spec, WORK_512K, spec.units) == 0


def test_planner_runs_decode_eagerly_where_only_exact_homes_fit_the_host():
    """A host budget between the exact homes and the carved blocks (0.9 x 73 GiB = 65.7 GiB): the
    replayed plan does not fit, so the search places the plan with eager decode (registered,
    exact homes) instead of reporting a replayed plan the run cannot pin; pinned to replay, no plan
    fits and the message names what torch pins."""
    spec = preset("llama-3-8b")
    budgets = {"gpu": 24 * GiB, "host": 73 * GiB, "disk": 1024 * GiB}
    s = _Search(spec, WORK_512K, None, budgets)
    placed = s.place(_plan(None), 0)
    assert placed is not None and placed.disk == 0 and placed.replay is Replay.OFF
    assert breakdown(spec, WORK_512K, placed).host == EXACT
    assert s.stamped(placed).replay is Replay.OFF
    assert _Search(spec, WORK_512K, None, budgets, replay=Replay.ON).place(_plan(None), 0) is None
    roomy = dict(budgets, host=80 * GiB)                      # 72 GiB of room: the blocks fit
    assert _Search(spec, WORK_512K, None, roomy).place(_plan(None), 0).replay is Replay.AUTO


def test_replay_pinned_no_fit_message_counts_the_carved_blocks():
    """Pinned to replay at 73 GiB of host: the smallest budget asked for is the blocks' 68 GiB / 0.9."""
    spec, h200 = preset("llama-3-8b"), load_profile("h200")
    budgets = {"gpu": 24 * GiB, "host": 73 * GiB, "disk": 1024 * GiB}
    with pytest.raises(NoPlanFits, match=r"torch pins it as 68\.0 GiB.*--host-mem 75\.6GiB"):
        search(spec, WORK_512K, h200, budgets, Pins(group=1, chunk=1024, resident=0, depth=2, replay=Replay.ON))


def test_executor_host_reserved_bytes_equal_the_pipeline_figure():
    """The executor's torch-pinned homes (simulated on the CPU: the arena carves plain memory the
    same way) reserve exactly what the memory model counts for the replayed plan: 2 resident units
    of 3 x 4 leave homes of 3, 3 and 4 heads (not 4, 4, 4: placement gives layers 0 and 1 one each)."""
    torch = pytest.importorskip("torch")
    from kvpipe.executor.kv.layout import KVLayout
    from kvpipe.executor.kv.store import KVStore
    spec = ModelSpec("tiny", "llama", layers=3, hidden=64, q_heads=8, kv_heads=4, head_dim=16,
                     intermediate=32, vocab=50, dtype="bf16")
    work = Workload(1030, 4, 1)
    plan = Plan(Method.HEADWISE, PhasePlan(2, 512, 2), PhasePlan(2, 1, 2), 2, 0, replay=Replay.ON)
    graph = build(spec, work, plan)
    with KVStore(KVLayout.of(graph), torch.device("cpu"), torch.bfloat16, replay=True) as store:
        assert store.host_bytes == breakdown(spec, work, plan).host_kv
        assert store.host_reserved_bytes == breakdown(spec, work, plan).host > store.host_bytes
