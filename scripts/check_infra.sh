#!/usr/bin/env bash
# Every offline check of the infrastructure code (`make check-infra` installs the tools
# first): hadolint, cfn-lint, `sam validate --lint`, SAM translation, `serverless
# package`, checkov over every template, the translated SAM output, the packaged
# Serverless output and the Dockerfiles, the SAM/Serverless parity test on the
# packaged output, and the second deploy (aliases that follow every change, no stateful
# or named resource replaced, no export in use changed: docs/deploy.md, "The second
# deploy"). Nothing reaches AWS: dummy credentials, telemetry off.
set -euo pipefail
cd "$(dirname "$0")/.."

INFRA=${INFRA_VENV:-.venv-infra}/bin
SAM=${SAM_VENV:-.venv-sam}/bin
OUT=build/checks
REGION=us-east-1
DUMMY_IMAGE=123456789012.dkr.ecr.${REGION}.amazonaws.com/spillway-cpu@sha256:$(printf '0%.0s' $(seq 64))

export AWS_ACCESS_KEY_ID=dummy AWS_SECRET_ACCESS_KEY=dummy AWS_SESSION_TOKEN=dummy
export AWS_DEFAULT_REGION=$REGION AWS_REGION=$REGION AWS_EC2_METADATA_DISABLED=true
export SAM_CLI_TELEMETRY=0 SAM_CLI_CONTAINER_CONNECTION_TIMEOUT=1
export SLS_TELEMETRY_DISABLED=1 SLS_NOTIFICATIONS_MODE=off SLS_DEPRECATION_DISABLE='*'
export SLS_INTERACTIVE_SETUP_DISABLE=1 SLS_USAGE_TRACKING_DISABLED=1
export BC_SKIP_MAPPING=TRUE CHECKOV_RUN_SCA_PACKAGE_SCAN_V2=false
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

TEMPLATES=(template.yaml infra/network.yaml infra/storage.yaml infra/ecs-gpu-service.yaml
           infra/batch.yaml infra/observability.yaml)
DOCKERFILES=(gpu_service/Dockerfile functions/cpu_infer/Dockerfile)
SLS_TEMPLATE=.serverless/cloudformation-template-update-stack.json
mkdir -p "$OUT"
step() { printf '\n== %s\n' "$*"; }

# cfn-lint exits 2 for errors, 4 for warnings, 8 for informational findings (summed):
# errors fail the run, warnings are printed (docs/deploy.md says why each is expected).
cfn_lint() {
    local rc=0
    "$INFRA/cfn-lint" --format parseable "$@" || rc=$?
    if (( rc & 2 )); then echo "cfn-lint: errors in $*" >&2; exit 1; fi
    echo "cfn-lint: 0 errors ($# templates)"
}

step "hadolint"
"$INFRA/hadolint" "${DOCKERFILES[@]}"
echo "hadolint: clean (${#DOCKERFILES[@]} Dockerfiles)"

step "cfn-lint: template.yaml and infra/"
cfn_lint "${TEMPLATES[@]}"

step "sam validate --lint"
"$SAM/sam" validate --lint --region "$REGION" --template-file template.yaml

step "sam build of the zip functions and their layer (the CPU image needs Docker)"
for function in RouterFunction JobsFunction; do
    "$SAM/sam" build "$function" --cached --build-in-source > "$OUT/sam-build-$function.log" 2>&1 \
        || { cat "$OUT/sam-build-$function.log"; exit 1; }
    test -f ".aws-sam/build/$function/functions/__init__.py"
    echo "sam build $function: ok"
done

step "SAM -> CloudFormation (for checkov)"
"$SAM/python" -m infra.checks.translate_sam template.yaml "$OUT/template.translated.json"

step "serverless package (stage prod, offline)"
make --no-print-directory -s -f infra/lambda/Makefile serverless PYTHON="$INFRA/python"
rm -rf .serverless
npx --no-install serverless package --stage prod --region "$REGION" \
    --param="cpuImageUri=$DUMMY_IMAGE" > "$OUT/serverless-package.log" 2>&1 \
    || { cat "$OUT/serverless-package.log"; exit 1; }
# v3's schema predates python3.12: those runtime warnings are the only ones accepted.
unexpected=$(grep -E "^\s+at '" "$OUT/serverless-package.log" \
    | grep -v -E "runtime(s\.[0-9]+)?': must be equal to one of the allowed values" || true)
if [[ -n "$unexpected" ]]; then
    echo "serverless: configuration warnings besides the python3.12 runtime:" >&2
    echo "$unexpected" >&2
    exit 1
fi
grep -q "Service packaged" "$OUT/serverless-package.log"
echo "serverless: packaged -> $SLS_TEMPLATE"

step "cfn-lint: the packaged Serverless template"
cfn_lint "$SLS_TEMPLATE"

step "aliased functions: what publishes a new version (docs/deploy.md, The second deploy)"
"$SAM/python" -m infra.checks.alias_versions template.yaml

step "the second deploy: replacements per parameter, the stateful lock, exports in use"
"$INFRA/python" -m infra.checks.second_deploy --translated "$OUT/template.translated.json"

step "checkov"
rc=0
"$INFRA/checkov" --skip-download --compact \
    --framework cloudformation dockerfile secrets \
    $(printf -- '-f %s ' "${TEMPLATES[@]}" "$OUT/template.translated.json" "$SLS_TEMPLATE" \
        "${DOCKERFILES[@]}" serverless.yml infra/serverless-resources.yml \
        infra/serverless-extensions.yml) \
    -o json --output-file-path "$OUT" > /dev/null 2> "$OUT/checkov.log" || rc=$?
if [[ ! -s "$OUT/results_json.json" ]]; then cat "$OUT/checkov.log" >&2; exit 1; fi
"$INFRA/python" -m infra.checks.checkov_report "$OUT/results_json.json" \
    "${TEMPLATES[@]}" "${DOCKERFILES[@]}"
(( rc == 0 )) || { echo "checkov exited $rc" >&2; exit 1; }

step "parity, IAM ARNs and account defaults: template.yaml vs the packaged Serverless template"
SPILLWAY_SLS_PACKAGED="$SLS_TEMPLATE" .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/unit/test_templates.py tests/unit/test_iam_arns.py tests/unit/test_deploy_traps.py

step "Lambda package sizes"
"$INFRA/python" - <<'PY'
import os, zipfile
def tree(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
deps, app = tree("build/lambda/deps/python"), "build/lambda/app.zip"
with zipfile.ZipFile(app) as z:
    unzipped = sum(i.file_size for i in z.infolist())
code = unzipped - deps
print(f"router/jobs dependencies (layer): {deps / 2**20:7.1f} MiB unzipped")
print(f"router/jobs code:                 {code / 2**20:7.1f} MiB unzipped")
print(f"serverless artefact app.zip:      {os.path.getsize(app) / 2**20:7.1f} MiB zipped, "
      f"{unzipped / 2**20:.1f} MiB unzipped (Lambda limit: 250 MiB = 262,144,000 bytes with layers)")
PY

step "WebSocket deployments follow what they deploy (template.yaml ID, serverless.yml hash)"
"$INFRA/python" -m infra.checks.ws_deployment --check

step "idle cost: docs/deploy.md equals python -m infra.idle_cost"
"$INFRA/python" -m infra.idle_cost --check

step "AWS terms: AL2023 GPU AMIs, inline egress, the gRPC name, WebSocket deployments, idle cost"
SPILLWAY_SLS_PACKAGED="$SLS_TEMPLATE" .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/unit/test_aws_terms_templates.py
echo
echo "check-infra: all checks passed"
