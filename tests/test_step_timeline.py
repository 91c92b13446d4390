"""bench/step_timeline.py's charging of a step's wall time, on synthetic timelines (the GPU run is on the device)."""

import pytest

from bench.step_timeline import kernel_class, kernel_spans, timeline_summary, window_summary


def _step(t0: float) -> list[tuple[float, float, str]]:
    # a norm, then a product launched under PDL (starts 1 µs before the norm ends, waits, runs), a 3 µs launch gap,
    # then a memcpy of the next step's inputs
    return [(t0, t0 + 4, "_rmsnorm_kernel"), (t0 + 3, t0 + 20, "_qgemv_dp4a_kernel"),
            (t0 + 23, t0 + 25, "Memcpy HtoD (Pageable -> Device)")]


def test_each_microsecond_is_charged_once():
    spans = _step(0.0) + _step(30.0)
    s = timeline_summary(spans, 2)
    assert s["spans_per_step"] == 3 and s["period_us"] == pytest.approx(27.5)  # 30, then the last step's 25
    charged = {k["name"]: k["charged_us_per_step"] for k in s["kernels"]}
    assert charged["_rmsnorm_kernel"] == pytest.approx(4.0)
    assert charged["_qgemv_dp4a_kernel"] == pytest.approx(16.0)  # not the 1 µs it overlapped the norm
    assert s["busy_us"] + s["idle_us"] == pytest.approx(s["period_us"])
    mean = {k["name"]: k["mean_us"] for k in s["kernels"]}
    assert mean["_qgemv_dp4a_kernel"] == pytest.approx(17.0)  # its duration in place, the wait included
    assert s["idle_gaps"]["2-5"]["per_step"] == pytest.approx(1.0)  # each step's 3 µs launch gap
    assert s["idle_gaps"]["5-20"]["us_per_step"] == pytest.approx(2.5)  # the 5 µs before step 2, over 2 steps
    assert s["classes"]["products"]["charged_us_per_step"] == pytest.approx(16.0)


def test_spans_that_do_not_split_into_steps_are_refused():
    with pytest.raises(ValueError, match="do not split into 2 steps"):
        timeline_summary(_step(0.0) + _step(30.0)[:2], 2)


def test_trace_events_and_classes():
    trace = {"traceEvents": [{"cat": "kernel", "name": "b", "ts": 5, "dur": 1},
                             {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9},
                             {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 1, "dur": 2}]}
    assert kernel_spans(trace) == [(1.0, 3.0, "Memcpy DtoD"), (5.0, 6.0, "b")]
    assert kernel_class("_qgemm_fragment_layout_kernel") == "products"
    assert kernel_class("_gated_norm_kernel") == "norms"
    assert kernel_class("_gdn_step_kernel") == "gdn"
    assert kernel_class("something_else") == "other"


def test_a_window_of_uneven_steps():
    # a server's steps: the second one has an argmax and a copy after it that the first lacks
    spans = _step(0.0) + _step(30.0) + [(56.0, 57.0, "argmax_kernel"), (60.0, 62.0, "Memcpy DtoH")]
    w = window_summary(spans, 2)
    assert w["period_us"] == pytest.approx(31.0) and w["spans_per_step"] == pytest.approx(4.0)
    assert w["busy_us"] == pytest.approx((4 + 16 + 2 + 4 + 16 + 2 + 1 + 2) / 2)  # the PDL overlaps charged once
    products = next(k for k in w["kernels"] if k["name"] == "_qgemv_dp4a_kernel")
    assert products["us_per_step"] == pytest.approx(17.0) and products["calls_per_step"] == pytest.approx(1.0)
    assert w["kernels"][0]["name"] == "_qgemv_dp4a_kernel" and w["classes"]["products"] == pytest.approx(17.0)
    with pytest.raises(ValueError, match="empty window"):
        window_summary([], 2)
