"""Names of the local stack's AWS resources (on moto): shared by the stack that creates
them (``spillway_cli.local.stack``) and the ``sam local invoke`` env-vars file that points the
template's functions at them (``spillway_cli.local.sam_env``)."""

from __future__ import annotations

REGION = "us-east-1"
MODELS_BUCKET = "spillway-models"
DATA_BUCKET = "spillway-data"
REPOSITORY = f"s3://{MODELS_BUCKET}/repository"
LOCAL_API_KEY = "spillway-local-key"  # serverless.yml's key name at stage local; not a secret
TENANTS_ROOT = f"s3://{DATA_BUCKET}/tenants"  # each tenant's job data: <root>/<scope>/
JOBS_STAGING = f"s3://{DATA_BUCKET}/staging"  # the router's batch-mode staging
CAPTURE_ROOT = f"s3://{DATA_BUCKET}/capture"  # data capture: <root>/<scope>/<model>/...
ROUTER_FUNCTION = "spillway-local-router"  # serverless.yml's router name at stage local
JOBS_FUNCTION = "spillway-local-jobs"  # the name `spillway serve jobs` answers invokes for
STATE_TABLE = "spillway-local-router-state"  # serverless.yml's stateTable at stage local
POLICY_PARAMETER = "/spillway-local/router/policy"  # SSM name at serverless.yml's stage local
SCOPE_PROOF_KEY_NAME = "spillway-local-scope-proof-key"  # Secrets Manager: the scope proof key
