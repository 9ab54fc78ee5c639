#!/bin/sh
# The entry point of AWS's Lambda base images: the handler is the one argument; without a
# Lambda runtime API to serve (a plain `docker run`), the runtime interface emulator
# provides one on port 8080.
if [ $# -ne 1 ]; then
    echo "entrypoint requires the handler name to be the first argument" 1>&2
    exit 142
fi
export _HANDLER="$1"
if [ -z "${AWS_LAMBDA_RUNTIME_API}" ]; then
    exec /usr/local/bin/aws-lambda-rie /var/runtime/bootstrap
fi
exec /var/runtime/bootstrap
