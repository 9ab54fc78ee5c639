"""The local stand-ins: the AWS services Spillway uses, emulated on 127.0.0.1, and the
local stack (``spillway up``, ``make demo``) that starts them.

Each stand-in is at least as strict as the service it stands for, with the same
refusal, and names the documentation page of the limit it enforces. Nothing here is
deployed, and no production package imports it (tests/unit/test_architecture.py); the
commands at the top of ``spillway_cli`` use it, never the other way round.

- the stack: ``stack`` (starting and stopping the parts), ``layout`` (their ports,
  URLs and variables), ``serverless_offline`` (the router under serverless-offline),
  ``procs`` (child processes), ``stackenv`` (the stack env file the commands read),
  ``running`` (one stack per folder, the stacks that run), ``keep`` (what a stack keeps
  across restarts), ``summary`` (what a running stack prints), ``sam_env`` (``sam local
  invoke``'s env-vars file), ``names`` (the AWS resources' names);
- AWS on moto: ``moto_atomic`` (moto's server with DynamoDB's atomic item writes and
  AWS's key and message limits), ``async_resources``, ``batch`` (AWS Batch jobs run as
  local processes), ``scope_key`` (the Secrets Manager key);
- API Gateway and Lambda: ``websocket`` (the WebSocket API and its ``@connections``
  API), ``lambda_http`` (the REST proxy integration, the API key check, and Lambda's
  invoke API),
  ``wsgi_server`` (a WSGI app on a local HTTP/1.1 server), ``lambda_runtime`` (a handler
  loaded by name, the context it is given), ``offline_handlers`` (the handlers
  serverless-offline runs, their context as Lambda's);
- Step Functions: ``states`` (the Amazon States Language interpreter) and
  ``step_functions`` (its ``StartExecution``/``DescribeExecution`` API).
"""
