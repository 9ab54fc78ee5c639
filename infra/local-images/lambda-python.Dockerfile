# A local stand-in of AWS's Lambda base image for Python 3.12
# (public.ecr.aws/lambda/python:3.12), for `sam local invoke` and the CPU fallback's image
# where that registry cannot be reached. build.sh assembles the context: lang/ (this
# machine's CPython 3.12 with pip), runtime/ (awslambdaric, requirements.txt here),
# bootstrap, lambda-entrypoint.sh and the runtime interface emulator that the SAM CLI
# package bundles. docs/sam-local.md lists what differs from AWS's image.

ARG DEBIAN_IMAGE=spillway-local/debian:bookworm
FROM ${DEBIAN_IMAGE}

COPY lang/ /var/lang/
COPY runtime/ /var/runtime/
COPY aws-lambda-rie /usr/local/bin/aws-lambda-rie
COPY lambda-entrypoint.sh /lambda-entrypoint.sh

# AWS's image sets these (LANG there is en_US.UTF-8; Debian's built-in UTF-8 locale is
# C.UTF-8). pip trusts the CA bundle the image was built with, so `pip install` in a
# derived image works behind the same TLS-inspecting proxy as the build machine.
ENV LANG=C.UTF-8 \
    TZ=:/etc/localtime \
    PATH=/var/lang/bin:/usr/local/bin:/usr/bin/:/bin:/opt/bin \
    LD_LIBRARY_PATH=/var/lang/lib:/lib64:/usr/lib64:/var/runtime:/var/runtime/lib:/var/task:/var/task/lib:/opt/lib \
    LAMBDA_TASK_ROOT=/var/task \
    LAMBDA_RUNTIME_DIR=/var/runtime \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# Fails the build when a shared library the interpreter's modules need is missing.
RUN PYTHONPATH=/var/runtime python3.12 -c \
        "import awslambdaric, bz2, ctypes, hashlib, lzma, sqlite3, ssl, uuid, zlib" \
    && pip --version

WORKDIR /var/task
ENTRYPOINT ["/lambda-entrypoint.sh"]
