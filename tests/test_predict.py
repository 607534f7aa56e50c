"""The step-time prediction (minigpt/instruments/predict.py): its op list against the model's FLOP count, its
stage sums and bound labels under given rates, the rate cache, and the command line. No test
asserts a timing: the rates a test needs are given, or only checked to be positive."""

from __future__ import annotations

import json
import math

import pytest
import torch

from minigpt.config import UsageError, parse_args
from minigpt.core.model import GPT, GPTConfig
from minigpt.core.shape import Shape
from minigpt.instruments import estimate, peak, predict

SHAPE = dict(
    n_layers=2,
    d_model=64,
    n_heads=2,
    d_ff=256,
    seq_len=32,
    batch_size=2,
    vocab_size=128,
    max_position_embeddings=32,
)


def rates(
    flops: float = 1e9, bandwidth: float = 1e9, exps: float = 1e9, overhead: float = 1e-6
) -> predict.Rates:
    """Rates given, not measured: every kernel at `flops`, one bandwidth at every size."""
    return predict.Rates(
        device="cpu",
        dtype="fp32",
        matmul={"*": flops},
        bandwidth=[(1, bandwidth)],
        exps_per_s=exps,
        overhead_s={"op": overhead, "autograd": overhead},
        source="given",
    )


def test_matmul_flops_are_flops_per_token_less_the_vector_parameters():
    """The ops that run at a matmul or attention rate count exactly what flops_per_token counts,
    except 6 FLOPs per token for each bias and LayerNorm parameter (element-wise work, no product)."""
    model = GPT(GPTConfig(**Shape(**SHAPE).model_kwargs()))
    tokens = SHAPE["batch_size"] * SHAPE["seq_len"]
    vector_params = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    expected = tokens * (Shape(**SHAPE).flops_per_token - 6 * vector_params)
    assert predict.matmul_flops(predict.step_ops(Shape(**SHAPE))) == expected
    # the chunked loss runs the same three products of the LM head, a chunk of rows at a time
    chunked = predict.step_ops(
        Shape(**SHAPE, chunked_loss=True), loss_chunk_elements=SHAPE["vocab_size"] * 20
    )
    assert predict.matmul_flops(chunked) == expected


def test_checkpointing_adds_one_forward_of_every_block_to_the_backward():
    plain = predict.step_ops(Shape(**SHAPE))
    ckpt = predict.step_ops(Shape(**SHAPE, activation_checkpoint=True))
    h, f, s = SHAPE["d_model"], SHAPE["d_ff"], SHAPE["seq_len"]
    tokens = SHAPE["batch_size"] * s
    block_forward = 2 * tokens * (3 * h * h + h * h + 2 * h * f) + 4 * tokens * s * h
    assert predict.matmul_flops(ckpt) - predict.matmul_flops(plain) == SHAPE["n_layers"] * block_forward
    recomputed = [o for o in ckpt if o.stage == "backward" and o.kernel and "grad" not in o.name]
    assert {o.name for o in recomputed} >= {"qkv", "attn proj", "fc", "mlp proj"}


def test_chunk_rows_cover_every_token_once():
    ops = predict.step_ops(Shape(**SHAPE, chunked_loss=True), loss_chunk_elements=SHAPE["vocab_size"] * 20)
    logits = [o for o in ops if o.name == "chunk: logits, softmax, both gradients"]
    rows = sum(int(o.kernel.split()[-1].split("x")[0]) * o.count for o in logits)
    assert rows == SHAPE["batch_size"] * SHAPE["seq_len"]
    assert sorted(o.count for o in logits) == [1, 3]  # 64 tokens in chunks of 20: three full, one of 4


def test_each_product_is_named_with_its_layout_as_autograd_runs_it():
    """A linear's forward is x @ W.T ("nt", addmm with its bias); its input's gradient grad @ W
    ("nn"); its weight's gradient grad.T @ x ("tn"), whose transposed first operand runs at its own
    rate. GELU and the loss are kernels measured at their shapes too."""
    ops = {o.name: o.kernel for o in predict.step_ops(Shape(**SHAPE)) if o.kernel}
    n, h, f, v = SHAPE["batch_size"] * SHAPE["seq_len"], SHAPE["d_model"], SHAPE["d_ff"], SHAPE["vocab_size"]
    assert ops["gelu"] == f"gelu forward {n}x{f}" and ops["gelu backward"] == f"gelu backward {n}x{f}"
    assert ops["fc"] == f"addmm nt {n}x{f}x{h}" and ops["lm_head"] == f"matmul nt {n}x{v}x{h}"
    assert ops["fc grad input"] == f"matmul nn {n}x{h}x{f}"
    assert ops["fc grad weight"] == f"matmul tn {f}x{h}x{n}"


