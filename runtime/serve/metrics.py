"""`/metrics` through prometheus_client: latency histograms observed per request (queue wait, time to
first token, inter-token latency, end to end), requests by API and outcome, and the scheduler's and
engine's own counts read at scrape time (a collector, so they are never copied or double counted).
One registry per server, so several servers in one process (tests) keep their numbers apart."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds: from sub-millisecond token gaps to minutes-long agent turns
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _SchedulerCollector:
    """Counts the scheduler and engine keep themselves, as metric families at scrape time."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        server = self.server
        sched, cfg = server.scheduler, server.config
        s = sched.stats
        engine_stats = getattr(server.engine, "stats", None)
        counted = lambda name: getattr(engine_stats, name, 0)  # noqa: E731 - a stand-in engine counts nothing
        counters = {
            "ninfer_requests": ("HTTP requests with a body, any API", cfg.stats["requests"]),
            "ninfer_request_errors": ("requests answered with an error", cfg.stats["errors"]),
            "ninfer_generated_tokens": ("tokens generated", s.get("generated_tokens", 0)),
            "ninfer_rejected": ("requests refused at arrival (429 / 529)", s.get("rejected_queue_full", 0)),
            "ninfer_queue_timeouts": ("requests that waited past --pending-timeout-ms (503)", s.get("timed_out", 0)),
            "ninfer_failed_generations": ("generations that failed in the engine", s.get("finished_error", 0)),
            "ninfer_prefix_reused_tokens": ("prompt tokens not computed again (prefix reuse)", counted("reused_tokens")),
            "ninfer_prefill_tokens": ("prompt tokens computed", counted("prefill_tokens")),
            # batching at a glance: decode_step_rows / decode_steps is how many lanes a plain decode step carried
            "ninfer_decode_steps": ("plain decode steps (speculative rounds: ninfer_spec_rounds)", counted("decode_steps")),
            "ninfer_decode_step_rows": ("rows (lanes) of the plain decode steps", counted("decode_step_rows")),
            "ninfer_decode_tokens": ("tokens decoded, in decode steps, riding prefill chunks or accepted in speculative "
                                     "rounds", counted("decode_tokens")),
            "ninfer_rider_tokens": ("decode tokens computed inside another lane's prefill chunk", counted("rider_tokens")),
            "ninfer_chained_decode_steps": ("decode steps launched before the host read the previous step's tokens",
                                            s.get("chained_steps", 0)),
            "ninfer_graphs_captured_serving": ("CUDA graphs captured while serving, after the start-up warm-up: each "
                                               "stopped every lane for an eager forward and the capture",
                                               counted("graphs_captured_serving")),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("ninfer_queue_depth", "requests waiting for a lane", value=sched.queue_depth)
        yield GaugeMetricFamily("ninfer_active_lanes", "lanes holding a request", value=sched.active_lanes)
        yield GaugeMetricFamily("ninfer_cuda_graphs", "CUDA graphs captured so far (decode batch sizes, prompt-piece "
                                "buckets, riding chunks: at start-up, see serve --warm-up, else on first use)",
                                value=getattr(server.engine, "graphs_captured", 0))
        speculator = getattr(server.engine, "speculator", None)
        if speculator is not None:  # speculative decoding: rounds, drafted and accepted tokens, per draft position
            st = speculator.stats
            yield CounterMetricFamily("ninfer_spec_rounds", "speculative rounds", value=st.rounds)
            yield CounterMetricFamily("ninfer_spec_drafted_tokens", "drafted tokens", value=st.drafted)
            yield CounterMetricFamily("ninfer_spec_accepted_tokens", "accepted drafted tokens", value=st.accepted)
            per = CounterMetricFamily("ninfer_spec_accepted_at_position", "accepted drafts by position",
                                      labels=["position"])
            for i, n in enumerate(st.accepted_at):
                per.add_metric([str(i + 1)], n)
            yield per


class ServerMetrics:
    def __init__(self, server):
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(server))
        self.outcomes = Counter("ninfer_api_requests", "requests by API and outcome", ["api", "outcome"],
                                registry=self.registry)
        hist = lambda name, doc: Histogram(name, doc, ["api"], buckets=_LATENCY, registry=self.registry)  # noqa: E731
        self.queue_wait = hist("ninfer_queue_wait_seconds", "time from arrival until a lane holds the request")
        self.ttft = hist("ninfer_time_to_first_token_seconds", "time from arrival to the first generated token")
        self.inter_token = hist("ninfer_inter_token_latency_seconds", "time between consecutive generated tokens")
        self.e2e = hist("ninfer_request_duration_seconds", "time from arrival to the last token")

    def render(self) -> bytes:
        return generate_latest(self.registry)
