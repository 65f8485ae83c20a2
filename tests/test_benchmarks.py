"""The layer benchmark parses its options and measures a tiny step (no timing is asserted)."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest

from triton_helpers import needs_triton


@pytest.fixture
def layer_speed(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import layer_speed

    return layer_speed


def test_options_and_the_softmax_baseline(layer_speed):
    args = layer_speed.parse_args(["--lengths", "64", "128", "--layers", "vq_hard", "--autocast", "bf16",
                                   "--dtype", "bfloat16", "--device", "cpu", "--rounds", "2"])
    assert args.lengths == [64, 128] and args.autocast == "bf16" and args.dtype == "bfloat16" and args.rounds == 2
    assert args.layers == ["softmax", "vq_hard"]  # the baseline of the ratios is always measured
    defaults = layer_speed.parse_args([])
    assert set(defaults.layers) == set(layer_speed.ATTENTIONS) and defaults.dim == 256 and defaults.heads == 4
    assert not defaults.compile and layer_speed.parse_args(["--compile"]).compile
    with pytest.raises(SystemExit):
        layer_speed.parse_args(["--layers", "no_such_layer"])


@pytest.mark.parametrize("name,autocast", [("vq_soft", "none"), ("vq_hard", "bf16")])
def test_one_tiny_step_is_measured(layer_speed, name, autocast):
    result = layer_speed.child(name, T=40, device="cpu", reps=1, dtype="float32", autocast=autocast, dim=32,
                               num_heads=2, num_codes=8)
    assert result["ms"] > 0 and math.isfinite(result["peak_mb"])


def test_in_process_rows_measure_here_and_report_a_failure(layer_speed, monkeypatch):
    """--in-process runs each row's child in this process (CUDA only), and a row that raises reports its error
    as a failed child does, without ending the table."""
    import attention_speed

    with pytest.raises(ValueError, match="--in-process"):
        layer_speed.parse_args(["--device", "cpu", "--in-process"])
    monkeypatch.setattr(attention_speed, "IN_PROCESS", True)
    args = layer_speed.parse_args(["--device", "cpu", "--dim", "32", "--heads", "2", "--num-codes", "8", "--reps", "1"])
    row = layer_speed.measure(args, "vq_hard", 40)
    assert row["ms"] > 0, row
    failed = layer_speed.measure(args, "vq_hard", 0)
    assert math.isnan(failed["ms"]) and "Error" in failed["error"]


def test_the_delta_rule_row_and_fla_peer_take_the_same_inputs_in_their_layouts(layer_speed):
    """attention_speed's delta_rule row runs the library's op on L2-normalised q and k with β in (0, 1) and log
    decays ≤ 0; fla's peer gets the same per-token values in its (B, T, H) layout (run here on fla's naive
    recurrence, the definition the GPU row's chunk kernel implements)."""
    import attention_speed
    import torch

    from vqattn.functional import delta_rule_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 37, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    qn, kn, beta, log_decay = attention_speed.delta_rule_inputs(q, k, 2)
    assert beta.shape == (1, 2, 37) and bool(((0 < beta) & (beta < 1)).all()) and bool((log_decay <= 0).all())
    torch.testing.assert_close(qn.norm(dim=-1), torch.ones(1, 2, 37, dtype=torch.float64))
    out = attention_speed.attention("delta_rule", q, k, v, None, None, impl="chunk")
    torch.testing.assert_close(out, delta_rule_attention(qn, kn, v, beta, log_decay, impl="naive"))
    fla_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, H, T, ·) -> fla's (B, T, H, ·)
    q2, k2, beta2, log_decay2 = attention_speed.delta_rule_inputs(t(q), t(k), 1)
    want = fla_naive.naive_recurrent_gated_delta_rule(q2, k2, t(v), beta2.transpose(1, 2), log_decay2.transpose(1, 2))
    torch.testing.assert_close(t(want[0]).double(), out, rtol=1e-5, atol=1e-6)  # fla's naive computes in float32


