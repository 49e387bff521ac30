"""LoRA without the real model: the torch batched delta against a per-token reference, PEFT
folder checks (one clear sentence per bad adapter), and the scheduler's max_loras limit on
the simulated engine (an adapter past the limit waits; base-model requests pass it)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from kvgate.testing import triton_mode

# Before anything imports Triton: it fixes interpret-or-compile then (the kernel test below ran
# only where another module's collection had set it first, and failed when run alone).
triton_mode.configure()

from kvgate.api.lora import lora_int_id  # noqa: E402
from kvgate.engine.config import EngineConfig, SimulationConfig  # noqa: E402
from kvgate.engine.layers.lora import lora_delta  # noqa: E402
from kvgate.engine.llm_engine import LLMEngine, LoRANotLoaded  # noqa: E402
from kvgate.engine.loader.peft import LoRAAdapterError, load_peft_adapter  # noqa: E402
from kvgate.engine.models.config import ModelConfig  # noqa: E402
from kvgate.engine.sampling_params import SamplingParams  # noqa: E402

CFG = ModelConfig(
    architecture="llama",
    vocab_size=100,
    hidden_size=16,
    intermediate_size=40,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=64,
)


def test_lora_delta_matches_per_token_reference() -> None:
    torch.manual_seed(0)
    tokens, d_in, d_out, slots_n, r_max = 23, 12, 9, 3, 8
    x = torch.randn(tokens, d_in, dtype=torch.float64)
    a = torch.zeros(slots_n, r_max, d_in, dtype=torch.float64)
    b = torch.zeros(slots_n, d_out, r_max, dtype=torch.float64)
    for s, rank in enumerate((2, 8, 5)):  # ranks below r_max are zero-padded
        a[s, :rank] = torch.randn(rank, d_in, dtype=torch.float64)
        b[s, :, :rank] = torch.randn(d_out, rank, dtype=torch.float64)
    scaling = torch.tensor([0.5, 2.0, 1.25], dtype=torch.float64)
    slots = torch.randint(-1, slots_n, (tokens,))
    slots[:3] = torch.tensor([-1, 0, 2])
    got = lora_delta(x, slots, a, b, scaling)
    for t in range(tokens):
        s = int(slots[t])
        want = torch.zeros(d_out, dtype=torch.float64) if s < 0 else scaling[s] * (b[s] @ (a[s] @ x[t]))
        assert torch.allclose(got[t], want), t
    assert got[slots == -1].abs().max() == 0
    assert lora_delta(x[:0], slots[:0], a, b, scaling).shape == (0, d_out)


def _adapter(
    folder: Path,
    *,
    r: int = 4,
    targets: Any = ("q_proj", "down_proj"),
    hidden: int = 16,
    layers: int = 2,
    extra: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    conf = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": list(targets), **(extra or {})}
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    if tensors is None:
        tensors = {}
        shapes = {"q_proj": (hidden, 16), "down_proj": (40, hidden), "k_proj": (hidden, 8)}
        for layer in range(layers):
            for proj in targets:
                block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                d_in, d_out = shapes[proj]
                key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, d_in)
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, r)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_peft_folder_is_read_with_its_scaling(tmp_path: Path) -> None:
    adapter = load_peft_adapter("a", str(_adapter(tmp_path / "a")), CFG, max_rank=8)
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert sorted(adapter.weights) == [(0, "down_proj"), (0, "q_proj"), (1, "down_proj"), (1, "q_proj")]
    rs = load_peft_adapter("b", str(_adapter(tmp_path / "b", extra={"use_rslora": True})), CFG, 8)
    assert rs.scaling == pytest.approx(8 / math.sqrt(4))


def _bad(tmp_path: Path, case: str) -> Path:
    folder = tmp_path / case
    if case == "no folder":
        return folder
    if case == "no config":
        folder.mkdir()
        return folder
    if case == "bin only":
        _adapter(folder)
        (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
        return folder
    if case == "no weights":
        _adapter(folder)
        (folder / "adapter_model.safetensors").unlink()
        return folder
    if case == "rank":
        return _adapter(folder, r=16)
    if case == "unknown target":
        return _adapter(folder, extra={"target_modules": ["q_proj", "lm_head"]})
    if case == "other model":
        return _adapter(folder, hidden=32)
    if case == "layers":
        return _adapter(folder, layers=3)
    if case == "unpaired":
        t = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16)}
        return _adapter(folder, tensors=t)
    if case == "bad json":
        _adapter(folder)
        (folder / "adapter_config.json").write_text("{nope")
        return folder
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, message",
    [
        ("no folder", "not a folder"),
        ("no config", "adapter_config.json is missing"),
        ("bin only", "adapter_model.bin (a pickle) is not loaded"),
        ("no weights", "adapter_model.safetensors is missing"),
        ("rank", "rank 16 exceeds --max-lora-rank 8"),
        ("unknown target", "unknown target modules ['lm_head']"),
        ("other model", "trained for another base model"),
        ("layers", "the base model has 2 layers"),
        ("unpaired", "has lora_A but not its pair"),
        ("bad json", "not valid JSON"),
    ],
)
def test_bad_adapters_are_one_clear_error(tmp_path: Path, case: str, message: str) -> None:
    with pytest.raises(LoRAAdapterError) as err:
        load_peft_adapter("x", str(_bad(tmp_path, case)), CFG, max_rank=8)
    assert message in str(err.value) and "'x'" in str(err.value)


def test_scheduler_runs_at_most_max_loras_adapters_and_base_requests_pass(tok: Any) -> None:
    cfg = EngineConfig(
        simulate=True,
        enable_lora=True,
        max_loras=2,
        num_kv_blocks=256,
        simulation=SimulationConfig(time_scale=0),
    )
    engine = LLMEngine(cfg, tokenizer=tok)
    names = ["a", "b", "c"]
    for name in names:
        engine.add_lora(name, engine.load_lora(name, f"/adapters/{name}"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # a, b, c, c then a base request: c must wait for a slot, the base request must not.
    for i, name in enumerate([*names, "c"]):
        engine.add_request(f"{name}{i}", [5, 6, 7, i], params, lora_id=lora_int_id(name))
    engine.add_request("base", [5, 6, 7], params)
    seen: list[set[int]] = []
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        stats = engine.get_stats()
        assert len(stats.running_loras) <= 2
        if step == 0:
            assert stats.waiting_loras == ("a", "b", "c")
        batch_ids: set[int] = set()
        schedule = engine.scheduler.schedule

        def spy(schedule: Any = schedule, batch_ids: set[int] = batch_ids, step: int = step) -> Any:
            b = schedule()
            batch_ids.update(s.lora_id for s in b.seqs if s.lora_id is not None)
            for s in b.seqs:
                first.setdefault(s.request_id, step)
            return b

        engine.scheduler.schedule = spy  # type: ignore[method-assign]
        engine.step()
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
        seen.append(batch_ids)
        if step == 0:
            assert engine.get_stats().running_loras == ("a", "b")
            assert engine.get_stats().waiting_loras == ("c",)
        step += 1
    assert max(len(s) for s in seen) == 2
    assert first["base"] == 0  # not starved behind the waiting adapter
    assert first["c2"] > 0 and first["c2"] == first["c3"]
    assert engine.runner.lora_loads_total == 3  # type: ignore[attr-defined]


def test_unloading_waits_for_running_requests(tok: Any) -> None:
    cfg = EngineConfig(simulate=True, enable_lora=True, simulation=SimulationConfig(time_scale=0))
    engine = LLMEngine(cfg, tokenizer=tok)
    engine.add_lora("a", engine.load_lora("a", "/adapters/a"))
    engine.add_request(
        "r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), lora_id=lora_int_id("a")
    )
    engine.step()
    assert engine.remove_lora("a")
    assert not engine.remove_lora("a")  # already going
    assert lora_int_id("a") in engine.loras  # kept: a running request still needs its weights
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("s", [5], SamplingParams(max_tokens=1), lora_id=lora_int_id("a"))
    while engine.has_unfinished_requests():
        engine.step()  # the running request ends under its adapter
    assert engine.loras == {}
    engine.add_lora("a", engine.load_lora("a", "/adapters/a"))  # and the name can come back


def test_a_load_while_unloading_cancels_the_unload(tok: Any) -> None:
    """Loading a name whose unload still waits for its running requests keeps the adapter
    (with the new weights): new requests are admitted, and it stays after the running ones end.
    Before, the load was refused ("still being unloaded")."""
    cfg = EngineConfig(simulate=True, enable_lora=True, simulation=SimulationConfig(time_scale=0))
    engine = LLMEngine(cfg, tokenizer=tok)
    engine.add_lora("a", engine.load_lora("a", "/adapters/a"))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("r", [5, 6, 7], params, lora_id=lora_int_id("a"))
    engine.step()
    assert engine.remove_lora("a")
    with pytest.raises(LoRANotLoaded):
        engine.add_request("s", [5], params, lora_id=lora_int_id("a"))
    engine.add_lora("a", engine.load_lora("a", "/adapters/a2"))
    engine.add_request("s", [5], params, lora_id=lora_int_id("a"))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.loras == {lora_int_id("a"): "a"}


def _tiny_manager(max_loras: int, max_cpu_loras: int | None = None) -> Any:
    from kvgate.engine.layers.attention import TorchAttentionBackend
    from kvgate.engine.lora_manager import LoRAManager
    from kvgate.engine.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG, TorchAttentionBackend(), 64, torch.float32, torch.device("cpu"))
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    return LoRAManager(model, max_loras, 8, max_cpu_loras, torch.device("cpu"), torch.float32)


def _seq(rid: str, n: int, lora_id: int | None) -> Any:
    from kvgate.engine.core.runner_api import ScheduledSeq

    return ScheduledSeq(rid, [1] * n, 0, [0], True, SamplingParams(), lora_id=lora_id)


def test_fused_projections_get_each_shard_delta_in_its_slice(tmp_path: Path) -> None:
    manager = _tiny_manager(max_loras=2)
    path = _adapter(tmp_path / "a", targets=("q_proj", "k_proj", "down_proj"))
    adapter = manager.load("a", str(path))
    manager.add(7, adapter)
    manager.prepare([_seq("base", 2, None), _seq("a", 3, 7)], frozenset())
    assert manager.batch.slots is not None and manager.batch.slots.tolist() == [-1, -1, 0, 0, 0]
    layer = manager.model.layers[1]
    x = torch.randn(5, 16)
    qkv = layer.self_attn.qkv_proj
    with torch.inference_mode():
        got = qkv(x)
        base = torch.nn.functional.linear(x, qkv.weight)
    a_q, b_q = adapter.weights[(1, "q_proj")]
    a_k, b_k = adapter.weights[(1, "k_proj")]
    want = base.clone()
    want[2:, :16] += 2.0 * x[2:] @ a_q.t() @ b_q.t()
    want[2:, 16:24] += 2.0 * x[2:] @ a_k.t() @ b_k.t()  # v (24:32) untouched: not a target
    assert torch.allclose(got, want, atol=1e-5)
    manager.prepare([_seq("base", 2, None)], frozenset())  # a base-only step: no LoRA at all
    assert manager.batch.slots is None
    with torch.inference_mode():
        assert torch.equal(qkv(x), base)


def test_slot_lru_spares_running_adapters_and_cpu_cache_reloads(tmp_path: Path) -> None:
    manager = _tiny_manager(max_loras=2, max_cpu_loras=2)
    for i in (1, 2, 3):
        manager.add(i, manager.load(f"a{i}", str(_adapter(tmp_path / f"a{i}"))))
    assert list(manager.cpu) == [2, 3]  # CPU cache: the 2 most recent
    manager.prepare([_seq("r1", 1, 1)], frozenset({1}))  # a1 read again from disk
    manager.prepare([_seq("r2", 1, 2)], frozenset({1, 2}))
    assert manager.slot_ids == [1, 2]
    # a3 needs a slot: a1 is least recent but still running, so a2's slot goes
    manager.prepare([_seq("r3", 1, 3)], frozenset({1, 3}))
    assert manager.slot_ids == [1, 3] and manager.slot_loads_total == 3
    manager.prepare([_seq("r1", 1, 1), _seq("r3", 1, 3)], frozenset({1, 3}))
    assert manager.slot_loads_total == 3  # both already in slots: no copy
    manager.remove(3)
    assert manager.slot_ids == [1, None] and 3 not in manager.registered


@pytest.mark.triton
def test_kernel_equals_torch_path_on_manager_slots(tmp_path: Path) -> None:
    """The GPU path reads the slot buffers the CPU path reads: under TRITON_INTERPRET=1 the
    Triton kernel, accumulating into a projection's output, equals the torch path on the stacked
    weights LoRAManager builds (fused q|k|v with block-placed B, ranks 4 and 8, base tokens)."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    from kvgate.engine.layers.lora import lora_delta_torch

    if triton_mode.compiled():
        pytest.skip("the torch path runs on CPU tensors; the compiled kernel is test_lora_kernel.py's")
    kernels = triton_mode.kernel_module("kvgate.engine.kernels.lora")
    manager = _tiny_manager(max_loras=2)
    manager.add(1, manager.load("a", str(_adapter(tmp_path / "a", r=4, targets=("q_proj", "k_proj")))))
    manager.add(2, manager.load("b", str(_adapter(tmp_path / "b", r=8, targets=("q_proj", "down_proj")))))
    manager.prepare([_seq("x", 2, 1), _seq("base", 3, None), _seq("y", 4, 2)], frozenset())
    slots, scaling = manager.batch.slots, manager.batch.scaling
    assert slots is not None and scaling is not None
    for fused in ("qkv_proj", "down_proj"):
        module, weights = manager.targets[(0, fused)]
        x = torch.randn(9, module.in_features)
        base = torch.randn(9, module.out_features)
        want = base + lora_delta_torch(x, slots, weights.lora_a, weights.lora_b, scaling)
        got = base.clone()
        kernels.lora_delta_triton(x, slots, weights.lora_a, weights.lora_b, scaling, out=got)
        assert torch.allclose(got, want, atol=1e-5), fused


