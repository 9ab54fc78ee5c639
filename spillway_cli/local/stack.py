"""``spillway up``: the whole platform on 127.0.0.1, with moto as the AWS endpoint.

Starts, in order, and waits for each to be healthy: the trace receiver (every traced
part exports its spans there), a moto server (S3, Batch without Docker, DynamoDB, SSM,
...), the model repository uploaded to S3 there, the GPU service (CUDA where present,
CPU otherwise — its log says which), the CPU fallback, the local
Step Functions endpoint (in this process: async ``topics`` requests run as executions of
its state machine, whose states invoke the CPU fallback through Lambda's invoke API), the
jobs API and the router. Every child is a process of ours, stopped by PID; the Step
Functions endpoint stops with the stack. What each part is told (ports, URLs, variables)
is ``spillway_cli.local.layout``'s; the router under serverless-offline is
``spillway_cli.local.serverless_offline``'s.

One stack per folder: the stack holds its log folder (``spillway_cli.local.running``)
from before it starts anything until everything has stopped. With a ``state_dir`` it
keeps what it was given across restarts (``spillway_cli.local.keep``): restored before
the services start, saved when it stops, before moto stops.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spillway.aws.clients import aws_client, client
from spillway_cli.local import keep, procs, running, serverless_offline, stackenv, summary
from spillway_cli.local.layout import SCOPE_PROOF_ENV, STATE_MACHINES, StackLayout
from spillway_cli.local.names import (
    DATA_BUCKET,
    LOCAL_API_KEY,
    MODELS_BUCKET,
    POLICY_PARAMETER,
    REGION,
    REPOSITORY,
    SCOPE_PROOF_KEY_NAME,
    STATE_TABLE,
)

if TYPE_CHECKING:
    from spillway_cli.local.step_functions import LocalStepFunctions

log = logging.getLogger("spillway.stack")


class StackError(RuntimeError):
    """A part of the stack did not come up: which, why, and the end of its log."""

    def __init__(self, part: str, reason: str, child: procs.Child) -> None:
        super().__init__(f"{part} did not come up: {reason}\n{child.log_tail()}")
        self.part = part
        self.reason = reason
        self.log_path = child.log_path
        self.tail = child.log_tail(10)


@dataclass
class LocalStack(StackLayout):
    """The running parts of the local platform."""

    router_fallback: bool = False
    """``auto`` chose serverless-offline: if the router does not come up under it within
    ``serverless_offline.FALLBACK_WAIT_S``, the WSGI router replaces it (and the log says
    why)."""
    children: dict[str, procs.Child] = field(default_factory=dict)
    states: LocalStepFunctions | None = None
    """The local Step Functions endpoint (``AWS_ENDPOINT_URL_SFN`` of the router), served
    in this process while the stack runs."""
    progress: Callable[[str], None] | None = None
    """Told one line per part as it comes up, with the seconds it took (``spillway up``
    prints them), and the state kept when it stops."""
    findable: bool = False
    """Commands run in other folders may find this stack through this user's registry
    (``stackenv.find_stack_env``): ``spillway up``'s stack is, a test's is not."""
    kept: keep.Kept | None = field(default=None, init=False)
    """What the stack kept when it stopped (``None``: nothing saved; ``state_dir``)."""
    _states_server: Any = field(default=None, init=False, repr=False)
    _claim: running.Claim | None = field(default=None, init=False, repr=False)
    _keeper: keep.StateKeeper | None = field(default=None, init=False, repr=False)

    def start(self) -> None:
        """Bring every part up, in dependency order; the stack env file last.
        ``running.StackRunning`` (nothing started) when a stack holds this folder."""
        claim = running.Claim(self.log_dir, self.stack_env_path, findable=self.findable)
        claim.acquire()
        self._claim = claim
        self.ports = self.ports.resolved()
        claim.publish(ports=asdict(self.ports), urls=self.urls())
        # boto3's variables for this process's own clients. The scope proof key goes only
        # to the parts started: a process that goes on after the stack (a test session)
        # must not sign or verify scopes with a key whose server is gone.
        os.environ.update({k: v for k, v in self.aws_env().items() if k != SCOPE_PROOF_ENV})
        try:
            self._traces()
            self._moto()
            self._repository()
            started = time.monotonic()
            self._jobs_resources()
            self._state_table()
            self._async_resources()
            self._scope_key()
            self._say("aws", started, "buckets, tables, queues, Batch, key on moto")
            started = time.monotonic()
            restored = self._keeper.put_back() if self._keeper is not None else ""
            self._policy_parameter()
            if self._keeper is not None:
                self._keeper.started()
                self._say("state", started, restored)
            self.start_gpu()
            self._start(
                "cpu",
                [
                    *_spillway(),
                    "serve",
                    "cpu",
                    "--port",
                    str(self.ports.cpu),
                    "--repository",
                    REPOSITORY,
                ],
                {"CPU_CACHE_DIR": str(self.log_dir / "cpu-cache")},
                "/v2/health/ready",
            )
            self._step_functions()
            self._start(
                "jobs",
                [*_spillway(), "serve", "jobs", "--port", str(self.ports.jobs)],
                self.jobs_env(),
                "/v1/health",
            )
            if self.router_runtime == "serverless-offline" and not self._offline_router():
                self.router_runtime, self.router_headers = "wsgi", {}
            if self.router_runtime != "serverless-offline":
                self._router_wsgi()
            self._websocket()
            self._dashboard()
            self.write_sam_env()
            stackenv.write_stack_env(self.stack_env_path, self.stack_env())
            claim.publish(state="up", urls=self.urls())
        except BaseException:
            self.stop()
            raise

    @property
    def states_served(self) -> bool:
        """Whether the local Step Functions endpoint is served."""
        return self._states_server is not None

    def _router_wsgi(self) -> None:
        """The router as a WSGI app (``spillway serve router``), behind the REST API's API
        key check when ``check_api_keys`` (``lambda_http.api_key_door``)."""
        argv = [*_spillway(), "serve", "router", "--port", str(self.ports.router)]
        if self.check_api_keys:
            argv += ["--api-key", LOCAL_API_KEY]
            self.router_headers = {"x-api-key": LOCAL_API_KEY}
        self._start("router", argv, self.router_env(), "/v2/health/live", self.router_headers)

    def write_sam_env(self) -> Path:
        """Write the env-vars file pointing template.yaml's functions at this stack."""
        from spillway_cli.local.sam_env import write_env_vars

        return write_env_vars(self, self.sam_env_path)

    def _say(self, part: str, started: float, what: str) -> None:
        if self.progress is not None:
            self.progress(f"  {part:<9} {time.monotonic() - started:5.1f} s  {what}")

    def start_gpu(self) -> None:
        """(Re)start the GPU service from the S3 repository."""
        env = {
            "GPU_REPOSITORY": REPOSITORY,
            "GPU_PORT": str(self.ports.gpu),
            "GPU_GRPC_PORT": str(self.ports.gpu_grpc),
            "GPU_MODEL_CONTROL_MODE": "explicit",
            "GPU_CACHE_DIR": str(self.log_dir / "gpu-cache"),
            **self.gpu_settings,
        }
        self._start("gpu", [sys.executable, "-m", "gpu_service"], env, "/v2/health/ready")

    def _start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        health: str,
        headers: dict[str, str] | None = None,
        *,
        own_session: bool = False,
    ) -> None:
        started = time.monotonic()
        env = {**self.aws_env(), **self.trace_env(name), **env}
        child = procs.start(name, argv, self.log_dir, env, own_session=own_session)
        self.children[name] = child
        try:
            procs.wait_http(f"{self.url(name)}{health}", 180, child.proc, headers=headers)
        except (RuntimeError, TimeoutError) as exc:
            raise StackError(name, str(exc), child) from exc
        log.info("%s is up at %s (pid %d)", name, self.url(name), child.pid)
        self._say(name, started, self.url(name))

    def _traces(self) -> None:
        """The trace receiver and view, first: every traced part exports to it from its
        start (``layout.StackLayout.trace_env``), and it stops after them."""
        if self.traces:
            argv = [sys.executable, "-m", "spillway_cli.dashboard.trace_server"]
            self._start("traces", [*argv, "--port", str(self.ports.traces)], {}, "/api/health")

    def _moto(self) -> None:
        # moto's server, its DynamoDB item writes atomic (spillway_cli.local.moto_atomic).
        # With a state to keep, in a session of its own: the terminal's Ctrl-C must not
        # stop it before the state is saved.
        argv = [sys.executable, "-m", "spillway_cli.local.moto_atomic", "-H", "127.0.0.1"]
        argv += ["-p", str(self.ports.moto)]
        self._start("moto", argv, {}, "/moto-api/", own_session=self.state_dir is not None)

    def _repository(self) -> None:
        """The buckets, and the models folder uploaded to the repository; with a state to
        keep, the kept state read first (its removed files are left out)."""
        started = time.monotonic()
        s3 = aws_client("s3", REGION)
        for bucket in (MODELS_BUCKET, DATA_BUCKET):
            s3.create_bucket(Bucket=bucket)
        if self.state_dir is None:
            files, _ = keep.upload_folder(s3, self.models, (MODELS_BUCKET, "repository/"))
            self._say("models", started, f"{len(files)} files in {REPOSITORY}")
            return
        keeper = keep.StateKeeper(self.state_dir, _kept_resources(), _clients)
        keeper.begin(self.fresh)
        self._keeper = keeper
        uploaded, left_out = keeper.upload_folder(self.models)
        removed = f" ({left_out} left out: removed from it since)" if left_out else ""
        self._say("models", started, f"{uploaded} files in {REPOSITORY}{removed}")

    def _jobs_resources(self) -> None:
        from batch_job.settings import JobsSettings
        from spillway_cli.local.batch import configure_moto, create_resources

        configure_moto(self.url("moto"))
        create_resources(JobsSettings())

    def _state_table(self) -> None:
        """The routers' state table (canaries, session affinity, session state), TTL on."""
        from spillway.state.table import create_table

        create_table(aws_client("dynamodb", REGION), STATE_TABLE)

    def _async_resources(self) -> None:
        """Async inference's table, queue, dead-letter queue and bucket prefix on moto."""
        from spillway_cli.local.async_resources import async_env, create_async_resources

        self.async_vars = async_env(create_async_resources(DATA_BUCKET))
        os.environ.update(self.async_vars)

    def _step_functions(self) -> None:
        """Serve ``LocalStepFunctions`` with each pipeline's checked-in definition, its
        states invoking the CPU fallback through Lambda's invoke API (as Step Functions
        invokes the function on AWS) and writing to S3 on moto."""
        from spillway.fallback.settings import CpuSettings
        from spillway_cli.local.states import LocalStateMachine, substituted
        from spillway_cli.local.step_functions import LocalStepFunctions
        from spillway_cli.local.wsgi_server import server
        from spillway_cli.statemachines import definition_path, substitutions

        # One attempt per call: the definition's own Retry handles the service's errors.
        invoke = client(
            "lambda",
            region=REGION,
            endpoint_url=self.url("cpu"),
            connect_timeout=None,
            read_timeout=300,
            max_attempts=1,
        )
        values = substitutions(CpuSettings().function_name, DATA_BUCKET)
        machines = {
            arn: LocalStateMachine(
                substituted(json.loads(definition_path(name).read_text()), values),
                functions={},
                s3=aws_client("s3", REGION),
                lambda_client=invoke,
            )
            for name, arn in STATE_MACHINES.items()
        }
        started = time.monotonic()
        self.states = LocalStepFunctions(machines)
        httpd = server(self.states, "127.0.0.1", self.ports.states)
        thread = threading.Thread(target=httpd.serve_forever, name="local-states", daemon=True)
        thread.start()
        self._states_server = (httpd, thread)
        log.info("states is up at %s (in this process)", self.url("states"))
        self._say("states", started, self.url("states"))

    def _stop_step_functions(self) -> None:
        """Stop serving, then wait for the executions already running."""
        if self._states_server is not None:
            httpd, thread = self._states_server
            self._states_server = None
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=10)
            log.info("states stopped")
        if self.states is not None:
            self.states.close()

    def _websocket(self) -> None:
        """The WebSocket API, under every router runtime: ``spillway serve websocket``
        running the WebSocket function as API Gateway would, and as strict (binary
        frames, frame and message sizes, idle and lifetime: ``spillway_cli.local.websocket``).
        serverless-offline's own WebSocket server takes binary frames and messages over
        128 KB, so it is not used (``_router_offline`` moves it to a port nobody uses);
        under it, the function reads the policy where the offline router does."""
        started = time.monotonic()
        env = {**self.aws_env(), **self.trace_env("websocket"), **self.websocket_env()}
        if self.router_runtime == "serverless-offline":
            env["ROUTER_POLICY_PARAMETER"] = POLICY_PARAMETER
        argv = [*_spillway(), "serve", "websocket", "--port", str(self.ports.websocket)]
        child = procs.start("websocket", argv, self.log_dir, env)
        self.children["websocket"] = child
        how = f"pid {child.pid}"
        try:
            procs.wait_accepting(self.ports.websocket, 180, child.proc)
        except (RuntimeError, TimeoutError) as exc:
            raise StackError("websocket", str(exc), child) from exc
        log.info("websocket is up at %s (%s)", self.websocket_url, how)
        self._say("websocket", started, self.websocket_url)

    def _offline_router(self) -> bool:
        """Start the router under serverless-offline; ``False`` when it did not come up
        and the WSGI router may replace it."""
        try:
            self._router_offline()
        except (RuntimeError, TimeoutError) as exc:
            if not self.router_fallback:
                raise
            for name in (serverless_offline.DOOR, "router"):
                if (child := self.children.pop(name, None)) is not None:
                    child.stop()
            log.warning("the router did not come up under serverless-offline (%s): wsgi", exc)
            self.router_reason = f"serverless-offline did not come up: {exc}"
            return False
        return True

    def _dashboard(self) -> None:
        """The live dashboard over the router's logs, the services' metrics and the
        operator's stores: canaries, the policy the router reads, the async backlog (the
        ``ASYNC_*`` variables every part gets) and batch jobs."""
        from batch_job.settings import JobsSettings

        argv = [*_spillway(), "dashboard", "--port", str(self.ports.dashboard)]
        argv += ["--gpu-url", self.url("gpu"), "--cpu-url", self.url("cpu")]
        argv += ["--state-table", STATE_TABLE, "--jobs-table", JobsSettings().table]
        if self.router_runtime == "serverless-offline":
            argv += ["--policy-parameter", POLICY_PARAMETER]
        else:
            argv += ["--policy-file", self.router_env()["ROUTER_POLICY_FILE"]]
        for name in ("router-metrics.jsonl", "router.log"):
            argv += ["--log", str(self.log_dir / name)]
        self._start("dashboard", argv, {}, "/api/health")

    def _policy_parameter(self) -> None:
        """The policy as the deployed router reads it: an SSM parameter (on moto); and
        as the WSGI router reads it, a file. The kept one, when one was applied."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        kept = self._keeper.policy if self._keeper is not None else None
        text = kept if kept is not None else self.policy.read_text()
        if kept is None:
            shutil.copyfile(self.policy, self.policy_copy)
        else:
            self.policy_copy.write_text(kept, encoding="utf-8")
        aws_client("ssm", REGION).put_parameter(
            Name=POLICY_PARAMETER, Value=text, Type="String", Overwrite=True
        )

    def _policy_in_force(self) -> str | None:
        """The policy the router reads now when ``spillway policy apply`` changed it."""
        if self.router_runtime == "serverless-offline":
            answer = aws_client("ssm", REGION).get_parameter(Name=POLICY_PARAMETER)
            text = str(answer["Parameter"]["Value"])
        else:
            text = self.policy_copy.read_text(encoding="utf-8")
        return None if text == self.policy.read_text() else text

    def _scope_key(self) -> None:
        """The tenant scope proof key, a generated Secrets Manager secret on moto (as
        infra/storage.yaml's ``ScopeProofKeySecret``)."""
        from spillway_cli.local.scope_key import create_scope_key

        create_scope_key(aws_client("secretsmanager", REGION), SCOPE_PROOF_KEY_NAME)

    def _router_offline(self) -> None:
        """The router as serverless.yml describes it, under serverless-offline (stage
        ``local``): its policy from an SSM parameter on moto, the CPU fallback through
        Lambda's invoke API served by ``spillway serve cpu``."""
        lambda_port = procs.free_port()
        argv, env = serverless_offline.command(self, lambda_port)
        self.router_headers = {"x-api-key": LOCAL_API_KEY}
        started = time.monotonic()
        wait_s = serverless_offline.FALLBACK_WAIT_S if self.router_fallback else 180
        env = {**self.aws_env(), **self.trace_env("router"), **env}
        child = procs.start("router", argv, self.log_dir, env)
        self.children["router"] = child
        procs.wait_accepting(lambda_port, wait_s, child.proc)
        # The REST API's door on the router's port (binary bodies base64, as on AWS).
        door_argv = serverless_offline.door_command(self, lambda_port)
        door = procs.start(serverless_offline.DOOR, door_argv, self.log_dir, self.aws_env())
        self.children[serverless_offline.DOOR] = door
        procs.wait_accepting(self.ports.router, 60, door.proc)
        health = f"{self.url('router')}/v2/health/live"
        procs.wait_http(health, wait_s, child.proc, headers=self.router_headers)
        log.info(
            "router is up under serverless-offline at %s (pid %d)", self.url("router"), child.pid
        )
        self._say("router", started, f"{self.url('router')} (serverless-offline)")

    def stop(self) -> None:
        """Stop the Step Functions endpoint (its executions call the CPU fallback), then
        every child we started, newest first, by PID; the stack env file goes first, and
        the kept state is saved before moto stops. The folder is free once all is done."""
        stackenv.remove_stack_env(self.stack_env_path)
        if self._claim is not None:
            self._claim.publish(state="stopping")
        self._stop_step_functions()
        moto = self.children.pop("moto", None)
        for name in reversed(list(self.children)):
            self._stop_child(name, self.children.pop(name))
        if moto is not None:
            self._save()
            self._stop_child("moto", moto)
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def _stop_child(self, name: str, child: procs.Child) -> None:
        code = child.stop()
        log.info("%s stopped (pid %d, exit %s)", name, child.pid, code)

    def _save(self) -> None:
        """Save the kept state (every part but moto has stopped); a failure keeps the
        state of the last clean stop, and says so."""
        if self._keeper is None:
            return
        from spillway.aws.errors import aws_errors

        started = time.monotonic()
        failures: tuple[type[Exception], ...] = (*aws_errors(), OSError, RuntimeError, ValueError)
        try:
            self.kept = self._keeper.save(self._policy_in_force())
        except failures as exc:
            log.exception("the state was not saved")
            self._say("state", started, f"NOT saved ({exc}): {self.state_dir} is unchanged")
            return
        if self.kept is not None:
            self._say("state", started, f"kept {self.kept.describe()} in {self.state_dir}")

    def summary(self) -> str:
        """URLs and a first request to try."""
        return summary.summary(self, self.children, self.states_served)

    def tritonclient_line(self) -> str:
        """A shell line that infers one image on ``digits`` through the router with
        tritonclient, in this virtual environment's Python, and prints its label."""
        return summary.tritonclient_line(self)


def _kept_resources() -> keep.Resources:
    """The resources whose contents a stack keeps across restarts."""
    from batch_job.settings import JobsSettings
    from spillway_cli.local.async_resources import DEAD_LETTERS, QUEUE, TABLE

    return keep.Resources(
        buckets=(MODELS_BUCKET, DATA_BUCKET),
        repository=(MODELS_BUCKET, "repository/"),
        state_table=STATE_TABLE,
        async_table=TABLE,
        jobs_table=JobsSettings().table,
        queues=(QUEUE, DEAD_LETTERS),
    )


def _clients(service: str) -> Any:
    return aws_client(service, REGION)


def _spillway() -> list[str]:
    return [sys.executable, "-m", "spillway_cli.main"]
