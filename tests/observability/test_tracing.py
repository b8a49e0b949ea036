"""Tracing: span bookkeeping, busy time in a window, and the Chrome trace-event schema."""

from __future__ import annotations

import json

from relayrl.observability.tracing import Span, Tracer, busy_seconds, chrome_trace

REQUIRED_X = {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}


def test_busy_seconds_clips_spans_to_the_window():
    spans = [Span("a", 0.0, 2.0, 0), Span("b", 3.0, 4.0, 1), Span("c", 5.0, 9.0, 1)]
    # window [1, 6]: 1 s of a, all 1 s of b, 1 s of c
    assert busy_seconds(spans, 1.0, 6.0) == 3.0
    assert busy_seconds(spans, 10.0, 11.0) == 0.0


def test_busy_seconds_counts_overlapping_spans_once():
    # a weight transfer [1, 5] beside forward passes [0, 2] and [3, 4]: busy over [0, 5]
    spans = [Span("forward", 0.0, 2.0, 0), Span("update_weights", 1.0, 5.0, 1)]
    spans.append(Span("forward", 3.0, 4.0, 0))
    assert busy_seconds(spans, 0.0, 10.0) == 5.0
    assert busy_seconds(spans, 1.5, 3.5) == 2.0


def test_chrome_trace_puts_overlapping_spans_on_rows_of_their_own():
    busy = [Span("forward", 0.0, 2.0, 0), Span("update_weights", 1.0, 5.0, 1)]
    busy.append(Span("forward", 3.0, 4.0, 0))
    trace = chrome_trace({"inference_service": (busy, [])}, origin=0.0)
    rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(rows.values()) == ["wait", "work", "work 2"]
    by_row: dict[str, list[str]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_row.setdefault(rows[e["tid"]], []).append(e["name"])
    assert by_row == {"work": ["forward", "forward"], "work 2": ["update_weights"]}


def test_tracer_records_spans_with_versions_and_skips_tiny_waits():
    tracer = Tracer("gen")
    with tracer.span("generate", version=3):
        pass
    tracer.wait("channel empty", 1.0, 1.00001)  # 10 us: below the threshold
    tracer.wait("channel empty", 1.0, 1.5)
    assert [(s.name, s.version) for s in tracer.spans] == [("generate", 3)]
    assert [s.end - s.start for s in tracer.waits] == [0.5]


def test_tracer_caps_its_memory_and_counts_what_it_dropped():
    tracer = Tracer("gen", max_spans=2)
    for _ in range(5):
        with tracer.span("x"):
            pass
    assert len(tracer.spans) == 2 and tracer.dropped == 3


def test_chrome_trace_follows_the_trace_event_format():
    trace = chrome_trace(
        {
            "trainer": ([Span("train_step", 10.0, 10.5, 2)], []),
            "generator": ([Span("generate", 10.1, 10.2, 1)], [Span("gate", 10.2, 10.4, 1)]),
        },
        origin=10.0,
    )
    json.dumps(trace)  # serialisable
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert all(set(e) >= REQUIRED_X for e in complete)
    assert {e["name"] for e in events if e["ph"] == "M"} == {"process_name", "thread_name"}
    train = next(e for e in complete if e["name"] == "train_step")
    assert train["ts"] == 0.0 and train["dur"] == 500000.0 and train["args"] == {"version": 2}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names.values()) == ["generator", "trainer"]
