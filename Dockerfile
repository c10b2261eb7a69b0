# syntax=docker/dockerfile:1
# The sidecar's image. Two targets:
#   runtime (the default): `sidecar` on a slim Python, run as `sidecar watch` in a pod's native
#     sidecar container or as `sidecar run -- ...` in front of a command;
#   bundle: the self-contained PyInstaller build, which an init container copies into an emptyDir
#     so a trainer image with no compatible Python can run `/sidecar/bin/sidecar run -- ...`.
#
#   docker build -t sidecar:0.1.0 .
#   docker build --target bundle -t sidecar-bundle:0.1.0 .
#   docker build --build-arg PYTHON_IMAGE=python:3.13-slim-bookworm -t sidecar:0.1.0 .

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# The bundle carries its own interpreter but uses the trainer image's glibc, so it is built on an
# old one: bullseye's glibc 2.31 runs on Debian 11+, Ubuntu 20.04+, RHEL 9+.
ARG BUNDLE_IMAGE=python:3.12-slim-bullseye

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar/ sidecar/
# Wheels only: a dependency that would need a compiler fails here rather than pulling one in.
RUN python -m venv /opt/sidecar \
 && /opt/sidecar/bin/pip install --only-binary=:all: . \
 && /opt/sidecar/bin/pip uninstall -y pip \
 && /opt/sidecar/bin/sidecar --version

FROM ${BUNDLE_IMAGE} AS bundle-build
# PyInstaller reads shared objects with binutils; this stage is thrown away after the build.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends binutils \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar/ sidecar/
COPY deploy/bundle/ deploy/bundle/
RUN deploy/bundle/build.sh /opt/bundle

FROM ${BUNDLE_IMAGE} AS bundle
COPY --from=bundle-build /opt/bundle/sidecar/ /opt/sidecar-bundle/bin/
USER 10001:10001
# An init container runs this with an emptyDir mounted at /sidecar.
ENTRYPOINT ["cp", "-R", "/opt/sidecar-bundle/.", "/sidecar/"]

FROM ${PYTHON_IMAGE} AS runtime
ARG PYTHON_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="sidecar" \
      org.opencontainers.image.description="Forwards a training job's output, metrics, telemetry and lifecycle to the platform's ingest API" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"

RUN groupadd --system --gid 10001 sidecar \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/sidecar --no-create-home \
        --shell /usr/sbin/nologin sidecar \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/sidecar
COPY --from=build /opt/sidecar /opt/sidecar
# The state dir is a volume in Kubernetes (the root filesystem is read-only there).
ENV PATH=/opt/sidecar/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SIDECAR_STATE_DIR=/var/lib/sidecar
USER 10001:10001
WORKDIR /var/lib/sidecar
EXPOSE 9620
COPY deploy/docker/healthcheck.py /opt/sidecar/healthcheck.py
# Docker and Podman only (Kubernetes ignores HEALTHCHECK; the manifests probe /healthz with
# httpGet). Python's urllib, since the slim base has no curl: the address the daemon bound (its
# state dir's status-addr, else SIDECAR_STATUS_ADDR), proxies bypassed; healthy without probing
# when the status endpoint is off.
HEALTHCHECK --interval=30s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python", "/opt/sidecar/healthcheck.py"]
ENTRYPOINT ["sidecar"]
CMD ["watch"]