def _stored_and_removed(engine: LLMEngine, lora_id: int | None) -> tuple[list[int], list[int]]:
    """The KV events since the last call: hashes stored under `lora_id`, hashes removed."""
    from kvgate.api.contracts.kv_events import BlockRemoved, BlockStored

    stored: list[int] = []
    removed: list[int] = []
    for ev in engine.drain_kv_events():
        if isinstance(ev, BlockStored) and ev.lora_id == lora_id:
            stored += ev.block_hashes
        elif isinstance(ev, BlockRemoved):
            removed += ev.block_hashes
    return stored, removed


def _cached_tokens(engine: LLMEngine, rid: str, prompt: list[int], lora: str | None) -> int:
    """Run one request to its end; how many prompt tokens it found in the prefix cache."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request(rid, prompt, params, lora_id=lora_int_id(lora) if lora else None)
    cached = -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                cached = out.num_cached_tokens
    return cached


def test_new_weights_under_a_name_drop_its_cached_blocks(tok: Any) -> None:
    """A reload of an adapter name with other weights (another path, or vLLM's load_inplace)
    must never let a request hit KV computed with the old ones: every block cached under it
    goes (BlockRemoved for exactly those, so a router's index drops them too), other adapters'
    and the base model's stay. The same path again is not a weight change: the hits stay.
    Before the fix the reloaded adapter's requests hit the old blocks."""
    cfg = EngineConfig(simulate=True, enable_lora=True, simulation=SimulationConfig(time_scale=0))
    engine = LLMEngine(cfg, tokenizer=tok)
    bs = engine.block_size
    prompt = [(7 * i) % 90 + 3 for i in range(3 * bs + 5)]  # 3 full blocks before the tail
    hit = 3 * bs
    engine.add_lora("a", engine.load_lora("a", "/adapters/a1"))
    engine.add_lora("b", engine.load_lora("b", "/adapters/b"))
    for lora in ("a", "b", None):
        assert _cached_tokens(engine, f"warm-{lora}", prompt, lora) == 0
    a_blocks, _ = _stored_and_removed(engine, lora_int_id("a"))
    assert len(a_blocks) == 3
    assert _cached_tokens(engine, "a-again", prompt, "a") == hit

    # the same path, no load_inplace (e.g. a load that cancels a pending unload): same weights
    engine.add_lora("a", engine.load_lora("a", "/adapters/a1"))
    assert _stored_and_removed(engine, lora_int_id("a")) == ([], [])
    assert _cached_tokens(engine, "a-same-path", prompt, "a") == hit

    # another path: new weights
    engine.add_lora("a", engine.load_lora("a", "/adapters/a2"))
    assert sorted(_stored_and_removed(engine, lora_int_id("a"))[1]) == sorted(a_blocks)
    assert _cached_tokens(engine, "a-new-path", prompt, "a") == 0
    assert _cached_tokens(engine, "b-kept", prompt, "b") == hit
    assert _cached_tokens(engine, "base-kept", prompt, None) == hit
    a_blocks, _ = _stored_and_removed(engine, lora_int_id("a"))
    assert len(a_blocks) == 3  # the new weights' blocks are cached again, same hashes
    assert _cached_tokens(engine, "a-new-again", prompt, "a") == hit

    # load_inplace at the same path: the files there were replaced
    engine.add_lora("a", engine.load_lora("a", "/adapters/a2"), inplace=True)
    assert sorted(_stored_and_removed(engine, lora_int_id("a"))[1]) == sorted(a_blocks)
    assert _cached_tokens(engine, "a-inplace", prompt, "a") == 0

    # unloaded for good (its blocks stay cached), then loaded from another path
    _stored_and_removed(engine, lora_int_id("a"))
    assert engine.remove_lora("a") and engine.loras.get(lora_int_id("a")) is None
    assert _cached_tokens(engine, "b-between", prompt, "b") == hit
    engine.add_lora("a", engine.load_lora("a", "/adapters/a3"))
    assert len(_stored_and_removed(engine, lora_int_id("a"))[1]) == 3
    assert _cached_tokens(engine, "a-after-unload", prompt, "a") == 0


def test_requests_running_through_a_weight_change_never_cache_their_blocks(tok: Any) -> None:
    """A request that computed KV with the old weights goes on (with the new ones, as in vLLM)
    but its blocks, old or filled after the change, never become findable: a new request with
    its prompt gets no hit while it runs or after it ends, and no BlockStored names them."""
    cfg = EngineConfig(simulate=True, enable_lora=True, simulation=SimulationConfig(time_scale=0))
    engine = LLMEngine(cfg, tokenizer=tok)
    bs = engine.block_size
    prompt = [(5 * i) % 90 + 3 for i in range(2 * bs + 1)]
    lid = lora_int_id("a")
    engine.add_lora("a", engine.load_lora("a", "/adapters/a1"))
    engine.add_request("old", prompt, SamplingParams(max_tokens=2 * bs, ignore_eos=True), lora_id=lid)
    engine.step()  # the prefill: 2 blocks cached under the old weights
    stored, _ = _stored_and_removed(engine, lid)
    assert len(stored) == 2
    engine.add_lora("a", engine.load_lora("a", "/adapters/a2"))
    assert sorted(_stored_and_removed(engine, lid)[1]) == sorted(stored)
    old_tokens: list[int] = []
    for _ in range(bs + 2):  # decode past a block boundary: a block fills under mixed weights
        for out in engine.step():
            old_tokens = out.token_ids
    assert _stored_and_removed(engine, lid)[0] == []
    # a new request extending the old one's sequence (its filled decode block included) misses
    assert engine.has_unfinished_requests()
    longer = [*prompt, *old_tokens, 1]
    assert _cached_tokens(engine, "new", longer, "a") == 0
    assert _stored_and_removed(engine, lid)[0]  # the new request's own blocks are cached
    assert _cached_tokens(engine, "new-again", longer, "a") == (len(longer) - 1) // bs * bs
