# The image a fluidps job runs on Kubernetes (fluidps k8s render --image ...): Python,
# fluidps from this source tree, and the training scripts of examples/ (with scikit-learn
# for their digits). Build it from the repository root and push it where the cluster
# pulls from:
#
#   docker build -t registry.example/fluidps:0.1 .
#   docker push registry.example/fluidps:0.1
#
# Put your own script in /app (COPY train.py /app/) and name it in the render command:
#   fluidps k8s render ... --image registry.example/fluidps:0.1 -- python /app/train.py
# CI does not build it (it reaches no registry); tests/unit/test_kubernetes.py checks the
# manifests that use it.
FROM python:3.11-slim

# numba's generated code is cached here (FLUIDPS_CACHE_DIR), writable by the job's user.
ENV FLUIDPS_CACHE_DIR=/var/cache/fluidps \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    OPENBLAS_NUM_THREADS=1

# The repository root is the package `fluidps` (pyproject.toml maps it).
COPY . /opt/fluidps
RUN pip install --no-cache-dir /opt/fluidps scikit-learn \
    && mkdir -p /app /var/cache/fluidps \
    && cp -r /opt/fluidps/examples/. /app/ \
    && useradd --uid 10001 --no-create-home fluidps \
    && chown fluidps /var/cache/fluidps

USER 10001
WORKDIR /app
CMD ["fluidps", "--help"]