@pytest.mark.parametrize("flags", [[], ["--compile", "--autocast", "bf16"], ["--tuned-allocator"]])
def test_every_option_reaches_the_child(layer_speed, monkeypatch, flags):
    sent = []
    monkeypatch.setattr(layer_speed, "run_child", lambda script, argv: sent.append(json.loads(argv[0])) or {})
    args = layer_speed.parse_args(["--device", "cpu", *flags])
    layer_speed.measure(args, "vq_soft", 64)
    bound = inspect.signature(layer_speed.child).bind(**sent[0])  # every key is one of the child's arguments
    bound.apply_defaults()
    assert bound.arguments["compiled"] == ("--compile" in flags) and bound.arguments["autocast"] == args.autocast
    assert bound.arguments["tuned_allocator"] == ("--tuned-allocator" in flags)


def test_ratios_are_medians_of_per_round_ratios(layer_speed):
    rounds = [{"softmax": {"ms": 10.0, "peak_mb": 1.0}, "vq_hard": {"ms": 5.0, "peak_mb": 2.0}},
              {"softmax": {"ms": 40.0, "peak_mb": 1.0}, "vq_hard": {"ms": 10.0, "peak_mb": 3.0}},
              {"softmax": {"ms": 9.0, "peak_mb": 1.0}, "vq_hard": {"ms": 3.0, "peak_mb": 2.0}}]
    summary = layer_speed.summarise(rounds, "softmax")
    assert summary["vq_hard"]["ratio"] == 3.0 and summary["vq_hard"]["ms"] == 5.0
    assert summary["vq_hard"]["peak_mb"] == 3.0 and summary["softmax"]["ratio"] == 1.0