@pytest.mark.parametrize(
    "kernel",
    [
        "addmm nt 6x5x4",
        "gelu forward 6x5",
        "gelu backward 6x5",
        "loss chunk 3x64x8",
        "embedding backward 6x64x8",
        "optimizer adamw 6x2,10x1",
    ],
)
def test_every_kernel_kind_measures_a_positive_rate_in_cache_and_out_of_it(kernel):
    rate = predict.measure_kernel("cpu", "bf16", kernel, evict=lambda: None)
    assert rate["flops"] > 0 and all(r > 0 and math.isfinite(r) for r in rate["rounds"] + rate["cold"])


@pytest.mark.parametrize("layout", predict.LAYOUTS)
def test_a_layout_is_measured_on_operands_laid_out_so(layout, monkeypatch):
    seen = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: seen.append((a, b)) or real_mm(a, b, **kw))
    predict.measure_kernel("cpu", "fp32", f"matmul {layout} 6x5x4")
    a, b = seen[0]
    assert a.shape == (6, 4) and b.shape == (4, 5)
    assert (a.stride() == (1, 6), b.stride() == (1, 4)) == (layout[0] == "t", layout[1] == "t")


def test_a_kernel_is_timed_in_cache_then_after_an_eviction_and_a_read_of_what_the_op_before_wrote(
    monkeypatch,
):
    """Out of cache as in a step: the caches emptied before each timed call, then the product's
    first operand (a layer's input, or the gradient flowing back) read in; the weight stays out."""
    events = []
    real_sum, real_mm = torch.Tensor.sum, torch.mm
    monkeypatch.setattr(
        torch.Tensor, "sum", lambda t, *a, **kw: events.append(tuple(t.shape)) or real_sum(t, *a, **kw)
    )
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: events.append("mm") or real_mm(a, b, **kw))
    rate = predict.measure_kernel("cpu", "fp32", "matmul nn 6x5x4", evict=lambda: events.append("evict"))
    in_cache = len(rate["rounds"])
    assert len(rate["cold"]) == predict.EVICTED_CALLS
    cold = ["mm"] + ["evict", (6, 4), "mm"] * predict.EVICTED_CALLS  # each timing has one warm-up call
    assert events == ["mm"] * (1 + in_cache) + cold
    assert "cold" not in predict.measure_kernel("cpu", "fp32", "matmul nn 6x5x4")


def test_a_kernel_runs_at_the_geometric_mean_of_its_two_rates_and_the_range_spans_both(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))

    def kernel(device, dtype, name, evict=None):
        assert callable(evict)  # step_rates empties the caches for the out-of-cache timing
        # one kernel came out faster out of cache (noise): the range stays ordered
        rounds, cold = ([1e9], [4e9]) if name.startswith("gelu") else ([4e9], [1e9])
        return {"rounds": rounds, "cold": cold, "flops": 1}

    monkeypatch.setattr(predict, "measure_kernel", kernel)
    monkeypatch.setattr(predict, "measure_bandwidth", lambda d: {"1024": [1e12]})
    monkeypatch.setattr(predict, "measure_exp", lambda d: [1e12])
    monkeypatch.setattr(predict, "measure_overhead", lambda d: {"op": [0.0], "autograd": [0.0]})
    pred = predict.predict_step(Shape(**SHAPE), "fp32", "cpu")
    assert list(pred.rates.matmul.values()) == pytest.approx([2e9] * len(pred.rates.matmul))
    for stage, (fast, slow) in pred.range_ms.items():
        assert fast < pred.stages[stage].ms < slow
        assert pred.stages[stage].ms == pytest.approx(math.sqrt(fast * slow), rel=0.02)  # all kernels
    assert pred.to_record()["stage_ms_range"]["forward"] == list(pred.range_ms["forward"])
    assert "in cache - out of it" in predict.format_prediction(pred)


