"""The trace receiver on a real HTTP server of 127.0.0.1, fed by the real OpenTelemetry
SDK: ``spillway.tracing`` in a child process (as every part of the stack runs it) exports
two tenants' traces over OTLP/HTTP, Protobuf and gzip, and the query API gives them back
with their parent and child, links, events and status; and the receiver as ``spillway up``
starts it, a process of its own, stopped by PID."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spillway_cli.dashboard.trace_server import TraceApp, guarded
from spillway_cli.dashboard.traces import TraceStore, wait_for_trace
from spillway_cli.local import procs
from spillway_cli.local.wsgi_server import running

# Two requests of two tenants: acme's, then globex's, whose batch span links to acme's
# request (a batch linking each request it carried) and fails once.
EXPORTER = """
import json
from spillway import tracing

assert tracing.configure("spillway-itest")
with tracing.span("infer acme", kind="server", attributes={"spillway.tenant": "acme"}):
    acme, acme_link = tracing.trace_id(), tracing.current_link()
with tracing.span("infer globex", kind="server", attributes={"spillway.tenant": "globex"}) as root:
    globex = tracing.trace_id()
    with tracing.span("gpu batch", kind="client", links=[acme_link]) as batch:
        batch.event("retry", attempt=1)
        batch.fail("gpu refused")
tracing.shutdown()
print(json.dumps({
    "acme": acme, "acme_span": format(acme_link.span_id, "016x"), "globex": globex,
    "root": format(root.link.span_id, "016x"), "batch": format(batch.link.span_id, "016x"),
}))
"""


def export_from_child(base_url: str, service: str, **extra: str) -> dict[str, Any]:
    """Run ``EXPORTER`` in a child process told the receiver's URL as every part of the
    stack is told it; the ids it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.pop("SPILLWAY_TRACE_SAMPLE", None)
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": base_url, "OTEL_SERVICE_NAME": service, **extra}
    done = subprocess.run(
        [sys.executable, "-c", EXPORTER],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    ids: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return ids


@pytest.fixture
def receiver() -> Iterator[tuple[str, TraceStore]]:
    """A receiver on a free port of 127.0.0.1, in a thread of this process."""
    store = TraceStore(max_traces=100, max_spans=10_000, max_spans_per_trace=100)
    with running(guarded(TraceApp(store))) as base_url:
        yield base_url, store


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_the_sdk_exports_two_tenants_traces_and_the_api_gives_them_back(
    receiver: tuple[str, TraceStore], compression: str
) -> None:
    base_url, _ = receiver
    # WHEN a process traces two tenants' requests with the real SDK and exits
    ids = export_from_child(base_url, "spillway-gpu", OTEL_EXPORTER_OTLP_COMPRESSION=compression)
    # THEN globex's trace holds its server span and the client span under it
    globex = wait_for_trace(base_url, ids["globex"], spans_at_least=2, timeout_s=30)
    root, batch = globex["spans"]
    assert (root["name"], root["kind"], root["parent_span_id"]) == ("infer globex", "server", None)
    assert (batch["name"], batch["kind"]) == ("gpu batch", "client")
    assert (root["span_id"], batch["span_id"]) == (ids["root"], ids["batch"])
    assert batch["parent_span_id"] == ids["root"]
    assert globex["services"] == ["spillway-gpu"]
    assert root["attributes"] == {"spillway.tenant": "globex"}
    # AND the batch span links to acme's request, carries its event and its failure
    assert [(link["trace_id"], link["span_id"]) for link in batch["links"]] == [
        (ids["acme"], ids["acme_span"])
    ]
    assert [(e["name"], e["attributes"]) for e in batch["events"]] == [("retry", {"attempt": 1})]
    assert batch["status"] == {"code": "error", "message": "gpu refused"}
    assert globex["error"] is True
    assert root["start_ns"] <= batch["start_ns"] <= batch["end_ns"] <= root["end_ns"]
    # AND the linked trace is there too, each tenant's trace found by its tenant only
    acme = wait_for_trace(base_url, ids["acme"], timeout_s=30)
    assert [s["span_id"] for s in acme["spans"]] == [ids["acme_span"]]
    for tenant, trace_id in (("acme", ids["acme"]), ("globex", ids["globex"])):
        listed = _get(f"{base_url}/api/traces?tenant={tenant}&service=spillway-gpu")
        assert [t["trace_id"] for t in listed["traces"]] == [trace_id]


def test_wait_for_trace_says_what_it_last_saw_past_its_deadline(
    receiver: tuple[str, TraceStore],
) -> None:
    base_url, _ = receiver
    ids = export_from_child(base_url, "spillway-cpu")
    wait_for_trace(base_url, ids["globex"], spans_at_least=2, timeout_s=30)
    with pytest.raises(TimeoutError, match="held 2 span\\(s\\), not 3"):
        wait_for_trace(base_url, ids["globex"], spans_at_least=3, timeout_s=0.5, poll_s=0.1)


def test_the_receiver_process_spillway_up_starts_takes_spans_and_stops(tmp_path: Path) -> None:
    # GIVEN the receiver as `spillway up` starts it, on a free port
    port = procs.free_port()
    argv = [sys.executable, "-m", "spillway_cli.dashboard.trace_server", "--port", str(port)]
    child = procs.start("traces", argv, tmp_path)
    try:
        base_url = f"http://127.0.0.1:{port}"
        procs.wait_http(f"{base_url}/api/health", 60, child.proc)
        # WHEN a traced process exports to it
        ids = export_from_child(base_url, "spillway-router")
        # THEN its trace view lists the trace, and serves its page
        trace = wait_for_trace(base_url, ids["globex"], spans_at_least=2, timeout_s=30)
        assert trace["root"] == "infer globex"
        assert trace["services"] == ["spillway-router"]
        assert _get(f"{base_url}/api/health")["spans"] == 3
    finally:
        code = child.stop()
    assert code == 0  # SIGTERM is a clean exit


def _get(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as answer:
        found: dict[str, Any] = json.loads(answer.read())
        return found


def test_the_stack_starts_the_receiver_first_and_prints_its_view(tmp_path: Path) -> None:
    from spillway_cli.local.layout import Ports
    from spillway_cli.local.stack import LocalStack

    # GIVEN a stack's layout on free ports
    stack = LocalStack(tmp_path / "models", tmp_path / "logs", Ports())
    stack.ports = stack.ports.resolved()
    # WHEN it starts its receiver
    stack._traces()
    try:
        # THEN the receiver answers where every traced part is told to export
        endpoint = stack.trace_env("cpu")["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert _get(f"{endpoint}/api/health")["live"] is True
        assert f"traces    {stack.traces_url}  (trace view; OTLP/HTTP receiver " in stack.summary()
    finally:
        stack.stop()
    assert "traces" not in stack.children