@pytest.mark.slow
def test_kernel_resources_of_a_layer_compile_for_a_gpu_here(monkeypatch, capsys, tmp_path):
    """kernel_resources.py records a vq_hard layer's launches under the interpreter and compiles each for sm_90 with
    Triton's ptxas, on this GPU-less machine. The layer's code scores have Dc = 30 (its slow RoPE pairs): padded to
    32, the superblock kernels load and store every half row vectorised. Their code loops hold no subnormal range
    fix-up (ptxas' compare with −126 or 2⁻¹²⁶ around ex2 and a precise log): the exponentials are flush-to-zero ex2
    and the counts take no logarithm."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernel_resources

    kernel_resources.main(["--what", "layer", "--method", "vq_hard", "--length", "64", "--dim", "128", "--heads", "2",
                           "--num-codes", "64", "--dump", str(tmp_path)])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    names = ("_superblock_forward_kernel", "_window_backward_kernel", "_superblock_code_backward_kernel")
    assert {"_rotation_kernel", "_nearest_kernel", "_superblock_sums_kernel", "_superblock_cache_grad_kernel",
            "_superblock_key_backward_kernel", *names} <= {row[0] for row in rows}
    sass = sorted(tmp_path.glob("*.sass"))  # one per row, in launch order
    # the backward runs as two kernels: the window's part (no loop), then the codes' (a loop over code tiles)
    launches = {name: [i for i, row in enumerate(rows) if row[0] == name] for name in names}
    (forward,), (window_backward,), (code_backward,) = launches.values()
    assert rows[window_backward][11] == "0"
    # within 168 registers without spilling: three programs of 4 warps per SM
    assert int(rows[code_backward][3]) <= 168 and rows[code_backward][4] == "0"
    for i in (forward, code_backward):
        warps, stages, regs, spill, shared, loads_b16, stores_b16 = rows[i][1:8]
        assert 0 < int(regs) <= 255 and int(warps) == 4
        assert (int(loads_b16), int(stores_b16)) == (0, 0)
        loop = kernel_resources.innermost_loops(sass[i].read_text())[0]
        assert int(rows[i][11]) == len(loop) > 0
        assert not [line for line in loop if "-126" in line or "1.175494350822287508e-38" in line], rows[i][0]


def test_kernel_profile_counts_gpu_events_once_and_names_their_launchers(monkeypatch):
    """The profile sums the GPU's own events by name (not the CPU ranges above them, which carry the same device
    time), and names the aten op and the outermost range that launched each PyTorch kernel."""
    from types import SimpleNamespace

    import torch

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernel_profile

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    node = SimpleNamespace(name="autograd::engine::evaluate_function: AddBackward0", cpu_parent=None, device_type=cpu,
                           device_time_total=3000.0, kernels=[])
    add = SimpleNamespace(name="aten::add", cpu_parent=node, device_type=cpu, device_time_total=3000.0,
                          kernels=[SimpleNamespace(name="add_kernel")])
    launch = SimpleNamespace(name="cudaLaunchKernel", cpu_parent=add, device_type=cpu, device_time_total=3000.0,
                             kernels=[SimpleNamespace(name="add_kernel")])
    events = [node, add, launch,
              SimpleNamespace(name="add_kernel", device_type=cuda, device_time_total=1000.0),
              SimpleNamespace(name="add_kernel", device_type=cuda, device_time_total=2000.0),
              SimpleNamespace(name="_prefix_kernel", device_type=cuda, device_time_total=500.0)]
    assert kernel_profile.device_kernels(events) == {"add_kernel": (3.0, 2), "_prefix_kernel": (0.5, 1)}
    found = kernel_profile.launchers(events, ["add_kernel", "_prefix_kernel"])
    assert dict(found) == {"add_kernel": {"aten::add < autograd::engine::evaluate_function: AddBackward0": 2}}


@pytest.mark.parametrize("method, what, design, first", [
    ("vq_hard_rope", "op", "superblock, K = 8", "_superblock_sums_kernel"),
    ("vq_soft_rope", "op", "soft_block_sums", "_soft_block_sums_kernel"),
    ("vq_soft", "layer", "soft_block_sums", "_soft_block_grads_kernel"),
    ("ovq", "op", "ovq", "_online_slots_kernel"),
])
def test_kernel_profile_reads_each_method_against_its_design(monkeypatch, method, what, design, first):
    """A profile of vq_hard, vq_soft or ovq is read against its own design's floors: each modelled kernel the step
    ran gets a row beside its floor, and the rest one row."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernel_floor
    import kernel_profile

    args = SimpleNamespace(what=what, method=method, batch=8, heads=16, length=8192, num_codes=512)
    slots = 64 if (what, method) == ("layer", "ovq") else 512
    shape = kernel_floor.Shape(B=8, H=16, T=8192, S=slots, Dc=32 if what == "layer" else 64)
    costs = kernel_floor.kernels(design.split(",")[0], shape)
    measured = {first: 1.0, "elementwise_kernel": 0.25}
    rows = kernel_profile.floor_rows(args, measured, "H200")
    assert f"design {design})" in rows[0]
    floor = next(c for c in costs if c.name == first).floor_s("H200") * 1e3
    assert rows[3] == f"| {first} | 1.000 | {floor:.3f} | {100 * floor:.0f}% |"
    assert rows[4] == "| everything else (PyTorch) | 0.250 | | |" and len(rows) == 5