def test_the_optimizer_is_one_kernel_over_the_steps_own_parameters():
    shape = Shape(**SHAPE)
    [op] = [o for o in predict.step_ops(shape) if o.kernel and o.stage == "optimizer_step"]
    n_k = [pair.split("x") for pair in op.kernel.split()[-1].split(",")]
    assert sum(int(n) * int(k) for n, k in n_k) == sum(shape.param_sizes()) == op.elements
    assert sum(int(k) for _, k in n_k) == len(shape.param_sizes())
    measured = rates(bandwidth=1e12)
    measured.matmul[op.kernel] = 1.0
    stage = predict.predict_ops([op], measured)["optimizer_step"]
    assert stage.memory_ms == 1000 * op.elements and stage.compute_ms == 0  # it streams memory
    # with no measured rate (a GPU's data sheet), its bytes over the bandwidth
    stage = predict.predict_ops([op], rates(flops=1e30, bandwidth=1e9))["optimizer_step"]
    assert stage.memory_ms == pytest.approx(1000 * op.bytes / 1e9) and stage.compute_ms == 0


def test_a_large_models_optimizer_is_timed_on_a_sample_of_its_tensors():
    sizes = [50304 * 768, 1024 * 768, *[768 * 3072] * 48, *[768] * 98]  # about GPT-2 small's
    dims = [int(x) for x in predict.re.split("[x,]", predict.optimizer_kernel(sizes).split()[-1])]
    pairs = list(zip(dims[::2], dims[1::2]))
    assert sum(n * k for n, k in pairs) <= 1.1 * predict.OPTIMIZER_SAMPLE
    assert len(pairs) == len(set(sizes)) and min(k for _, k in pairs) >= 1  # every size has its share
    assert 768 * 3072 in {n for n, _ in pairs} and 50304 * 768 not in {n for n, _ in pairs}  # cut shorter
    small = Shape(**SHAPE).param_sizes()
    assert predict.optimizer_kernel(small).count("x") == len(set(small))  # a small model: all of it


