# autoshard: slim Python image with the CLI; the REST service (`autoshard serve`) becomes the
# entrypoint once it exists (issue: REST service).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY autoshard ./autoshard
COPY service ./service
RUN pip install --no-cache-dir . && useradd --create-home autoshard
USER autoshard
ENTRYPOINT ["autoshard"]
CMD ["--help"]