@pytest.fixture
def packed_speed(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import packed_speed

    return packed_speed


def test_packed_speed_layouts_and_a_tiny_row(packed_speed, capsys, monkeypatch):
    assert packed_speed.parse_layout(["7", "3x2"]) == [7, 2, 2, 2]
    for bad in (["0"], ["x4"], ["2x"], ["ax3"]):
        with pytest.raises(ValueError, match="layout"):
            packed_speed.parse_layout(bad)
    # every op packed, and every way of handing over the documents with one op (the benchmark picks the op and the
    # form independently; the ops' own packed forms are tests/ops/test_varlen.py's)
    cases = [(op, True, False, "classes") for op in packed_speed.OPS]
    cases += [("window", packed, read, form) for packed, read, form in ((False, False, "classes"),
                                                                        (True, True, "classes"),
                                                                        (True, False, "segments"))]
    for op, packed, read, form in cases:
        result = packed_speed.child(op, [20, 3, 3], packed, "cpu", 1, H=2, D=8, S=8, slots=4, block_len=8,
                                    dtype="float32", read_every_call=read, form=form)
        assert result["ms"] > 0 and math.isfinite(result["peak_mb"])
    monkeypatch.setattr(packed_speed, "run_child", lambda script, args: packed_speed.child_from_argv(args))
    packed_speed.main(["--layout", "20", "2x3", "--ops", "window", "--rounds", "1", "--reps", "1", "--heads", "2",
                       "--head-dim", "8", "--block-len", "8", "--form", "segments"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| window")]
    assert len(rows) == 1 and "failed" not in rows[0]


def test_a_benchmarks_kernel_design_reaches_the_ops_and_layers_by_name(layer_speed, monkeypatch):
    """--superblock-blocks chooses the kernels' design for the process and the processes it starts, handed to the
    library as a Schedule (no library global is set)."""
    import attention_speed

    from vqattn.ops.blocks import Schedule

    monkeypatch.delenv(attention_speed.DESIGN_ENV, raising=False)
    assert attention_speed.design() == Schedule().superblocks == 8
    monkeypatch.setenv(attention_speed.DESIGN_ENV, "8")
    attention_speed.set_design(attention_speed.argparse.Namespace(superblock_blocks=0))
    assert attention_speed.design() == 0 and attention_speed.schedule() == Schedule(superblocks=0)
    layer = layer_speed.build("vq_hard", 32, 2, 8, "cpu", layer_speed.DTYPES["float32"])
    assert layer.schedule.superblocks == 0


@pytest.mark.slow
@needs_triton
def test_op_buffers_counts_a_step_of_each_op(monkeypatch, capsys):
    """The buffer count's plumbing on a tiny shape: one row per op, in MB and MiB."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import op_buffers

    op_buffers.main(["--length", "96", "--num-codes", "64"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith(("| vq", "| ovq"))]
    assert [r[0] for r in rows] == ["| vq_hard", "| vq_soft", "| ovq"]
    for _, mb, mib in rows:
        assert float(mb) > 0 and float(mib.rstrip(" |")) == pytest.approx(float(mb) * 1e6 / 2**20, abs=0.06)


def test_ovq_slots_counts_where_the_pairs_land(monkeypatch):
    """The slot diagnostic on a tiny ovq model: with one slot that novel keys join, every token shares it (known
    counts: each of the 4 keys' slot holds the 40 later tokens); with one slot and novel keys dropped, the first token
    alone is stored (threshold 0: every other key is novel); with 16 slots and threshold 0 the first block's 16 tokens
    open one each (the memory is empty), so the 4 keys and the 4 values take 4 slots each and all 16 are used."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ovq_slots
    import torch

    from vqattn.model import GPT, GPTConfig

    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    for slots, overflow, expected in (
            (1, "nearest", {"keys' slots": 1, "values' slots": 1, "later tokens in the keys' slots": 4 * 40,
                            "slots used": 1, "pair tokens not stored": 0}),
            (1, "drop", {"keys' slots": 1, "values' slots": 0, "later tokens in the keys' slots": 0,
                         "slots used": 1, "pair tokens not stored": 7, "later tokens not stored": 40}),
            (16, "drop", {"keys' slots": 4, "values' slots": 4, "slots used": 16, "pair tokens not stored": 0})):
        model = GPT(GPTConfig(attention="ovq", n_layer=2, n_embd=32, n_head=2, seq_len=48, attention_kwargs=dict(
            num_slots=slots, block_len=16, threshold=0.0, overflow=overflow)))
        rows = ovq_slots.slot_sharing(model, x, pairs=4)
        assert len(rows) == 2
        for row in rows:
            assert {name: row[name] for name in expected} == pytest.approx(expected)
