"""The GPU-busy measure of the operator profiles."""

import json

import pytest
import torch

from dsv.bench.profiling import covered_ns, device_busy_us, device_time_by_category, idle_by_host_op, kernel_category


def test_covered_time_counts_overlapping_kernels_once():
    # Two streams overlap on [5, 10); a gap [12, 20) is idle; a kernel inside another adds nothing.
    assert covered_ns([(0, 10), (5, 12), (20, 30), (22, 25)]) == 12 + 10
    assert covered_ns([(20, 30), (0, 10)]) == 20  # order of the events does not matter
    assert covered_ns([(0, 10), (10, 15)]) == 15  # touching intervals
    assert covered_ns([]) == 0


def test_device_busy_time_counts_only_device_work_of_a_trace():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 100.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "ts": 105.5, "dur": 10.0},  # another stream, overlapping
        {"ph": "X", "cat": "gpu_memcpy", "ts": 200.0, "dur": 2.25},
        {"ph": "X", "cat": "gpu_memset", "ts": 300.0, "dur": 1.0},
        # Spans that are not device work: an annotation over the whole step, host ops, profiler overhead.
        {"ph": "X", "cat": "gpu_user_annotation", "ts": 0.0, "dur": 1000.0},
        {"ph": "X", "cat": "cpu_op", "ts": 0.0, "dur": 1000.0},
        {"ph": "X", "cat": "overhead", "ts": 400.0, "dur": 50.0},
        {"ph": "i", "cat": "kernel", "ts": 500.0},  # an instant event has no span
    ]}
    assert device_busy_us(trace) == pytest.approx(15.5 + 2.25 + 1.0)
    assert device_busy_us({"traceEvents": []}) == 0.0


def test_device_time_by_category_sums_each_kind_of_kernel():
    # Names as the 64k training step's trace on one H200 shows them (shortened).
    def kernel(name, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": 0.0, "dur": dur}

    trace = {"traceEvents": [
        kernel("_sparse_attn_fwd_ws_kernel", 4.0), kernel("_sparse_attn_fwd_kernel", 1.0),
        kernel("_sparse_attn_bwd_dkdv_kernel", 9.0), kernel("_sparse_attn_bwd_fused_kernel", 5.0),
        kernel("_score_topk_kernel", 1.5),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 30.0),
        kernel("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_bias_TNN", 20.0),
        kernel("sm80_xmma_gemm_f32f32_f32f32_f32_nt_n_tilesize32x32x8", 2.0),
        kernel("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>",
               1.0),
        kernel("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float, true>", 7.0),
        kernel("Memcpy HtoD (Pinned -> Device)", 0.5, cat="gpu_memcpy"),
        kernel("Memset (Device)", 0.25, cat="gpu_memset"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 100.0},  # host: not device time
    ]}
    assert device_time_by_category(trace) == [
        ("dense attention", 30.0, 1), ("GEMM", 22.0, 2), ("sparse attention backward", 14.0, 2),
        ("elementwise, norms and other", 7.0, 1), ("sparse attention forward", 5.0, 2),
        ("critical-KV estimation", 1.5, 1), ("optimizer", 1.0, 1), ("copies", 0.5, 1), ("memsets", 0.25, 1)]
    assert kernel_category("_sparse_attn_bwd_delta_kernel", "kernel") == "sparse attention backward"
    assert kernel_category("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>", "kernel") == \
        "dense attention"
    # cuDNN's convolutions (the patch embedding's) are not attention.
    assert kernel_category("sm80_xmma_wgrad_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "kernel") == \
        "GEMM"
    assert kernel_category("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>", "kernel") == \
        "elementwise, norms and other"
    assert device_time_by_category({"traceEvents": []}) == []


def test_idle_gaps_are_charged_to_the_host_ops_open_at_the_next_launch():
    def kernel(ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts, corr, tid=1, cat="cuda_runtime"):
        return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1.0, "tid": tid,
                "args": {"correlation": corr}}

    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    trace = {"traceEvents": [
        kernel(0.0, 100.0, 1), launch(-5.0, 1),
        kernel(50.0, 60.0, 2), launch(-4.0, 2),  # another stream: device work reaches 110
        # 110 -> 150: 40 µs idle, ended by a launch inside dsv::learn > aten::mm on thread 1.
        kernel(150.0, 10.0, 3), launch(148.0, 3), op("dsv::learn", 120.0, 40.0), op("aten::mm", 147.0, 3.0),
        # 160 -> 165: 5 µs, under the 10 µs floor.
        kernel(165.0, 10.0, 4), launch(160.0, 4, cat="cuda_driver"),
        # 175 -> 205: 30 µs, launched from the autograd thread inside another op; dsv::learn on thread 1
        # is still open then but is not charged.
        kernel(205.0, 5.0, 5), launch(200.0, 5, tid=2), op("dsv::learn", 190.0, 20.0),
        op("MmBackward0", 195.0, 10.0, tid=2),
        # 210 -> 230: 20 µs whose launch the trace lacks.
        kernel(230.0, 5.0, 6),
    ]}
    total, ranked = idle_by_host_op(trace)
    assert total == pytest.approx(40.0 + 30.0 + 20.0)
    assert ranked == [("aten::mm", 40.0, 1), ("dsv::learn", 40.0, 1), ("MmBackward0", 30.0, 1),
                      ("(launch not in the trace)", 20.0, 1)]
    assert idle_by_host_op(trace, min_gap_us=35.0) == (40.0, [("aten::mm", 40.0, 1), ("dsv::learn", 40.0, 1)])
    assert idle_by_host_op({"traceEvents": []}) == (0.0, [])


def test_exported_trace_has_the_fields_the_busy_measure_reads(tmp_path):
    """The installed torch's trace export: timed events with a category, start and duration."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    trace = json.loads((tmp_path / "trace.json").read_text())
    timed = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert any(e.get("cat") == "cpu_op" and e["dur"] >= 0 and e["ts"] > 0 for e in timed)
    assert device_busy_us(trace) == 0.0  # no device work on the CPU
