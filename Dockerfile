# syntax=docker/dockerfile:1
# tracktron on a GPU host: the official PyTorch CUDA runtime image plus this package.
#
#   docker build -t tracktron .
#   docker run --rm --gpus all --shm-size=8g --stop-timeout 60 \
#     -v "$PWD/datasets:/data" -v "$PWD/output:/output" \
#     -e MLFLOW_TRACKING_URI=http://mlflow.example:5000 -e MLFLOW_EXPERIMENT_NAME=demo \
#     tracktron                                   # = tracktron train --config configs/demo.yaml ...
#   docker run --rm --gpus all tracktron train --config configs/demo.yaml SOLVER.MAX_ITER 200
#   docker run --rm --gpus all --entrypoint torchrun tracktron --standalone --nproc-per-node=8 \
#     -m trainer train --config configs/demo.yaml DATA_DIR /data OUTPUT_DIR /output/demo
#
# --stop-timeout 60: `docker stop` kills after 10 s by default, before the trainer has saved its
# checkpoint (TRAIN.PREEMPT_GRACE_S, 25 s) on SIGTERM.
#
# The base image's torch/torchvision (2.14.1 + CUDA 13.0, the pair the project is tested with)
# are kept: pip installs the package's other requirements under a constraint that pins them.
# Pick another CUDA build of the same torch with --build-arg BASE_IMAGE=... (e.g. cuda12.6 for
# older drivers); the build reads pyproject.toml with tomllib, so the base needs Python >= 3.11.
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

# PIP_BREAK_SYSTEM_PACKAGES: recent pytorch/pytorch images ship the distribution's Python
# (PEP 668 "externally managed"); this image is the environment, so pip may install into it.
# GIT_PYTHON_REFRESH: the runtime image has no git; MLflow should not warn about it every run.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    GIT_PYTHON_REFRESH=quiet

WORKDIR /app

# 1. The requirements (a layer that survives code changes), torch pinned to the base's own, MLflow,
#    moto and the AWS client to the versions the suite is run against (constraints.txt).
COPY pyproject.toml constraints.txt ./
RUN set -eux; \
    python3 -m pip list --format=freeze \
      | grep -iE '^(torch|torchvision|torchaudio|triton|nvidia-[a-z0-9-]+)==' > /etc/tracktron-torch-constraints.txt; \
    grep -iq '^torch==' /etc/tracktron-torch-constraints.txt; \
    grep -iq '^torchvision==' /etc/tracktron-torch-constraints.txt; \
    python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt; \
    python3 -m pip install -c /etc/tracktron-torch-constraints.txt -c constraints.txt -r /tmp/requirements.txt; \
    rm /tmp/requirements.txt

# 2. The package itself (no dependency changes: torch stays the base image's).
COPY README.m[d] ./
COPY trainer ./trainer
COPY configs ./configs
RUN set -eux; \
    python3 -m pip install --no-deps -c /etc/tracktron-torch-constraints.txt .; \
    rm -rf build ./*.egg-info; \
    python3 -c "import torch, torchvision, trainer.cli; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torchvision', torchvision.__version__)"; \
    tracktron --help > /dev/null

# A non-root user (numeric, so that Kubernetes' runAsNonRoot can check it). /data and /output are
# created owned by it, so fresh named volumes are writable; /app itself (not the code in it) is
# writable too, for the embedded tracking store (sqlite:///mlflow.db + ./mlruns) when no
# MLFLOW_TRACKING_URI is given. OpenShift runs an image as an arbitrary user id of group 0, not this
# user: these folders and HOME (the weights caches) belong to group 0 with the owner's rights.
ARG UID=10001
ARG GID=10001
RUN set -eux; \
    groupadd --gid "${GID}" tracktron; \
    useradd --uid "${UID}" --gid "${GID}" --create-home --shell /bin/bash tracktron; \
    mkdir -p /data /output; \
    chown "${UID}:0" /data /output /app; \
    chmod g=u /data /output /app; \
    chgrp -R 0 /home/tracktron; \
    chmod -R g=u /home/tracktron
USER ${UID}:${GID}
ENV HOME=/home/tracktron \
    TORCH_HOME=/home/tracktron/.cache/torch

# Datasets (DATA_DIR) and everything a job writes locally (OUTPUT_DIR): checkpoints, config.yaml,
# json_stats.log. The tracking server is chosen by environment: MLFLOW_TRACKING_URI,
# MLFLOW_EXPERIMENT_NAME, MLFLOW_TRACKING_USERNAME/PASSWORD, and for an S3 artifact store
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, MLFLOW_S3_ENDPOINT_URL.
VOLUME ["/data", "/output"]

ENTRYPOINT ["tracktron"]
CMD ["train", "--config", "configs/demo.yaml", "DATA_DIR", "/data", "OUTPUT_DIR", "/output/demo"]
