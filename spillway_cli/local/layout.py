"""Where each part of the local stack listens and what it is told: its ports and URLs,
the variables each process is started with, the stack env file's contents and where the
router reads its policy and writes its metrics, all computed from the ports and the
folders without starting anything (``spillway_cli.local.stack`` starts the parts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from spillway_cli.local import procs
from spillway_cli.local.names import (
    CAPTURE_ROOT,
    DATA_BUCKET,
    JOBS_FUNCTION,
    JOBS_STAGING,
    LOCAL_API_KEY,
    MODELS_BUCKET,
    POLICY_PARAMETER,
    REGION,
    REPOSITORY,
    SCOPE_PROOF_KEY_NAME,
    STATE_TABLE,
    TENANTS_ROOT,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG_TTL_S = 2.0
"""How long the local doors keep the live configuration (`spillway tenants`): 2 s, so a
change is seen at once; deployed functions keep it 30 s."""
SCOPE_PROOF_ENV = "SCOPE_PROOF_SECRET_ID"
"""The variable naming the tenant scope proof key (``spillway.tenancy.proof``)."""
TRACED = ("router", "gpu", "cpu", "jobs", "websocket")
"""The parts that export spans; each is ``spillway-<part>`` (``OTEL_SERVICE_NAME``). A
batch job's children are ``spillway-batch`` (``spillway_cli.local.batch``)."""
STATE_MACHINES = {
    "topics": f"arn:aws:states:{REGION}:123456789012:stateMachine:spillway-local-topics"
}
"""The pipelines whose async requests run as executions on the local Step Functions
endpoint (``ASYNC_STATE_MACHINES``), each running ``infra/statemachines/<name>.asl.json``."""


@dataclass
class Ports:
    """Where each part listens on 127.0.0.1 (0: a free port)."""

    moto: int = 0
    gpu: int = 0
    cpu: int = 0
    jobs: int = 0
    router: int = 0
    dashboard: int = 0
    states: int = 0
    gpu_grpc: int = 0
    """The GPU service's KServe V2 gRPC port."""
    websocket: int = 0
    """The WebSocket API (and its ``@connections`` management API)."""
    traces: int = 0
    """The trace receiver (OTLP/HTTP) and its view (``spillway_cli.dashboard.trace_server``)."""

    def resolved(self) -> Ports:
        return Ports(
            *(
                p or procs.free_port()
                for p in (
                    self.moto,
                    self.gpu,
                    self.cpu,
                    self.jobs,
                    self.router,
                    self.dashboard,
                    self.states,
                    self.gpu_grpc,
                    self.websocket,
                    self.traces,
                )
            )
        )


