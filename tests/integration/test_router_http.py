"""The router over real HTTP on 127.0.0.1: tritonclient through it, and what reaches a
backend on the wire."""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import tritonclient.http as triton

from spillway.policy.backend import BackendRequest
from spillway.router.backends import HttpBackend
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway_cli.local import procs
from spillway_cli.local.wsgi_server import running
from tests.support import Service, load_engine

EXAMPLE = Path(__file__).resolve().parents[2] / "policies" / "example.yaml"


@pytest.fixture(scope="module")
def router_url(service: Service) -> Iterator[str]:
    settings = RouterSettings(gpu_url=service.base, metrics_log=Path("/dev/null"))
    with running(create_app(settings)) as url:
        yield url.removeprefix("http://")


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_digits_through_the_router_equals_the_engine(
    router_url: str, serving_repo: Path, binary: bool
) -> None:
    images = np.load(serving_repo / "digits" / "samples" / "images.npy")[:12].astype(np.float32)
    client = triton.InferenceServerClient(router_url)
    tensor = triton.InferInput("image", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images, binary_data=binary)
    outputs = [
        triton.InferRequestedOutput(n, binary_data=binary) for n in ("label", "probabilities")
    ]
    result = client.infer("digits", [tensor], outputs=outputs, request_id="r-1")
    direct = load_engine(serving_repo, "digits").infer({"image": images})
    np.testing.assert_array_equal(result.as_numpy("label"), direct["label"])
    np.testing.assert_allclose(result.as_numpy("probabilities"), direct["probabilities"], atol=1e-6)
    assert result.get_response()["id"] == "r-1"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_text_through_the_router_equals_the_engine(
    router_url: str, serving_repo: Path, binary: bool
) -> None:
    texts = np.array([[b"Spillway routes requests."], [b"Another sentence."]], dtype=np.object_)
    client = triton.InferenceServerClient(router_url)
    tensor = triton.InferInput("text", [2, 1], "BYTES")
    tensor.set_data_from_numpy(texts, binary_data=binary)
    result = client.infer(
        "minilm", [tensor], outputs=[triton.InferRequestedOutput("embedding", binary_data=binary)]
    )
    direct = load_engine(serving_repo, "minilm").infer({"text": texts})["embedding"]
    np.testing.assert_allclose(result.as_numpy("embedding"), direct, atol=1e-5)


