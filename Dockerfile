# autoshard's REST service: `docker build -t autoshard . && docker run -p 8000:8000 -v
# autoshard-data:/data autoshard`, then http://localhost:8000/docs. Plans persist in the /data
# volume; the CLI is there too: `docker run --rm --entrypoint autoshard autoshard --help`.
# `--build-arg EXTRAS=cluster` adds PostgreSQL and Ray (compose.yaml, docs/guide/deploy.md).
FROM python:3.11-slim
ARG EXTRAS=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY autoshard ./autoshard
COPY service ./service
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" \
    && useradd --create-home --uid 10001 autoshard \
    && mkdir /data && chown autoshard /data
USER autoshard
VOLUME /data
EXPOSE 8000
# No curl in the slim image: Python's urllib fails (exit 1) on a refused connection or non-2xx.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
ENTRYPOINT ["autoshard", "serve", "--host", "0.0.0.0"]
CMD ["--port", "8000", "--data", "/data"]