@dataclass
class StackLayout:
    """The local platform's parts as they are configured (``LocalStack`` starts them)."""

    models: Path
    log_dir: Path
    ports: Ports = field(default_factory=Ports)
    policy: Path = ROOT / "policies" / "example.yaml"
    gpu_settings: dict[str, str] = field(default_factory=dict)
    router_runtime: str = "wsgi"
    router_headers: dict[str, str] = field(default_factory=dict)
    """What a request to the router carries (the local API key under serverless-offline)."""
    async_vars: dict[str, str] = field(default_factory=dict)
    """The ``ASYNC_*`` variables of the async resources (every process gets them)."""
    env_path: Path | None = None
    """Where the stack env file goes (``spillway_cli.local.stackenv``); default
    ``<log_dir>/env.json``."""
    router_reason: str = ""
    """Why the router runs under ``router_runtime`` (``spillway up`` prints it)."""
    check_api_keys: bool = False
    """The WSGI router behind the REST API's API key check, as serverless-offline puts the
    other runtime's (``spillway up``: always): a request without the local stage's key is
    403 and a caller's tenant is its key's (``lambda_http.api_key_door``). Off, the WSGI
    router takes every caller as the anonymous tenant (the e2e stack's callers)."""
    state_dir: Path | None = None
    """Where the stack keeps what it was given across restarts (``spillway_cli.local.keep``;
    ``spillway up``: ``<log_dir>/state``); ``None``: it starts clean and keeps nothing."""
    fresh: bool = False
    """Start clean: set the kept state aside (``<state_dir>.previous``) first."""
    traces: bool = True
    """Run the trace receiver and view, and point every traced part at it."""
    trace_sample: float | None = None
    """The share of requests a router starts that are traced (``SPILLWAY_TRACE_SAMPLE``;
    ``None``: the processes' own setting, else every one)."""

    def url(self, part: str) -> str:
        return f"http://127.0.0.1:{getattr(self.ports, part)}"

    @property
    def websocket_url(self) -> str:
        """Where WebSocket clients connect."""
        return f"ws://127.0.0.1:{self.ports.websocket}"

    def aws_env(self) -> dict[str, str]:
        """boto3's standard variables pointing every client at the moto server."""
        return {
            "AWS_ENDPOINT_URL": self.url("moto"),
            "AWS_ACCESS_KEY_ID": "local",
            "AWS_SECRET_ACCESS_KEY": "local",
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            # The tenant scope proof key (spillway.tenancy.proof): the router signs with
            # it, the GPU service and the CPU fallback verify.
            SCOPE_PROOF_ENV: SCOPE_PROOF_KEY_NAME,
            **self.async_vars,
        }

    @property
    def stack_env_path(self) -> Path:
        """The stack env file of this stack (``spillway_cli.local.stackenv``)."""
        return self.env_path or self.log_dir / "env.json"

    def stack_env(self) -> dict[str, str]:
        """What the ``spillway`` commands need to reach this stack, by variable name: the
        AWS endpoint, region and dummy credentials, the tables (state, async, jobs),
        buckets and model repository, the services' URLs, where the router reads its
        policy and where it writes its metric lines and its log."""
        from batch_job.settings import JobsSettings

        jobs = JobsSettings()
        policy = (
            {"SPILLWAY_POLICY_PARAMETER": POLICY_PARAMETER}
            if self.router_runtime == "serverless-offline"
            else {"SPILLWAY_POLICY_FILE": str(self.policy_copy)}
        )
        token = self.gpu_settings.get("GPU_ADMIN_TOKEN")
        return {
            **self.aws_env(),
            "ROUTER_STATE_TABLE": STATE_TABLE,
            "ROUTER_GPU_URL": self.url("gpu"),
            "ROUTER_CPU_URL": self.url("cpu"),
            "JOBS_TABLE": jobs.table,
            "JOBS_JOB_QUEUE": jobs.job_queue,
            "JOBS_JOB_DEFINITION": jobs.job_definition,
            "JOBS_REPOSITORY": REPOSITORY,
            "JOBS_TENANTS_ROOT": TENANTS_ROOT,
            "JOBS_STAGING": JOBS_STAGING,
            "SPILLWAY_REPOSITORY": REPOSITORY,
            "SPILLWAY_MODELS_BUCKET": MODELS_BUCKET,
            "SPILLWAY_DATA_BUCKET": DATA_BUCKET,
            "SPILLWAY_GPU_URL": self.url("gpu"),
            "SPILLWAY_CPU_URL": self.url("cpu"),
            "SPILLWAY_JOBS_URL": self.url("jobs"),
            "SPILLWAY_ROUTER_URL": self.url("router"),
            "SPILLWAY_WEBSOCKET_URL": self.websocket_url,
            "SPILLWAY_DASHBOARD_URL": self.url("dashboard"),
            **({"SPILLWAY_TRACES_URL": self.url("traces")} if self.traces else {}),
            "SPILLWAY_METRICS_LOG": str(self.metrics_log),
            "SPILLWAY_ROUTER_LOG": str(self.log_dir / "router.log"),
            **({"SPILLWAY_API_KEY": LOCAL_API_KEY} if self.router_headers else {}),
            **policy,
            **({"SPILLWAY_ADMIN_TOKEN": token} if token else {}),
        }

    def trace_env(self, part: str) -> dict[str, str]:
        """The OpenTelemetry variables of a traced part (``TRACED``; none for another):
        its service name, the sample share when given, and, with the receiver on, its
        OTLP endpoint. Off, a part exports where the environment already says, if it
        says (``spillway up --no-traces`` beside a collector of one's own)."""
        if part not in TRACED:
            return {}
        env = {"OTEL_SERVICE_NAME": f"spillway-{part}"}
        if self.trace_sample is not None:
            env["SPILLWAY_TRACE_SAMPLE"] = repr(self.trace_sample)
        if self.traces:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.url("traces")
            # A request's spans in the view half a second after it ends (the SDK's
            # default is 5 s): the receiver is local and cheap to call.
            env["OTEL_BSP_SCHEDULE_DELAY"] = "500"
        return env

    @property
    def traces_url(self) -> str:
        """The trace view's list page."""
        return f"{self.url('traces')}/traces"

    @property
    def sam_env_path(self) -> Path:
        """The ``sam local invoke --env-vars`` file of this stack."""
        return self.log_dir / "sam-env.json"

    @property
    def metrics_log(self) -> Path:
        """Where the router's EMF metric lines go: ``ROUTER_METRICS_LOG`` of the WSGI
        router; under serverless-offline the handler's stdout, the router's log."""
        if self.router_runtime == "serverless-offline":
            return self.log_dir / "router.log"
        return self.log_dir / "router-metrics.jsonl"

    @property
    def policy_copy(self) -> Path:
        """The WSGI router's policy file: a copy of ``policy`` in the log folder, so that
        ``spillway policy apply`` changes this stack's policy, not the checked-in one."""
        return self.log_dir / "policy.yaml"

    def urls(self) -> dict[str, str]:
        """Each part's URL (another ``spillway up`` shows them)."""
        parts = ("router", "gpu", "cpu", "jobs", "moto", "dashboard")
        urls = {**{part: self.url(part) for part in parts}, "websocket": self.websocket_url}
        return {**urls, "traces": self.traces_url} if self.traces else urls

    def jobs_env(self) -> dict[str, str]:
        """The jobs API's settings: tenants' areas under ``tenants/`` and the router's
        staging, the local API key mapped to the ``local`` tenant; a router that checks no
        API key (``check_api_keys`` off) vouches for nobody, so its anonymous callers'
        jobs are the anonymous tenant's (``JOBS_TRUST_TENANT_HINTS``, a local-only
        setting)."""
        return {
            "JOBS_REPOSITORY": REPOSITORY,
            "JOBS_CACHE_DIR": str(self.log_dir / "jobs-cache"),
            "JOBS_WORK_DIR": str(self.log_dir / "jobs-work"),
            "JOBS_TENANTS_ROOT": TENANTS_ROOT,
            "JOBS_STAGING": JOBS_STAGING,
            "JOBS_IDENTITY_TENANTS": json.dumps({LOCAL_API_KEY: "local"}),
            "JOBS_CONFIG_TABLE": STATE_TABLE,
            "JOBS_CONFIG_TTL_S": str(CONFIG_TTL_S),
            "JOBS_TRUST_TENANT_HINTS": "true",
        }

    def states_env(self) -> dict[str, str]:
        """The router's variables that run async pipeline requests as executions."""
        return {
            "AWS_ENDPOINT_URL_SFN": self.url("states"),
            "ASYNC_STATE_MACHINES": json.dumps(STATE_MACHINES),
        }

    def router_env(self) -> dict[str, str]:
        """The WSGI router's variables (beyond ``aws_env``)."""
        return {
            **self.states_env(),
            "ROUTER_GPU_URL": self.url("gpu"),
            "ROUTER_CPU_URL": self.url("cpu"),
            # Batch mode invokes the jobs function as on AWS (Lambda's invoke API, which
            # `spillway serve jobs` answers): the invoke event carries the caller's tenant.
            "ROUTER_JOBS_FUNCTION": JOBS_FUNCTION,
            "AWS_ENDPOINT_URL_LAMBDA": self.url("jobs"),
            "ROUTER_JOBS_STAGING": JOBS_STAGING,
            "ROUTER_POLICY_FILE": str(self.policy_copy),
            "ROUTER_STATE_TABLE": STATE_TABLE,
            "ROUTER_MODEL_REPOSITORY": REPOSITORY,
            "ROUTER_CONFIG_TTL_S": str(CONFIG_TTL_S),
            "ROUTER_METRICS_LOG": str(self.log_dir / "router-metrics.jsonl"),
            # Data capture's root, as the templates give it (the policy's ``capture``
            # section decides what is kept; none: nothing).
            "ROUTER_CAPTURE_ROOT": CAPTURE_ROOT,
        }

    def websocket_env(self) -> dict[str, str]:
        """The WebSocket function's variables under ``spillway serve websocket``: the
        router's (it routes frames with the same router), answers pushed to the local
        gateway's ``@connections`` API, and, as nothing authenticates a local caller, a
        connection's tenant named by its ``x-spillway-tenant`` header on ``$connect`` (a
        local-only setting; the local API key is the ``local`` tenant's)."""
        return {
            **self.router_env(),
            "ROUTER_TRUST_TENANT_HINTS": "true",
            "ROUTER_IDENTITY_TENANTS": json.dumps({LOCAL_API_KEY: "local"}),
            "WS_MANAGEMENT_ENDPOINT": self.url("websocket"),
        }