def test_tritonclient_metadata_and_health_through_the_router(router_url: str) -> None:
    client = triton.InferenceServerClient(router_url)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits")
    assert client.get_model_metadata("digits", model_version="1")["versions"] == ["1"]
    assert client.get_model_config("digits")["max_batch_size"] == 64
    assert client.get_server_metadata()["name"] == "spillway-router"
    with pytest.raises(triton.InferenceServerException, match=r"unknown model"):
        client.get_model_metadata("nope")


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A backend that records what reaches it and answers a fixed result; a model's
    configuration declares ``budget_ms`` as its latency budget (``None``: none)."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[dict[str, Any]]] = []
    configs: ClassVar[list[str]] = []
    budget_ms: ClassVar[float | None] = None

    def do_GET(self) -> None:
        self.configs.append(self.path)
        block = {} if self.budget_ms is None else {"latency_budget_ms": self.budget_ms}
        answer = json.dumps({"name": "digits", "spillway": block}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
        answer = b'{"model_name":"digits","outputs":[]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.send_header("Set-Cookie", "backend=secret")
        self.send_header("X-Internal", "1")
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen, _Recorder.configs, _Recorder.budget_ms = [], [], None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_no_auth_cookie_or_hop_by_hop_header_reaches_the_backend(recorder: str) -> None:
    # GIVEN a router in front of a backend that records what it receives
    settings = RouterSettings(gpu_url=recorder, metrics_log=Path("/dev/null"))
    with running(create_app(settings)) as url:
        body = json.dumps(
            {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}
        )
        request = urllib.request.Request(
            f"{url}/v2/models/digits/infer?target=http://evil.example",
            data=body.encode(),
            headers={
                "Content-Type": "application/json",
                "Authorization": "Bearer token",
                "Cookie": "session=abc",
                "X-Api-Key": "key",
                "Proxy-Authorization": "Basic abc",
                "Connection": "X-Custom-Hop",
                "X-Custom-Hop": "1",
                "TE": "trailers",
                "X-Forwarded-Host": "evil.example",
                "X-Request-Id": "trace-7",
                "X-Spillway-Tenant-Scope": "f" * 32,
            },
        )
        # WHEN the request is routed
        with urllib.request.urlopen(request, timeout=10) as response:
            client_headers = {k.lower() for k in response.headers}
    # THEN the backend saw only the protocol's own headers, on the canonical path, and the
    # caller's tenant scope as the router knows it (anonymous here), never the client's
    (seen,) = _Recorder.seen
    names = {k.lower() for k in seen["headers"]}
    assert names == {
        "host",
        "accept-encoding",
        "content-length",
        "content-type",
        "user-agent",
        "x-request-id",
        "x-spillway-tenant-scope",
    }
    scopes = [v for k, v in seen["headers"].items() if k.lower() == "x-spillway-tenant-scope"]
    assert [s.partition(".")[0] for s in scopes] == ["-"]  # signed when a key is held
    assert seen["headers"]["Host"] == recorder.removeprefix("http://")
    assert seen["headers"]["x-request-id"] == "trace-7"
    assert seen["path"] == "/v2/models/digits/infer"
    # AND the backend's own cookies and internal headers do not reach the client
    assert "set-cookie" not in client_headers
    assert "x-internal" not in client_headers


def test_a_model_s_latency_budget_travels_down_as_the_timeout(recorder: str) -> None:
    # GIVEN a backend whose digits declares a 25 s latency budget, behind a router
    _Recorder.budget_ms = 25_000
    settings = RouterSettings(gpu_url=recorder, metrics_log=Path("/dev/null"))
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
    with running(create_app(settings)) as url:
        # WHEN two requests state no budget and a third states 2 s
        for headers in ({}, {}, {"x-spillway-latency-budget-ms": "2000"}):
            request = urllib.request.Request(
                f"{url}/v2/models/digits/infer",
                data=body.encode(),
                headers={"Content-Type": "application/json", **headers},
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200
    # THEN the router asked digits' configuration once, and each request carried its
    # deadline down as the V2 timeout (90 % of it): 25 s twice, then the client's 2 s
    assert _Recorder.configs == ["/v2/models/digits/config"]
    timeouts = [json.loads(seen["body"])["parameters"]["timeout"] for seen in _Recorder.seen]
    assert timeouts == [
        pytest.approx(22_500_000, rel=0.01),
        pytest.approx(22_500_000, rel=0.01),
        pytest.approx(1_800_000, rel=0.01),
    ]


def test_spillway_serve_router_and_cpu_as_processes(models_dir: Path, tmp_path: Path) -> None:
    # GIVEN `spillway serve cpu` and `spillway serve router` started as real processes,
    # the router's GPU URL pointing at a port where nothing listens
    cpu_port, router_port = procs.free_port(), procs.free_port()
    cli = [sys.executable, "-m", "spillway_cli.main", "serve"]
    cpu = procs.start(
        "cpu",
        [*cli, "cpu", "--port", str(cpu_port), "--repository", str(models_dir)],
        tmp_path,
        {"CPU_MODELS": '["digits"]', "CPU_LOG_LEVEL": "WARNING"},
    )
    router = procs.start(
        "router",
        [
            *cli,
            "router",
            "--port",
            str(router_port),
            "--policy",
            str(EXAMPLE),
            "--gpu-url",
            f"http://127.0.0.1:{procs.free_port()}",
            "--cpu-url",
            f"http://127.0.0.1:{cpu_port}",
        ],
        tmp_path,
        {"ROUTER_METRICS_LOG": str(tmp_path / "metrics.log"), "ROUTER_LOG_LEVEL": "WARNING"},
    )
    try:
        procs.wait_http(f"http://127.0.0.1:{cpu_port}/v2/health/ready", 60, cpu.proc)
        procs.wait_http(f"http://127.0.0.1:{router_port}/v2/health/ready", 60, router.proc)
        # WHEN tritonclient sends a binary request through the router
        images = np.load(models_dir / "digits" / "samples" / "images.npy")[:3].astype(np.float32)
        client = triton.InferenceServerClient(f"127.0.0.1:{router_port}")
        tensor = triton.InferInput("image", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images, binary_data=True)
        result = client.infer("digits", [tensor], outputs=[triton.InferRequestedOutput("label")])
        # THEN the CPU fallback answered it, and the metrics log accounts for it
        direct = load_engine(models_dir, "digits").infer({"image": images})["label"]
        np.testing.assert_array_equal(result.as_numpy("label"), direct)
        (line,) = (tmp_path / "metrics.log").read_text().splitlines()
        assert (json.loads(line)["backend"], json.loads(line)["Fallbacks"]) == ("cpu", [1.0])
    finally:
        router.stop()
        cpu.stop()


def test_backend_connections_are_kept_alive_without_nagle(recorder: str) -> None:
    # GIVEN the pooled HTTP backend after two requests
    backend = HttpBackend("gpu", recorder)
    request = BackendRequest("POST", "/v2/models/digits/infer", "infer", body=b"{}")
    assert backend.send(request, 5.0).status == 200
    assert backend.send(request, 5.0).status == 200
    # THEN both used one kept-alive connection, with TCP_NODELAY set: http.client writes
    # headers and body separately, and Nagle would hold the body for a delayed ACK
    conn, reused = backend._pool.take()
    assert reused
    assert conn.sock is not None
    assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    assert len({s["headers"].get("Host") for s in _Recorder.seen}) == 1