def test_the_last_level_cache_is_read_from_sysfs(tmp_path, monkeypatch):
    for i, size in enumerate(["48K", "2048K", "480M"]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    real_glob = predict.glob.glob
    monkeypatch.setattr(predict.glob, "glob", lambda pattern: real_glob(str(tmp_path / "index*" / "size")))
    assert predict.last_level_cache_bytes() == 480 * 2**20
    monkeypatch.setattr(predict.glob, "glob", lambda pattern: [])
    assert predict.last_level_cache_bytes() == predict.LLC_FALLBACK_BYTES
    assert predict.cache_evictor("cuda") is None


def test_amp_moves_fewer_bytes_in_the_products_and_casts_the_weights():
    fp32, bf16 = predict.step_ops(Shape(**SHAPE)), predict.step_ops(Shape(**SHAPE), "bf16")
    assert not [o for o in fp32 if o.name.startswith("cast")]
    assert any(o.name == "cast qkv weight" for o in bf16)
    gemm = lambda ops: sum(o.bytes * o.count for o in ops if (o.kernel or "").startswith("matmul"))  # noqa: E731
    assert gemm(bf16) * 2 == gemm(fp32)


def test_twice_the_layers_predicts_a_longer_forward_and_backward():
    one = predict.predict_ops(predict.step_ops(Shape(**SHAPE)), rates())
    two = predict.predict_ops(
        predict.step_ops(Shape(**{**SHAPE, "n_layers": 2 * SHAPE["n_layers"]})), rates()
    )
    for stage in ("forward", "backward", "optimizer_step"):
        assert two[stage].ms > one[stage].ms > 0


def test_bound_labels_follow_the_slowest_term():
    ops = predict.step_ops(Shape(**SHAPE))
    compute = predict.predict_ops(ops, rates(flops=1e3, exps=1e3))
    memory = predict.predict_ops(ops, rates(bandwidth=1e3))
    overhead = predict.predict_ops(ops, rates(overhead=10.0))
    assert {s.bound for s in compute.values() if s.compute_ms} == {"compute"}
    assert compute["forward"].bound == compute["backward"].bound == "compute"
    assert {s.bound for s in memory.values()} == {"memory"}
    assert {s.bound for s in overhead.values()} == {"overhead"}
    for st in compute.values():
        assert math.isclose(st.ms, st.compute_ms + st.memory_ms + st.overhead_ms)


def test_bandwidth_is_interpolated_between_measured_sizes():
    r = rates()
    r.bandwidth = [(2**20, 4e10), (2**24, 1e10)]
    assert r.bytes_per_s(2**10) == 4e10 and r.bytes_per_s(2**30) == 1e10
    assert r.bytes_per_s(2**22) == pytest.approx(2.5e10)


@pytest.fixture
def counted(monkeypatch):
    """The measurements replaced by counters: what was measured, by name."""
    calls: list[str] = []

    def kernel(device, dtype, name, evict=None):
        calls.append(name)
        return {"rounds": [1e9, 2e9, 3e9], "flops": 1}

    monkeypatch.setattr(predict, "measure_kernel", kernel)
    monkeypatch.setattr(predict, "measure_bandwidth", lambda d: calls.append("bandwidth") or {"1024": [1e9]})
    monkeypatch.setattr(predict, "measure_exp", lambda d: calls.append("exp") or [1e9])
    monkeypatch.setattr(
        predict, "measure_overhead", lambda d: calls.append("overhead") or {"op": [1e-6], "autograd": [2e-6]}
    )
    monkeypatch.setattr(predict, "busy_share", lambda before, after: 0.0)  # a quiet machine unless faked
    return calls


def busy(monkeypatch, share: float) -> None:
    monkeypatch.setattr(predict, "busy_share", lambda before, after: share)


def test_rates_measured_under_load_serve_once_and_are_never_cached(tmp_path, monkeypatch, counted, capsys):
    """Other processes on 80% of the cores: the rates serve the prediction that measured them, say
    so, and are not cached: the next prediction measures them again, and the trainer's
    --predict-time (which measures nothing) finds none. Quiet rates are cached and reused."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    needed, path = ["matmul nn 3x5x7"], tmp_path / predict.STEP_RATES_FILE
    busy(monkeypatch, 0.8)
    loaded = predict.step_rates("cpu", "fp32", needed)
    assert loaded.under_load.startswith("4 rates measured under load (other processes on 80% of the cores)")
    assert "not cached" in loaded.under_load and "under load" not in loaded.source  # its own line
    assert "[rates] 1/4 bandwidth" in capsys.readouterr().err  # progress, not silence
    assert not path.exists()
    with pytest.raises(predict.NoRates):
        predict.step_rates("cpu", "fp32", needed, measure=False)
    counted.clear()
    assert predict.step_rates("cpu", "fp32", needed).measured == 4 and len(counted) == 4  # again
    counted.clear()
    busy(monkeypatch, 0.05)
    quiet = predict.step_rates("cpu", "fp32", needed)
    assert sorted(counted) == sorted(["bandwidth", "exp", "overhead", *needed]) and not quiet.under_load
    counted.clear()
    busy(monkeypatch, 0.9)
    assert predict.step_rates("cpu", "fp32", needed).measured == 0 and counted == []  # quiet ones stand
    remeasured = predict.step_rates("cpu", "fp32", needed, remeasure=True)  # forgets them: measured anew
    assert remeasured.measured == 4 and remeasured.under_load
    assert json.loads(path.read_text()) == {}  # forgotten, and the busy figures not kept


def test_a_busy_rate_an_earlier_version_cached_is_measured_again(tmp_path, monkeypatch, counted):
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    needed = ["matmul nn 3x5x7"]
    predict.step_rates("cpu", "fp32", needed)
    path = tmp_path / predict.STEP_RATES_FILE
    entries = json.loads(path.read_text())
    (key,) = entries
    entries[key]["matmul nn 3x5x7"]["others"] = 0.9  # measured while others took 90% of the cores
    path.write_text(json.dumps(entries))
    counted.clear()
    with pytest.raises(predict.NoRates):  # the trainer's read: a busy figure is no figure
        predict.step_rates("cpu", "fp32", needed, measure=False)
    assert predict.step_rates("cpu", "fp32", needed).measured == 1 and counted == needed


def test_the_trainers_predict_time_reads_quiet_cached_rates_only(tmp_path, monkeypatch, counted):
    """--predict-time (core/finish.py's run_prediction) measures nothing: None without cached
    rates (why, in words), the step's stages from them once `estimate --time` has measured them."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    cfg = parse_args(["--preset", "tiny", "--vocab-size", "64", "--no-amp"])
    why = predict.run_prediction(cfg, 64, "fp32", "cpu")
    assert why.startswith("no rates measured here") and "estimate --time" in why and counted == []
    assert (
        estimate.main(["--time", "--preset", "tiny", "--vocab-size", "64", "--no-amp", "--device", "cpu"])
        == 0
    )
    counted.clear()
    p = predict.run_prediction(cfg, 64, "fp32", "cpu")
    assert counted == [] and p["step_ms"] > 0 and set(p["stage_ms"]) == set(predict.PREDICTED_STAGES)
    assert "config" not in p and p["rates_source"].startswith("cache")


def test_remeasure_goes_with_time_and_measures_the_peak_too(tmp_path, monkeypatch, capsys, counted):
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MINIGPT_ARGS", raising=False)
    assert estimate.main(["--remeasure"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --remeasure goes with --time (the memory estimate measures nothing); add --time"
    )
    keys = [peak.machine_key("cpu", d) for d in peak.peak_dtypes("cpu")]
    entry = dict(best=1e9, calls=5, date="2026-01-01 00:00 UTC", what="matmul 8x8x8 in fp32")
    (tmp_path / peak.PEAK_CACHE_FILE).write_text(json.dumps({k: entry for k in [*keys, "another machine"]}))
    peaks = []

    def device_peak(override, device, dist=None):
        peaks.append(json.loads((tmp_path / peak.PEAK_CACHE_FILE).read_text()))
        return peak.Peak(1e12, "fp32", "measured now: x")

    monkeypatch.setattr(peak, "device_peak", device_peak)
    flags = ["--time", "--remeasure", "--preset", "tiny", "--vocab-size", "64", "--no-amp", "--device", "cpu"]
    assert estimate.main(flags) == 0
    out = capsys.readouterr().out
    assert list(peaks[0]) == ["another machine"]  # this machine's figures forgotten, measured again
    assert out.startswith("MFU peak 1 TFLOP/s (fp32, the device's fastest)\n  measured now: x\n")


def test_cached_rates_are_reused_without_measuring_again(tmp_path, monkeypatch, counted):
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    needed = predict.kernels(predict.step_ops(Shape(**SHAPE)))
    first = predict.step_rates("cpu", "fp32", needed)
    assert first.measured == len(needed) + 3 and sorted(counted) == sorted(
        needed + ["bandwidth", "exp", "overhead"]
    )
    assert first.flop_rate(needed[0]) == pytest.approx(3 / (1 / 1e9 + 1 / 2e9 + 1 / 3e9))  # work / mean time
    counted.clear()
    again = predict.step_rates("cpu", "fp32", needed)
    assert counted == [] and again.measured == 0 and again.source.startswith("cache")
    assert again.matmul == first.matmul
    # a new shape measures only what the cache lacks; another dtype is another entry
    predict.step_rates("cpu", "fp32", [*needed, "matmul nn 3x5x7"])
    assert counted == ["matmul nn 3x5x7"]
    entries = json.loads((tmp_path / predict.STEP_RATES_FILE).read_text())
    assert len(entries) == 1 and "matmul nn 3x5x7" in next(iter(entries.values()))


def test_measured_rates_are_positive(tmp_path, monkeypatch):
    """The real measurements, at shapes small enough for a test: every rate a positive number."""
    monkeypatch.setattr(predict, "BANDWIDTH_SIZES", (2**18, 2**20))
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    r = predict.step_rates(
        "cpu", "fp32", ["matmul tn 16x8x4", "attention forward 1x2x16x8", "attention backward 1x2x16x8"]
    )
    values = [*r.matmul.values(), *(b for _, b in r.bandwidth), r.exps_per_s, *r.overhead_s.values()]
    assert all(v > 0 and math.isfinite(v) for v in values) and len(r.bandwidth) == 2


def test_cli_json_keys(tmp_path, monkeypatch, capsys, counted, gpu_visible):
    """The CPU's measured rates (--device cpu: on a GPU machine auto would take the data sheet's,
    untested, rates)."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MINIGPT_ARGS", raising=False)
    flags = ["--preset", "tiny", "--vocab-size", "64", "--no-amp", "--device", "cpu"]
    assert estimate.main(["--time", "--json", *flags]) == 0
    record = json.loads(capsys.readouterr().out)
    assert set(record["stage_ms"]) == {"forward", "backward", "optimizer_step"}
    assert record["tokens_per_s"] > 0 and record["dtype"] == "fp32" and record["tested"] is True
    assert set(record["bound"].values()) <= set(predict.BOUNDS)
    assert (tmp_path / predict.STEP_RATES_FILE).is_file()
    # the table names the stages and their bounds
    assert estimate.main(["--time", *flags]) == 0
    text = capsys.readouterr().out
    assert all(stage in text for stage in record["stage_ms"]) and "tokens/s" in text


def test_no_rates_for_the_device_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MINIGPT_ARGS", raising=False)
    if not torch.cuda.is_available():
        assert estimate.main(["--time", "--json", "--device", "cuda"]) == 2
        err = capsys.readouterr()
        assert err.out == "" and len(err.err.strip().splitlines()) == 1 and "cuda" in err.err
    # a GPU that neither data-sheet table knows has no rates either
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Mystery 9000")
    with pytest.raises(UsageError, match="no rates for NVIDIA Mystery 9000") as e:
        predict.step_rates("cuda", "bf16", [])
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_json_without_time_is_a_usage_error(capsys):
    assert estimate.main(["--json"]) == 2
    assert "--json goes with --time" in capsys.readouterr().err


def test_param_sizes_are_the_models_tensors():
    """What the optimizer and the clipping loop over, a tensor at a time."""
    model = GPT(
        GPTConfig(n_layers=3, d_model=32, n_heads=2, d_ff=64, vocab_size=128, max_position_embeddings=16)
    )
    assert sorted(p.numel() for p in model.parameters()) == sorted(
        Shape(
            **{**SHAPE, "n_layers": 3, "d_model": 32, "d_ff": 64, "max_position_embeddings": 16}
        ).param_sizes()
    )
    [zero_grad] = [o for o in predict.step_ops(Shape(**SHAPE)) if o.name.startswith("zero_grad")]
    assert zero_grad.launches == 2 + 12 * SHAPE["n_layers"] + 2


def test_accumulation_runs_forward_and_backward_per_micro_batch(tmp_path, monkeypatch, counted):
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    one = predict.predict_step(Shape(**SHAPE), "fp32", "cpu").stages
    two = predict.predict_step(Shape(**SHAPE, grad_accum_steps=2), "fp32", "cpu")
    assert two.stages["forward"].ms == pytest.approx(2 * one["forward"].ms)
    assert two.stages["backward"].ms > 2 * one["backward"].ms  # and the gradients added into the held ones
    assert two.stages["optimizer_step"].ms == pytest.approx(one["optimizer_step"].ms)
    assert two.tokens_per_step == 2 * SHAPE["batch_size"] * SHAPE["seq_len"]


def test_the_loss_is_f_cross_entropys_on_every_device():
    """The model's loss is F.cross_entropy on the CPU and on a GPU alike: under autocast the logits
    cast to fp32, log_softmax and nll_loss, and in backward both again and the cast back."""
    cpu, cuda = predict.step_ops(Shape(**SHAPE), "bf16"), predict.step_ops(Shape(**SHAPE), "bf16", "cuda")
    assert cpu == cuda
    names = {o.name for o in cpu}
    assert {"cast logits to fp32", "log_softmax", "nll_loss", "log_softmax backward"} <= names


def test_a_gpus_per_op_overhead_is_measured_once_and_cached(tmp_path, monkeypatch):
    """A GPU's prediction is its data sheet and the per-op overhead measured on it: measured at the
    first start, then read from the cache (every start had measured it, on an H200 most of a
    memory history). Checked on the CPU with the measurement counted."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(predict, "rates_key", lambda device, dtype: f"{device}: a GPU | {dtype}")
    calls = []

    def measured(device):
        calls.append(device)
        return {"op": [4e-6, 5e-6], "autograd": [9e-6]}

    monkeypatch.setattr(predict, "measure_overhead", measured)
    first = predict.cuda_overhead()
    assert calls == ["cuda"] and first == pytest.approx({"op": 4.5e-6, "autograd": 9e-6})
    assert predict.cuda_overhead() == first and calls == ["cuda"]  # the second start reads the cache
    entry = json.loads((tmp_path / predict.STEP_RATES_FILE).read_text())["cuda: a GPU | any"]
    assert entry["overhead"]["op"] == [4e-6, 5e-6] and entry["overhead"]["date"]
    (tmp_path / predict.STEP_RATES_FILE).write_text("{not json")  # a damaged cache: measured again
    assert predict.cuda_overhead() == first and calls == ["cuda", "cuda"]
